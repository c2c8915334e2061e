"""The zero-bubble schedules ZB-H1 and ZBV, run from their plan (parallel/zero_bubble_plan.py).

Each slot of this rank's plan runs in order: F (`_Steps.forward`), B (the input gradient only: the fused
linear layers queue their weight-gradient matmuls in the micro-batch's own WeightGradQueue, which it keeps)
or W (that queue's `run()`). After a slot comes the tick's exchange, if the plan has one: one
`PipelineComm.communicate` carrying what this slot produced to rank ± 1 and what the neighbours produced in
the same tick. Under the V placement activations travel to the previous rank on the way back up the V
(send_prev / recv_next, the gradient direction's tags), gradients to the next; rank p − 1 hands its first
chunk's output to its second chunk itself. `forward_only_v` is the evaluation pass of the V placement.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.grad_accumulation import WeightGradQueue
from parallel.comm import named_range
from parallel.zero_bubble_plan import plan


def loss_rank(schedule: str, pipe) -> int:
    """Global rank of the stage that computes the loss: the last, or under the V the first."""
    return dist.get_global_rank(pipe.group, 0) if schedule == "zbv" else pipe.last_rank


def run_zero_bubble(schedule: str, steps, pipe) -> None:
    """One step of `schedule` on this rank: `steps` is pipeline_schedules._Steps over this rank's chunks."""
    p, rank, m = pipe.pp_size, pipe.pp_rank, len(steps.micro_batches)
    mine = plan(schedule, p, m)[rank]
    turn = schedule == "zbv" and rank == p - 1  # this rank's two chunks are consecutive in the model
    inputs, grads, outputs, queues = {}, {}, {}, {}
    slots = {tick: (kind, chunk, mb) for tick, kind, chunk, mb in mine.slots}
    for tick in sorted(set(slots) | set(mine.exchanges)):
        kind, produced, sent_activation = None, None, None
        if tick in slots:
            kind, chunk, mb = slots[tick]
            model = steps.chunks[chunk]
            if kind == "F":
                out = steps.forward(chunk, mb, None if model.pre_process else inputs[chunk, mb])
                outputs[chunk, mb] = produced = out
                if turn and chunk == 0:
                    inputs[1, mb] = out.detach().requires_grad_(True)
            elif kind == "B":
                received = None if model.pre_process else inputs.pop((chunk, mb))
                grad = None if model.post_process else grads.pop((chunk, mb))
                with WeightGradQueue() as queue:
                    produced = steps.backward(chunk, mb, received, outputs.pop((chunk, mb)), grad, keep=True)
                queues[chunk, mb] = queue
                if turn and chunk == 1:
                    grads[0, mb] = produced
            else:
                _weight_gradients(steps, queues.pop((chunk, mb)), chunk, mb)
        exchange = mine.exchanges.get(tick)
        if exchange is None:
            continue
        if exchange.send_next or exchange.send_prev:
            sent_activation = (chunk, produced) if kind == "F" else None
        from_prev, from_next = pipe.communicate(
            send_next=produced if exchange.send_next else None, send_prev=produced if exchange.send_prev else None,
            recv_prev=exchange.recv_prev is not None, recv_next=exchange.recv_next is not None)
        for message, tensor in ((exchange.recv_prev, from_prev), (exchange.recv_next, from_next)):
            if message is not None:
                what, chunk_to, mb_to = message
                if what == "act":
                    inputs[chunk_to, mb_to] = tensor.requires_grad_(True)
                else:
                    grads[chunk_to, mb_to] = tensor.detach()
        if sent_activation is not None:
            steps.release(*sent_activation)
    assert not queues and not inputs and not grads, "the zero-bubble plan left work undone"


def _weight_gradients(steps, queue: WeightGradQueue, chunk: int, mb: int) -> None:
    start = steps.trace.mark() if steps.trace is not None else None
    with named_range("weight gradients"):
        queue.run()
    if steps.trace is not None:
        steps.trace.add("W", mb, chunk, start, steps.trace.mark())


@torch.no_grad()
def forward_only_v(chunks, micro_batches: list, pipe) -> list:
    """Evaluation under the V placement: each micro-batch goes down the ranks through their first chunks and
    back up through their second ones. Returns the losses of rank 0 (the others: none). The operations of
    all ranks follow one chain (micro-batch, model chunk), so the blocking exchanges cannot deadlock."""
    losses = []
    for mb in micro_batches:
        down = None if pipe.is_first else pipe.communicate(recv_prev=True)[0]
        args, kwargs = mb.forward_args(True, False, None) if pipe.is_first else mb.forward_args(False, False, down)
        out = chunks[0](*args, **kwargs)
        if pipe.is_last:
            up = out
        else:
            pipe.communicate(send_next=out)
            up = pipe.communicate(recv_next=True)[1]
        args, kwargs = mb.forward_args(False, pipe.is_first, up)
        out = chunks[1](*args, **kwargs)
        if pipe.is_first:
            losses.append(out.float())
        else:
            pipe.communicate(send_prev=out)
    return losses
