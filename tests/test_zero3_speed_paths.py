"""ZeRO's faster paths change no result: the last unit kept gathered between forward and backward (one
all-gather fewer per micro-batch, bit-equal weights), torch's AdamW kernel over the flat shards (equal to the
update written out), and gradient buffers reused from the second step on (no allocation)."""
import math
import sys

import pytest
import torch

from engine.optim.param_groups import no_weight_decay
from parallel import comm
from tests.distributed import worker_pools
from tests.test_data_parallel import CURVE, make_trainer


@pytest.fixture(scope="module")
def pool():
    with worker_pools(2) as made:
        yield made[2]


def gathers_and_weights(rank, world, base, keep_last):
    trainer = make_trainer(rank, world, base, zero_stage=3, zero3_keep_last_gathered=keep_last)
    counts = []
    for _ in range(3):
        with comm.RECORD.capture() as events:
            trainer.train_step()
        counts.append(len([e for e in events if e.op == "all_gather"]))
    peak = trainer.data_parallel.peak_gathered_bytes / max(u.full_bytes for u in trainer.data_parallel.units)
    return counts, [m.clone() for m in trainer.optimizer.master], peak


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_keeping_the_last_unit_saves_one_gather_per_micro_batch_and_changes_nothing(pool, tie):
    base = {**CURVE, "model": dict(CURVE["model"], tie_embeddings=tie)}
    off = pool.run(gathers_and_weights, base, False)
    on = pool.run(gathers_and_weights, base, True)
    micro_batches = CURVE["train"]["global_batch_size"] // (CURVE["train"]["micro_batch_size"] * 2)
    for (counts_off, masters_off, peak_off), (counts_on, masters_on, peak_on) in zip(off, on):
        assert [a - b for a, b in zip(counts_off, counts_on)] == [micro_batches] * 3
        assert all(torch.equal(a, b) for a, b in zip(masters_off, masters_on))
        # without a pipeline the kept unit is the first in backward: no more gathered at once than before
        assert peak_on <= peak_off
        assert peak_on <= (2 if not tie else 3)  # the tied unit is held from the head's backward to the embedding's


def reference_adamw(master, m, v, grad, decay_ranges, step, lr, c):
    """The update written out: decoupled decay on the decayed ranges, bias-corrected moments."""
    for r in decay_ranges:
        master[r.shard_start:r.shard_end].mul_(1 - lr * c.weight_decay)
    m.lerp_(grad, 1 - c.beta1)
    v.mul_(c.beta2).addcmul_(grad, grad, value=1 - c.beta2)
    denom = (v.sqrt() / math.sqrt(1 - c.beta2 ** step)).add_(c.eps)
    master.addcdiv_(m, denom, value=-lr / (1 - c.beta1 ** step))


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_adamw_kernel_over_shards_equals_the_written_out_update(implementation):
    base = {**CURVE, "optim": dict(CURVE["optim"], implementation=implementation, clip_grad=0.05)}
    trainer = make_trainer(0, 1, base, zero_stage=3)
    for _ in range(2):  # moments and step count away from their initial values
        trainer.train_step()
    opt, sdp = trainer.optimizer, trainer.data_parallel
    sdp.zero_grad()
    sdp.start_step(1)
    trainer.forward_backward(trainer.loader.next_global_batch()[:1])
    sdp.finish_gradients()
    grads = [u.master_grad().clone() for u in sdp.units]
    expected_norm = math.sqrt(sum(float(g[r.shard_start:r.shard_end].double().pow(2).sum())
                                  for g, ranges in zip(grads, opt.norm_ranges) for r in ranges))
    state = [[t.clone() for t in (opt.master[i], opt.exp_avg[i], opt.exp_avg_sq[i])] for i in range(len(grads))]
    lr, step = 2e-3, opt.adam_step + 1
    norm, skipped = opt.step(lr)
    assert not skipped and norm == pytest.approx(expected_norm, rel=1e-12)
    scale = base["optim"]["clip_grad"] / (expected_norm + 1e-6)
    assert scale < 1  # the clipped path is the one compared
    for unit, g, (master, m, v), i in zip(sdp.units, grads, state, range(len(grads))):
        decay = [r for r in unit.shard_ranges if not no_weight_decay(r.name, r.param)]
        reference_adamw(master, m, v, g * scale, decay, step, lr, trainer.cfg.optim)
        for got, want in ((opt.master[i], master), (opt.exp_avg[i], m), (opt.exp_avg_sq[i], v)):
            assert (got - want).abs().max() <= 1e-6


def steady_state_allocations(rank, world, base, stage):
    """Buffers the sharding code allocates during steps 3 and 4 (torch.zeros/empty/*_like called from
    parallel/fsdp*.py: gradients, reduction outputs, master gradients), and how many the BufferPool made."""
    trainer = make_trainer(rank, world, base, zero_stage=stage)
    for _ in range(2):
        trainer.train_step()
    calls, created = [], trainer.data_parallel.pool.created
    originals = {name: getattr(torch, name) for name in ("zeros", "empty", "zeros_like", "empty_like")}

    def counting(name):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "fsdp" in caller:
                calls.append((name, caller, sys._getframe(1).f_lineno))
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(torch, name, counting(name))
    try:
        for _ in range(2):
            trainer.train_step()
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)
    return calls, trainer.data_parallel.pool.created - created


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_steady_state_steps_allocate_no_gradient_buffers(pool, stage, precision):
    base = {**CURVE, "train": dict(CURVE["train"], precision=precision)}
    for calls, created in pool.run(steady_state_allocations, base, stage):
        assert calls == [] and created == 0


def accumulation_run(rank, world, base, stage: int, attach: bool):
    """The trained masters, and per step how many parameter gradients backward left in the units' full
    gradient buffers in place and how many `Unit.add_grad` had to copy in. `attach=False` takes the copying
    path for every parameter (the unit never points `.grad` at its buffer)."""
    from parallel.fsdp_units import Unit

    originals = Unit.attach_grads, Unit.add_grad
    counts = []

    def add_grad(unit, p):
        counts[-1]["in place" if id(p) in unit.attached else "copied"] += 1
        originals[1](unit, p)

    Unit.add_grad = add_grad
    if not attach:
        Unit.attach_grads = lambda unit: None
    try:
        trainer = make_trainer(rank, world, base, zero_stage=stage)
        for _ in range(base["train"]["steps"]):
            counts.append({"in place": 0, "copied": 0})
            trainer.train_step()
    finally:
        Unit.attach_grads, Unit.add_grad = originals
    return [m.clone() for m in trainer.optimizer.master], counts


@pytest.mark.parametrize("stage", [1, 3])
def test_backward_accumulates_into_the_unit_buffers_in_place(pool, stage):
    """Every gradient (at stage 3 but the embedding's, looked up by rows) is left in its unit's buffer by backward
    itself. The weights are those of copying each gradient in: to the bit at stage 3, whose every micro-batch
    has a zeroed buffer of its own; within 1e-6 at stage 1, whose buffer accumulates the micro-batches inside the
    matmul (kernels/grad_accumulation.py)."""
    base = {**CURVE, "train": dict(CURVE["train"], steps=3)}
    fused = pool.run(accumulation_run, base, stage, True)
    copied = pool.run(accumulation_run, base, stage, False)
    trainer = make_trainer(0, 1, base, zero_stage=stage)
    per_micro_batch = sum(1 for n, _ in trainer.named_params) - (1 if stage == 3 else 0)
    micro_batches = CURVE["train"]["global_batch_size"] // (CURVE["train"]["micro_batch_size"] * 2)
    for (masters, counts), (plain_masters, plain_counts) in zip(fused, copied):
        assert counts == [{"in place": per_micro_batch * micro_batches, "copied": 0}] * 3
        assert plain_counts == [{"in place": 0, "copied": per_micro_batch * micro_batches}] * 3
        if stage == 3:
            assert all(map(torch.equal, masters, plain_masters))
        else:
            assert max((a - b).abs().max().item() for a, b in zip(masters, plain_masters)) <= 1e-6
