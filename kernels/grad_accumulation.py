"""Linear and embedding layers whose backward adds the weight gradient straight into the persistent `.grad`.

Plain autograd has a layer's backward return a new weight-gradient tensor, which AccumulateGrad then adds to
`.grad`: an allocation of the gradient's size and one more pass over it, every micro-batch. Trilith's data
parallelism keeps each gradient as a view into a persistent bucket (parallel/ddp.py; ZeRO-3: into the unit's
full-gradient buffer while its backward runs, parallel/fsdp.py); for the backward passes
of a training step it marks those parameters (`fuse_grad_accumulation`), and these layers then add into
`.grad` in place — the linear layer inside the weight-gradient matmul (addmm with β = 1), the embedding by
adding the rows it read (index_add_) — and return no weight gradient. The parameter's post-accumulate hooks
still run (autograd calls AccumulateGrad with nothing to add), so bucketing is unchanged. Megatron-LM's
gradient_accumulation_fusion does the same on CUDA with a kernel of its own. Measured on one CPU thread at
the peer benchmark's shape (docs/benchmarks.md): 8 micro-batches of 256 tokens, as a pipeline stage
accumulates them, 2.7–3.3% less time per step; one micro-batch of 1,024 tokens 0.2–0.6%.

Into a zeroed `.grad` the result is bit-equal to plain autograd's (0 + x = x); over several micro-batches
the matmul adds into the running sum as it goes, which rounds differently (one rounding per step of the
matmul's inner loop instead of one for the product and one for the sum; tests/test_grad_accumulation.py).
Unmarked weights, a `.grad` that is None, torch.compile and calls without autograd take the plain functions,
and so does `torch.autograd.grad` outside a training step: it must return gradients, not add them to `.grad`.

`WeightGradQueue` splits a backward pass in two, as zero-bubble pipeline schedules do (Qi et al., 2023, "B"
and "W"): inside its `with` block the fused linear layers compute their input gradient only and queue the
weight-gradient matmul; `run()` adds the queued products afterwards. A pipeline stage sends the input
gradient in between (parallel/pipeline_schedules.py), so the previous stage starts its backward one
weight-gradient pass earlier. The same products go into the same `.grad` in the same order: bit-identical.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


_queue: WeightGradQueue | None = None  # the active queue, if any


class WeightGradQueue:
    """The weight gradients of the fused linear layers in one backward pass, computed later by `run()`.

    A queued weight's post-accumulate hooks still fire during the backward, before its gradient is complete:
    `is_pending(weight)` tells a hook so. `run()` adds each queued product into `.grad` and then calls the
    weight's `on_deferred_grad(weight)`, where its owner set one (parallel/ddp.py counts it ready there)."""

    def __init__(self):
        self.entries: list = []  # (weight, output gradient [n, out], input [n, in])
        self.queued: set = set()  # ids of the weights in entries

    def __enter__(self) -> WeightGradQueue:
        global _queue
        _queue = self
        return self

    def __exit__(self, *exc) -> None:
        global _queue
        _queue = None

    def add(self, weight: torch.Tensor, flat_grad: torch.Tensor, flat_x: torch.Tensor) -> None:
        self.entries.append((weight, flat_grad, flat_x))
        self.queued.add(id(weight))

    @torch.no_grad()  # as inside the backward pass: the queued inputs require grad themselves
    def run(self) -> None:
        """Add every queued weight gradient into `.grad`, in queue order (the backward's own order)."""
        last_use = {id(w): i for i, (w, _, _) in enumerate(self.entries)}
        entries, self.entries, self.queued = self.entries, [], set()
        for i, (weight, flat_grad, flat_x) in enumerate(entries):
            weight.grad.addmm_(flat_grad.t(), flat_x)
            done = getattr(weight, "on_deferred_grad", None)
            if done is not None and last_use[id(weight)] == i:
                done(weight)


def is_pending(weight: torch.Tensor) -> bool:
    """Whether `weight`'s gradient of the running backward pass waits in the active WeightGradQueue."""
    return _queue is not None and id(weight) in _queue.queued


def _fused(weight: torch.Tensor) -> bool:
    return getattr(weight, "fuse_grad_accumulation", False) and weight.requires_grad and \
        torch.is_grad_enabled() and not torch.compiler.is_compiling()


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        flat_grad = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)
        if ctx.needs_input_grad[1]:
            flat_x = x.reshape(-1, x.shape[-1])
            if weight.grad is None:
                grad_weight = flat_grad.t().mm(flat_x)
            elif _queue is not None:
                _queue.add(weight, flat_grad, flat_x)
            else:
                weight.grad.addmm_(flat_grad.t(), flat_x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_x, grad_weight, grad_bias


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        ids, weight = ctx.saved_tensors
        if weight.grad is None:  # F.embedding's own backward
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, weight.shape[0], -1, False)
        weight.grad.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        return None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; for a marked weight, its gradient is added into `weight.grad` inside the matmul."""
    if not _fused(weight):
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding; for a marked weight, the rows of its gradient are added into `weight.grad`."""
    if not _fused(weight):
        return F.embedding(ids, weight)
    return _Embedding.apply(ids, weight)
