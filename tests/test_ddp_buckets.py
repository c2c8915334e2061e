"""Bucketed DDP keeps gradients in persistent contiguous buckets: every `.grad` (but a low-precision one reduced
in fp32) is a view into its bucket across steps, and the reduced gradients are bit-equal to an explicit
per-parameter average (2 ranks: a sum of two values does not depend on the order, so equality is exact)."""
import unittest.mock

import pytest
import torch

from kernels import grad_accumulation
from parallel import comm
from tests.distributed import worker_pools
from tests.test_data_parallel import CURVE, make_trainer


@pytest.fixture(scope="module")
def pools():
    with worker_pools(2, 4) as made:
        yield made


@pytest.fixture(scope="module")
def pool(pools):
    return pools[2]


def with_precision(precision: str) -> dict:
    return {**CURVE, "train": dict(CURVE["train"], precision=precision)}


def grad_storage(trainer) -> dict:
    """{name: (storage address, element offset, whether it is a view of a bucket)} of every `.grad` set."""
    ddp = trainer.data_parallel
    buffers = {b.buffer.untyped_storage().data_ptr() for b in ddp.buckets if b.in_place}
    return {n: (p.grad.untyped_storage().data_ptr(), p.grad.storage_offset(),
                p.grad.untyped_storage().data_ptr() in buffers) for n, p in trainer.named_params
            if p.grad is not None}


def views_across_steps(rank, world, precision, steps=3):
    trainer = make_trainer(rank, world, with_precision(precision), zero_stage=0, bucket_mb=0.02)
    before = grad_storage(trainer)
    after = []
    for _ in range(steps):
        trainer.train_step()
        after.append(grad_storage(trainer))
        assert all(b.buffer.count_nonzero() == 0 for b in trainer.data_parallel.buckets if b.in_place)  # zeroed
    fp32_reduced = {n for n, p in trainer.named_params if p.dtype != torch.float32 and "norm" in n}
    others = {n for n, _ in trainer.named_params} - fp32_reduced
    return before, after, fp32_reduced, others, len(trainer.data_parallel.buckets)


def check_views(before, after, fp32_reduced, others):
    """Every gradient but the fp32-reduced ones is a bucket view from construction on, at one address."""
    assert set(before) == others and all(view for _, _, view in before.values())
    for step in after:
        assert {n: s for n, s in step.items() if n in others} == before


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_grad_stays_a_view_of_its_bucket_in_one_process(precision):
    before, after, fp32_reduced, others, buckets = views_across_steps(0, 1, precision)
    assert buckets > 1 and (precision == "bf16") == bool(fp32_reduced)
    check_views(before, after, fp32_reduced, others)


def test_every_grad_stays_a_view_of_its_bucket_on_two_ranks(pool):
    for before, after, fp32_reduced, others, _ in pool.run(views_across_steps, "bf16"):
        assert fp32_reduced  # bf16 gradients of their own, summed through an fp32 buffer
        check_views(before, after, fp32_reduced, others)


def reduced_against_per_parameter(rank, world, precision, micro_batches):
    """The bucketing alone: the layers' fused weight-gradient accumulation, which rounds a sum over micro-batches
    differently from autograd's (tests/test_grad_accumulation.py), is off here."""
    with unittest.mock.patch.object(grad_accumulation, "_fused", lambda weight: False):
        return _reduced_against_per_parameter(rank, world, precision, micro_batches)


def _reduced_against_per_parameter(rank, world, precision, micro_batches):
    trainer = make_trainer(rank, world, with_precision(precision), zero_stage=0, bucket_mb=0.02)
    ddp, chunk = trainer.data_parallel, trainer.chunks[0]
    names = [n for n, _ in trainer.named_params]
    params = [p for _, p in trainer.named_params]
    trainer.train_step()  # the second step runs on buffers that were reduced and zeroed once
    batches = trainer.loader.next_global_batch()[:micro_batches]
    local = [torch.zeros_like(p) for p in params]
    for tokens in batches:  # autograd.grad leaves `.grad` and the DDP hooks alone
        grads = torch.autograd.grad(chunk(tokens[:, :-1], tokens[:, 1:]) / len(batches), params, allow_unused=True)
        local = [acc + g if g is not None else acc for acc, g in zip(local, grads)]
    expected = []
    for name, g in zip(names, local):
        flat = g.float() if "norm" in name else g.clone()
        flat.div_(world)
        comm.all_reduce(flat, trainer.topo.dp_group)
        expected.append(flat.to(g.dtype))
    ddp.start_step(len(batches))
    for tokens in batches:
        (chunk(tokens[:, :-1], tokens[:, 1:]) / len(batches)).backward()
    launched = ddp.launched_in_backward
    ddp.finish_gradients()
    unequal = [n for n, p, e in zip(names, params, expected) if not torch.equal(p.grad, e)]
    return unequal, launched, len(ddp.buckets)


@pytest.mark.parametrize("precision,micro_batches", [("fp32", 1), ("fp32", 4), ("bf16", 4)])
def test_bucketed_gradients_equal_a_per_parameter_average_bit_for_bit(pool, precision, micro_batches):
    for unequal, launched, buckets in pool.run(reduced_against_per_parameter, precision, micro_batches):
        assert unequal == []
        assert launched == buckets  # every bucket reduced from inside backward


def test_one_rank_needs_no_fp32_buffer_for_low_precision_norms():
    trainer = make_trainer(0, 1, with_precision("bf16"), zero_stage=0, bucket_mb=1000)
    assert [b.dtype for b in trainer.data_parallel.buckets] == [torch.bfloat16]  # nothing to sum in fp32


def tp_partial_sums_in_fp32(rank, world):
    """TP 2 × DP 2, sequence parallel, bf16: the norm weights' partial gradients (and the replicated K/V rows')
    are summed over TP in fp32 and rounded to bf16 once, after the fp32 DP average."""
    trainer = make_trainer(rank, world, with_precision("bf16"), zero_stage=0, bucket_mb=0.02, tensor=2,
                           sequence_parallel=True)
    ddp, chunk, topo = trainer.data_parallel, trainer.chunks[0], trainer.topo
    named = [(n, p) for n, p in trainer.named_params if getattr(p, "tp_replicated_grad", False)]
    tokens = trainer.loader.next_global_batch()[0]
    grads = torch.autograd.grad(chunk(tokens[:, :-1], tokens[:, 1:]), [p for _, p in named])
    expected = []
    for (name, _), g in zip(named, grads):
        dp_mean = g.float() / 2 if "norm" in name else (g / 2)  # norms average over DP in fp32, K/V in bf16
        comm.all_reduce(dp_mean, topo.dp_group)
        tp_sum = dp_mean.float()
        comm.all_reduce(tp_sum, topo.tp_group)
        expected.append(tp_sum.to(torch.bfloat16))
    ddp.start_step(1)
    chunk(tokens[:, :-1], tokens[:, 1:]).backward()
    ddp.finish_gradients()
    return [n for (n, p), e in zip(named, expected) if not torch.equal(p.grad, e)], [n for n, _ in named]


def test_tensor_parallel_partial_gradients_are_summed_in_fp32(pools):
    for unequal, names in pools[4].run(tp_partial_sums_in_fp32):
        assert any("norm" in n for n in names) and any("k_proj" in n for n in names)
        assert unequal == []


def fused_step(rank, world, micro_batches):
    """A training step with the layers adding their weight gradients into the buckets themselves."""
    trainer = make_trainer(rank, world, CURVE, zero_stage=0, bucket_mb=0.02)
    ddp = trainer.data_parallel
    ddp.start_step(micro_batches)
    marked_during = all(p.fuse_grad_accumulation for b in ddp.buckets if b.in_place for p in b.params)
    for tokens in trainer.loader.next_global_batch()[:micro_batches]:
        (trainer.chunks[0](tokens[:, :-1], tokens[:, 1:]) / micro_batches).backward()
    ddp.finish_gradients()
    marked_after = any(p.fuse_grad_accumulation for b in ddp.buckets if b.in_place for p in b.params)
    return ddp.launched_in_backward, len(ddp.buckets), marked_during, marked_after


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_fused_accumulation_still_launches_every_bucket_from_backward(pool, micro_batches):
    for launched, buckets, marked_during, marked_after in pool.run(fused_step, micro_batches):
        assert launched == buckets > 1  # the post-accumulate hooks fire although the layers return no gradient
        assert marked_during and not marked_after  # marked for the step's backward passes only
