"""Offload's clipped steps and 16-bit transfers (issue 49, items 2, 3 and 6's fp16 case): with clipping on every
step or on none, fp32, bf16 and fp16, DDP and ZeRO, offload with overlap changes no bit against no offload; every
offloaded gradient crosses to the host exactly once per step (a clipped step scales the host copy it has; on CPU
an fp32 one not sent during backward crosses clipped); a 16-bit gradient crosses in 16 bits; a speculative job
still queued when the step clips is cancelled, not run; the offload wrapper (engine/optim/host_offload.py) treats
a host gradient as the device does, keeps an fp32 master in its write-back's buffer, and does nothing without
offloaded pieces.
"""
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import engine.data_parallel
from engine.config.schema import validate
from engine.optim.host_offload import HostOffload
from engine.optim.offload import HostGrad
from engine.optim.offload_overlap import SpeculativeHostSteps
from engine.optim.replicated import LossScaler
from engine.train import Trainer
from parallel.distributed import DistEnv
from tests.distributed import worker_pools
from tests.test_data_parallel import make_config
from tests.test_offload import assert_same, owned

STEPS = 6
BASE = {"model": dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                      vocab_size=61, seq_length=16),
        "train": dict(micro_batch_size=1, global_batch_size=8, steps=STEPS, seed=11),
        "optim": dict(lr=3e-3, warmup_steps=2), "data": dict(mock=True)}


@pytest.fixture(scope="module")
def pool():
    with worker_pools(2) as made:
        yield made[2]


def run(rank, world, precision, fraction, clip, overlap, parallel, staged=False):
    """STEPS steps; (steps, owned state, host pieces, sends per step, 16-bit bytes sent, overlap readings).
    `staged`: the path a GPU takes (every gradient and master through its host buffers), not CPU's in-place one."""
    base = {**BASE, "train": dict(BASE["train"], precision=precision),
            "optim": dict(BASE["optim"], offload_fraction=fraction, clip_grad=clip, offload_overlap=overlap)}
    cfg = make_config(base, **parallel)
    validate(cfg, world)
    pays = engine.data_parallel.speculation_pays
    engine.data_parallel.speculation_pays = lambda *args: True  # auto as where it pays (never on a CPU device)
    try:
        trainer = Trainer(cfg, DistEnv(rank, world, 0, torch.device("cpu"), "gloo"))
    finally:
        engine.data_parallel.speculation_pays = pays
    opt, sends = trainer.optimizer, []
    if staged:
        opt.host.in_place = False
        for write_back in opt.host.write_backs.values():
            write_back.in_place = False
    if fraction:
        send = opt.host.send_grad

        def counted(i, coef=None):
            sent = send(i, coef)
            sends.append(sum(t.element_size() for t in sent[:1]))  # the bytes per element the gradient crosses in
            return sent
        opt.host.send_grad = counted
    records, per_step = [], []
    for _ in range(STEPS):
        before = len(sends)
        records.append(trainer.train_step())
        per_step.append(len(sends) - before)
    trainer.loader.close()
    return ([(r["loss"], r["grad_norm"], r["skipped"]) for r in records], owned(trainer),
            len(opt.host.host_grads) if fraction else 0, per_step, set(sends),
            [r.get("offload_redos") for r in records])


# (id, precision, clip, optim.offload_overlap, parallel[, staged]): clipping bites on every step (0.01) or never
CASES = [
    ("ddp-bf16-clip-every-step", "bf16", 0.01, "true", dict(zero_stage=0)),
    ("zero1-bf16-clip-every-step-auto", "bf16", 0.01, "auto", dict(zero_stage=1)),
    ("zero2-fp16-no-clip", "fp16", 0.0, "auto", dict(zero_stage=2)),
    ("ddp-fp16-clip-every-step-auto", "fp16", 0.01, "auto", dict(zero_stage=0)),
    ("zero1-fp32-clip-every-step-auto", "fp32", 0.01, "auto", dict(zero_stage=1)),
    ("ddp-fp32-clip-every-step", "fp32", 0.01, "true", dict(zero_stage=0)),
    ("zero2-fp32-no-clip", "fp32", 0.0, "true", dict(zero_stage=2)),
    ("zero1-fp32-clip-every-step-auto-staged", "fp32", 0.01, "auto", dict(zero_stage=1), True),
    ("ddp-bf16-clip-every-step-auto-staged", "bf16", 0.01, "auto", dict(zero_stage=0), True),
]


@pytest.mark.parametrize("precision,clip,overlap,parallel,staged",
                         [c[1:] if len(c) == 6 else (*c[1:], False) for c in CASES], ids=[c[0] for c in CASES])
def test_offload_with_overlap_is_exact_and_copies_each_gradient_once(pool, precision, clip, overlap, parallel,
                                                                       staged):
    off = pool.run(run, precision, 0.0, clip, overlap, parallel)
    on = pool.run(run, precision, 1.0, clip, overlap, parallel, staged)
    for (steps_off, state_off, *_), (steps_on, state_on, pieces, per_step, widths, redos) in zip(off, on):
        assert pieces > 0
        assert steps_on == steps_off
        assert_same(state_off, state_on)
        assert per_step == [pieces] * STEPS  # once per step, clipped or not
        assert widths == {4 if precision == "fp32" else 2}  # in its own dtype: 16-bit gradients in 16 bits
        finite = [n for _, n, skipped in steps_off if not skipped]
        if not clip:
            assert redos[-1] == 0
            continue
        assert all(n > clip for n in finite)
        # true: each clipped step discards its speculation; auto: only the first, then it stops speculating
        assert redos[-1] == (len(finite) if overlap == "true" else 1)


class _Scaler:
    enabled, scale = False, 1.0


class _Optimizer:
    """The state interface SpeculativeHostSteps steps through: piece 0's job blocks until released."""

    def __init__(self):
        self.host_grads = {i: HostGrad(torch.zeros(4), torch.bfloat16, torch.empty(4, dtype=torch.bfloat16))
                           for i in range(3)}
        self.scaler, self.adam_step, self.stepped = _Scaler(), 0, []
        self.release, self.running = threading.Event(), threading.Event()

    def send_grad(self, i):
        grad = torch.full((4,), float(i + 1), dtype=torch.bfloat16)
        self.host_grads[i].send(grad)
        return [grad]

    def speculate(self, i, grad, lr, adam_step):
        assert not torch.is_grad_enabled()  # the worker runs without autograd
        if i == 0:
            self.running.set()
            self.release.wait(10)
        self.stepped.append((i, grad.clone()))


def test_a_clipped_step_cancels_the_jobs_not_started():
    opt = _Optimizer()
    steps = SpeculativeHostSteps(opt, [0, 1, 2], on_cuda=False, threads=1)
    steps.begin(lr=1.0)
    for i in range(3):
        steps.reduced(i)
    assert opt.running.wait(10)  # settle must meet piece 0 running: on a loaded host the worker starts it late
    queued = [steps.jobs[i] for i in (1, 2)]

    def release_once_cancelled():  # piece 0 ends only after settle has cancelled 1 and 2, however slow the host
        while not all(job.cancelled() for job in queued):
            time.sleep(0.01)
        opt.release.set()
    threading.Thread(target=release_once_cancelled, daemon=True).start()
    started = time.perf_counter()
    committed, landed = steps.settle(commit=False, backward_end=started)
    assert committed == set() and landed == {0}  # piece 0 was running: waited for; 1 and 2 cancelled
    assert [i for i, _ in opt.stepped] == [0]
    assert torch.equal(opt.stepped[0][1], torch.ones(4))  # upcast on the host
    assert opt.host_grads[1].land().tolist() == [2.0] * 4  # the copy made stays usable for the redo
    assert steps.worker.submit(torch.get_num_threads).result() == 1  # optim.offload_threads


def test_ddp_with_offload_is_warned_towards_zero1():
    from engine.config.schema import load_config
    from engine.memory_estimate import ddp_offload_warning
    from tests.test_memory_estimate import TINY
    cfg = load_config(TINY, ["optim.offload_fraction=1"])
    warning = ddp_offload_warning(cfg, 8)
    assert "each of the 8 data-parallel ranks" in warning and "set parallel.zero_stage=1" in warning
    assert ddp_offload_warning(cfg, 1) is None  # one rank: nothing repeated
    assert ddp_offload_warning(load_config(TINY, ["optim.offload_fraction=1", "parallel.zero_stage=1"]), 8) is None
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "tools/estimate_memory.py", "--config", TINY, "--world-size", "2",
                           "optim.offload_fraction=1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "WARNING optim.offload_fraction=1 under DDP" in done.stdout


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_every_write_back_is_waited_for_before_its_parameter_is_read(tmp_path, zero_stage):
    """The write-back's event wait (a no-op on CPU, recorded here) comes before the parameter's first read in the
    next step: DDP, a module's forward that holds it; ZeRO-3, its unit's gather."""
    cfg = make_config({**BASE, "optim": dict(BASE["optim"], offload_fraction=1.0)}, zero_stage=zero_stage)
    cfg.run.dir = str(tmp_path)
    validate(cfg, 1)
    trainer = Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), "gloo"))
    trainer.train_step()
    opt, log = trainer.optimizer, []
    for i, write_back in opt.host.write_backs.items():
        write_back.wait = lambda i=i: log.append(("wait", i))
    if zero_stage == 0:
        index = {id(opt.params[i]): i for i in opt.host.write_backs}
        for chunk in trainer.chunks:
            for module in chunk.modules():
                held = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
                if held:
                    module.register_forward_pre_hook(lambda m, args, held=held: log.extend(("use", i) for i in held))
    else:
        for unit in trainer.data_parallel.units:
            gather = unit.gather
            unit.gather = lambda async_op=False, i=unit.index, gather=gather: (log.append(("use", i)),
                                                                               gather(async_op))[1]
    trainer.train_step()
    trainer.loader.close()
    used = {i for kind, i in log if kind == "use"}
    assert used and used <= set(opt.host.write_backs)
    for i in used:
        assert ("wait", i) in log and log.index(("wait", i)) < log.index(("use", i)), i


class _Update:
    """What HostOffload asks of the optimizer it wraps, for a step without speculation."""

    def __init__(self, grads):
        self.grads, self.scaler, self.adam_step = grads, LossScaler(True), 0

    def device_grad(self, i):
        return self.grads[i], None


def test_the_offload_wrapper_lands_a_gradient_as_the_device_treats_it_and_is_inert_without_pieces():
    torch.manual_seed(0)
    grads = [(torch.randn(5) * 1000).bfloat16() for _ in range(2)]
    masters = [torch.randn(5) for _ in grads]
    opt, cfg, cpu = _Update(grads), SimpleNamespace(offload_overlap="false", offload_threads=1), torch.device("cpu")
    host = HostOffload(opt, cfg, masters, {1: (5, torch.bfloat16, torch.bfloat16, slice(0, 0))}, cpu)
    assert 1 in host and 0 not in host
    host.send()
    assert host.settle(overflow=False, clip=True, backward_end=0.0) == set()
    landed = host.land(0.37)
    device = grads[1].float()  # the device's upcast, unscaling and clip, as the optimizers run them
    torch._foreach_div_([device], opt.scaler.scale)
    torch._foreach_mul_([device], 0.37)
    assert set(landed) == {1} and torch.equal(landed[1], device)
    params = [torch.zeros(5, dtype=torch.bfloat16) for _ in grads]
    host.write_back(params, masters, ["model.layers.0.w", "lm_head.weight"])
    assert torch.equal(params[1], masters[1].bfloat16()) and not params[0].any()  # only the offloaded one
    none = HostOffload(opt, cfg, masters, {}, cpu)
    none.send()
    none.write_back(params, masters, ["a", "b"])
    assert 0 not in none and none.settle(False, True, 0.0) == set() and none.land(0.37) == {}
    assert none.readings() == {} and none.speculation is None


def test_an_fp32_master_lives_in_its_write_back_buffer_and_its_gradient_crosses_clipped_on_cpu():
    torch.manual_seed(0)
    grads = [torch.randn(6) * 1000 for _ in range(2)]
    masters = [torch.randn(6) for _ in grads]
    values = [m.clone() for m in masters]
    opt, cfg, cpu = _Update(grads), SimpleNamespace(offload_overlap="false", offload_threads=1), torch.device("cpu")
    opt.scaler = LossScaler(False)
    host = HostOffload(opt, cfg, masters, {1: (6, torch.float32, torch.float32, slice(0, 0))}, cpu)
    arena = host.arena.block.untyped_storage().data_ptr()
    assert masters[1].untyped_storage().data_ptr() == arena and torch.equal(masters[1], values[1])
    assert masters[0] is not values[0] and torch.equal(masters[0], values[0])  # not offloaded: untouched
    host.send()
    assert host.deferred == {1}  # crosses in land, clipped on the way
    host.settle(overflow=False, clip=True, backward_end=0.0)
    device = grads[1].clone()
    torch._foreach_mul_([device], 0.37)  # the device's clip, as the optimizers run it
    landed = host.land(0.37)
    assert torch.equal(landed[1], device) and torch.equal(grads[1] * 0.37, device)  # the device's own untouched
    params = [torch.zeros(6) for _ in grads]
    for in_place in (True, False):  # a CPU device's; a GPU's, through the arena
        host.write_backs[1].in_place = in_place
        masters[1].add_(1.0)  # AdamW writes the master where the write-back reads it
        host.write_back(params, masters, ["model.layers.0.w", "lm_head.weight"])
        assert torch.equal(params[1], masters[1]) and not params[0].any()
    host.send()
    host.settle(overflow=False, clip=False, backward_end=0.0)
    assert torch.equal(host.land(None)[1], grads[1])  # not clipped: the plain copy
