"""NCCL's semantics over gloo (parallel/nccl_semantics.py), which every multi-process test runs under: each rule
fails loudly, and the pipeline's exchanges are right when a batch comes back as one handle."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.config.schema import ModelConfig
from parallel import comm, nccl_semantics
from parallel.p2p import PipelineComm
from parallel.topology import Layout, Topology
from tests.distributed import worker_pools

MODEL = dict(vocab_size=64, hidden_size=8, num_layers=2, num_attention_heads=2, num_kv_heads=2, ffn_hidden_size=16,
             seq_length=4)


@pytest.fixture(scope="module")
def pool():
    with worker_pools(2) as made:
        yield made[2]


def coalescing(batch_isend_irecv):
    """torch's batch_isend_irecv as it behaves with NCCL: one work for the whole batch, and the receives'
    buffers written only when that work is waited for."""
    def one_handle(ops):
        staged = {id(op): torch.empty_like(op.tensor) for op in ops if op.op is dist.irecv}
        works = batch_isend_irecv([dist.P2POp(op.op, staged.get(id(op), op.tensor), op.peer, op.group, op.tag)
                                   for op in ops])
        for op in ops:
            if id(op) in staged:
                nccl_semantics.poison(op.tensor)

        class Batch:
            def wait(self, timeout=None):
                for work in works:
                    work.wait()
                for op in ops:
                    if id(op) in staged:
                        op.tensor.copy_(staged[id(op)])
                return True
        return [Batch()]
    return one_handle


def exchange_both_ways(rank, world):
    """Stage 0 sends an activation while receiving a gradient; stage 1 the reverse ([send, recv] batches, as
    1F1B's steady state posts them), with torch's batch call returning one handle per batch."""
    real = dist.batch_isend_irecv
    dist.batch_isend_irecv = coalescing(real)
    try:
        topo = Topology(Layout(pp=2, dp=1), rank)
        pipe = PipelineComm.for_model(topo, ModelConfig(**MODEL), 1, False, torch.float32, torch.device("cpu"))
        mine = torch.full(pipe.shape, float(rank + 1))
        if topo.is_first_stage:
            got = pipe.communicate(send_next=mine, recv_next=True)[1].clone()  # what the backward would read now
        else:
            got = pipe.communicate(send_prev=mine, recv_prev=True)[0].clone()
        pipe.finish()
        return got.tolist() == torch.full(pipe.shape, float(2 - rank)).tolist()
    finally:
        dist.batch_isend_irecv = real


def test_a_batch_returned_as_one_handle_is_waited_for_before_its_receive_is_read(pool):
    assert pool.run(exchange_both_ways) == [True, True]


def async_rules(rank, world):
    group = dist.group.WORLD
    comm.register_group(group, "world")
    seen = {}
    summed = torch.full((4,), float(rank + 1))
    handle = comm.all_reduce(summed, group, async_op=True)
    seen["poisoned_before_wait"] = bool(torch.isnan(summed).all())
    handle.wait()
    seen["sum_after_wait"] = summed.tolist()

    shard = torch.full((2,), float(rank))
    gathered = torch.empty(4)
    handle = comm.all_gather_into(gathered, shard, group, async_op=True)
    shard.add_(10)  # the input written while the gather is in flight
    with pytest.raises(RuntimeError, match="input was written or freed"):
        handle.wait()

    counts = torch.zeros(2, dtype=torch.int64)
    handle = comm.all_reduce(counts, group, async_op=True)
    counts.add_(1)  # the output written while the all-reduce is in flight
    with pytest.raises(RuntimeError, match="output was written"):
        handle.wait()

    with pytest.raises(TypeError, match="NCCL has no such type"):
        comm.all_reduce(torch.zeros(2, dtype=torch.int16), group)
    with pytest.raises(ValueError, match="bitwise"):
        comm.all_reduce(torch.zeros(2, dtype=torch.uint8), group, op=dist.ReduceOp.BOR)

    comm.all_reduce(torch.zeros(1), group, async_op=True)
    with pytest.raises(RuntimeError, match="never waited for"):
        nccl_semantics.assert_drained("the test's step")
    nccl_semantics.assert_drained("a later step")  # reported once

    bound, nccl_semantics._bound_device = nccl_semantics._bound_device, None
    try:
        with pytest.raises(RuntimeError, match="device was bound"):
            comm.barrier(group)
    finally:
        nccl_semantics._bound_device = bound
    comm.barrier(group)
    return seen


def test_async_outputs_are_poison_until_waited_and_misuse_is_named(pool):
    for seen in pool.run(async_rules):
        assert seen == {"poisoned_before_wait": True, "sum_after_wait": [3.0] * 4}


def tags_and_order(rank, world):
    """Rank 0 sends a then b to rank 1 with tags 1 and 2, in two batches; rank 1 receives tag 2 first. gloo
    would match by tag (the first receive gets b); NCCL ignores tags and matches by order (it gets a), and so
    does this mode. Then one communicator's batches complete in posting order: rank 0 posts a receive, then a
    send, and waits for the send alone; the earlier receive has completed under it (its buffer still poisoned
    until its own wait, which reads rank 1's value)."""
    group = dist.group.WORLD
    comm.register_group(group, "world")
    if rank == 0:
        a, b = torch.full((3,), 1.0), torch.full((3,), 2.0)
        works = comm.batch_isend_irecv([("send", a, 1, 1)], group) + comm.batch_isend_irecv([("send", b, 1, 2)], group)
        for work in works:
            work.wait()
        first = None
    else:
        got = [torch.empty(3), torch.empty(3)]
        works = comm.batch_isend_irecv([("recv", got[0], 0, 2)], group) + \
            comm.batch_isend_irecv([("recv", got[1], 0, 1)], group)
        for work in works:
            work.wait()
        first = got[0].tolist()
    if rank == 0:
        received = torch.empty(2)
        [earlier] = comm.batch_isend_irecv([("recv", received, 1, 0)], group)
        [later] = comm.batch_isend_irecv([("send", torch.full((2,), 5.0), 1, 0)], group)
        later.wait()
        order = (earlier.works == [], bool(torch.isnan(received).all()))
        earlier.wait()
        order += (received.tolist(),)
    else:
        sent, received = torch.full((2,), 7.0), torch.empty(2)
        for work in comm.batch_isend_irecv([("send", sent, 0, 0), ("recv", received, 0, 0)], group):
            work.wait()
        order = received.tolist()
    return first, order


def test_tags_are_ignored_and_one_communicators_batches_complete_in_order(pool):
    assert pool.run(tags_and_order) == [(None, (True, True, [7.0, 7.0])), ([1.0] * 3, [5.0, 5.0])]
