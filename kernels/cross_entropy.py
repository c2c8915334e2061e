"""Cross-entropy over (possibly vocabulary-split) logits, computed in token chunks.

A plain implementation materialises fp32 copies of the full logits ([tokens, vocab], 4 bytes each: 2 GiB
for 4096 tokens of a 128k vocabulary) and keeps the fp32 softmax for backward. Here forward and backward
walk over `chunk_tokens` rows at a time: only one chunk is ever in fp32, and backward keeps just the
logits in their own dtype and one log-sum-exp per token, recomputing the softmax chunk by chunk.

`linear_cross_entropy` goes one step further and takes the output layer in: it computes each chunk's
logits from the hidden states and the output weight, in forward and again in backward, so neither the
logits ([tokens, vocab] in the compute dtype) nor their gradient is ever held whole, for one extra matmul
of the output layer's size.

`compile_backend` (set by `train.compile`): the per-chunk work (fp32 cast, padding mask, max, target,
sum of exponentials; in backward softmax − one-hot) goes through torch.compile, which fuses those passes
over the chunk into a few kernels that read the logits in their own dtype; eager runs each as its own
full pass over an fp32 copy (measured on an H200: ~16% of a compiled 1B step at a 128k vocabulary).

Vocabulary parallelism: each rank holds the logits columns [vocab_start, vocab_start + V_local) and the
caller passes `all_reduce(tensor, op)` (op "max" or "sum", in place over the vocabulary-parallel group).
Exactly three all-reduces of one fp32 value per token are issued (max, target logit, sum of
exponentials), whatever the chunk size. This module itself never talks to torch.distributed.
"""
from __future__ import annotations

import torch


def _chunk_float(logits, pad_from):
    if pad_from is None:
        return logits.float()
    chunk = logits.to(torch.float32, copy=True)  # never write into the caller's logits
    chunk[:, pad_from:] = float("-inf")  # vocabulary padding must never take part in the softmax
    return chunk


def _local_labels(labels, vocab_start, local_vocab):
    local = labels - vocab_start
    outside = (local < 0) | (local >= local_vocab)
    return local.masked_fill(outside, 0), outside


def chunk_statistics(chunk, local_labels, pad_from):
    """Of one chunk of logits rows in their own dtype: fp32 row max, target logit and sum of exp(x − max)."""
    chunk = _chunk_float(chunk, pad_from)
    m = chunk.max(dim=-1).values
    target = chunk.gather(-1, local_labels[:, None]).squeeze(-1)
    shift = m.masked_fill(m == float("-inf"), 0.0)  # a rank holding only padding: its sum is 0
    return m, target, (chunk - shift[:, None]).exp().sum(dim=-1)


def chunk_logits_grad(chunk, lse, local_labels, inside, grad_loss, pad_from):
    """d loss / d logits of one chunk (fp32): (softmax − one-hot of the target) × upstream grad."""
    probs = (_chunk_float(chunk, pad_from) - lse[:, None]).exp_()
    probs.scatter_add_(-1, local_labels[:, None], -inside[:, None])
    return probs.mul_(grad_loss[:, None])


_compiled: dict = {}


def chunk_kernels(compile_backend: str | None):
    """(chunk_statistics, chunk_logits_grad), compiled with `compile_backend` once per process, or eager."""
    if compile_backend is None:
        return chunk_statistics, chunk_logits_grad
    if compile_backend not in _compiled:
        _compiled[compile_backend] = (torch.compile(chunk_statistics, backend=compile_backend),
                                      torch.compile(chunk_logits_grad, backend=compile_backend))
    return _compiled[compile_backend]


def _statistics(chunk_of, n, step, local_labels, outside, all_reduce, device, stats_kernel, pad_from):
    """Per token: the log-sum-exp over the whole vocabulary and the loss, from the chunks chunk_of(a, b)
    of this rank's columns; the three all-reduces combine the vocabulary-parallel ranks."""
    local_max = torch.empty(n, dtype=torch.float32, device=device)
    sum_exp = torch.empty_like(local_max)
    target = torch.empty_like(local_max)
    for start in range(0, n, step):
        stop = min(start + step, n)
        local_max[start:stop], target[start:stop], sum_exp[start:stop] = stats_kernel(
            chunk_of(start, stop), local_labels[start:stop], pad_from)
    global_max = local_max.clone()
    all_reduce(global_max, "max")
    target = (target - global_max).masked_fill(outside, 0.0)
    all_reduce(target, "sum")
    finite_max = local_max.masked_fill(local_max == float("-inf"), 0.0)
    sum_exp.mul_((finite_max - global_max).exp())  # rescale each rank's sum to the global max
    all_reduce(sum_exp, "sum")
    log_sum_exp = sum_exp.log()
    return log_sum_exp + global_max, log_sum_exp - target


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, chunk_tokens, vocab_start, vocab_size, all_reduce, compile_backend):
        shape = labels.shape
        logits2 = logits.reshape(-1, logits.shape[-1])
        n, local_vocab = logits2.shape
        pad_from = vocab_size - vocab_start if vocab_start + local_vocab > vocab_size else None
        local_labels, outside = _local_labels(labels.reshape(-1), vocab_start, local_vocab)
        step = chunk_tokens if chunk_tokens > 0 else max(n, 1)
        stats, ctx.grad_kernel = chunk_kernels(compile_backend)
        lse, loss = _statistics(lambda a, b: logits2[a:b], n, step, local_labels, outside, all_reduce,
                                logits.device, stats, pad_from)
        ctx.save_for_backward(logits, local_labels, outside, lse)
        ctx.step, ctx.pad_from, ctx.shape = step, pad_from, logits.shape
        return loss.view(shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local_labels, outside, lse = ctx.saved_tensors
        logits2 = logits.reshape(-1, logits.shape[-1])
        grad_loss = grad_loss.reshape(-1).float()
        grad = torch.empty_like(logits2)
        inside = (~outside).to(torch.float32)
        for start in range(0, logits2.shape[0], ctx.step):
            stop = min(start + ctx.step, logits2.shape[0])
            grad[start:stop] = ctx.grad_kernel(logits2[start:stop], lse[start:stop], local_labels[start:stop],
                                               inside[start:stop], grad_loss[start:stop], ctx.pad_from)
        return grad.view(ctx.shape), None, None, None, None, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """The output layer and the loss in one: logits exist one token chunk at a time, in forward and again
    (recomputed) in backward, so neither the logits nor their gradient is ever held whole."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, vocab_start, vocab_size, all_reduce, compile_backend):
        shape = labels.shape
        hidden2 = hidden.reshape(-1, hidden.shape[-1])
        n, local_vocab = hidden2.shape[0], weight.shape[0]
        pad_from = vocab_size - vocab_start if vocab_start + local_vocab > vocab_size else None
        local_labels, outside = _local_labels(labels.reshape(-1), vocab_start, local_vocab)
        step = chunk_tokens if chunk_tokens > 0 else max(n, 1)
        stats, ctx.grad_kernel = chunk_kernels(compile_backend)
        lse, loss = _statistics(lambda a, b: hidden2[a:b] @ weight.t(), n, step, local_labels, outside, all_reduce,
                                hidden.device, stats, pad_from)
        ctx.save_for_backward(hidden, weight, local_labels, outside, lse)
        ctx.step, ctx.pad_from = step, pad_from
        return loss.view(shape)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local_labels, outside, lse = ctx.saved_tensors
        hidden2 = hidden.reshape(-1, hidden.shape[-1])
        grad_loss = grad_loss.reshape(-1).float()
        grad_hidden = torch.empty_like(hidden2)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        inside = (~outside).to(torch.float32)
        for start in range(0, hidden2.shape[0], ctx.step):
            stop = min(start + ctx.step, hidden2.shape[0])
            d_logits = ctx.grad_kernel(hidden2[start:stop] @ weight.t(), lse[start:stop], local_labels[start:stop],
                                       inside[start:stop], grad_loss[start:stop], ctx.pad_from).to(weight.dtype)
            grad_hidden[start:stop] = d_logits @ weight
            grad_weight += (d_logits.t() @ hidden2[start:stop]).float()
        return grad_hidden.view(hidden.shape), grad_weight.to(weight.dtype), None, None, None, None, None, None


def _no_reduce(tensor, op):
    return None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 4096, vocab_start: int = 0,
                  vocab_size: int | None = None, all_reduce=None, compile_backend: str | None = None) -> torch.Tensor:
    """Per-token loss with the shape of `labels`.

    logits [..., V_local]: this rank's vocabulary columns (all of them when not split); vocab_size: the
    real vocabulary (columns at or beyond it are padding); chunk_tokens: rows per fp32 chunk, 0 = one
    chunk; all_reduce: the vocabulary-parallel reduction (None when the vocabulary is not split);
    compile_backend: torch.compile backend of the per-chunk kernels (None: eager)."""
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be ≥ 0 (0 = one chunk)")
    vocab_size = vocab_start + logits.shape[-1] if vocab_size is None else vocab_size
    unsplit = all_reduce is None and vocab_start == 0 and vocab_size == logits.shape[-1]
    if unsplit and compile_backend is None and (chunk_tokens == 0 or labels.numel() <= chunk_tokens):
        # One chunk holds everything: torch's fused log-softmax kernel costs the same memory and is faster
        # than the eager chunk kernels (not than the compiled ones, which skip its fp32 copy of the logits).
        return cross_entropy_reference(logits, labels)
    return _ChunkedCrossEntropy.apply(logits, labels, chunk_tokens, vocab_start, vocab_size,
                                      all_reduce or _no_reduce, compile_backend)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 4096,
                         vocab_start: int = 0, vocab_size: int | None = None, all_reduce=None,
                         compile_backend: str | None = None) -> torch.Tensor:
    """Per-token loss of logits = hidden @ weight.T without holding the logits: hidden [..., h], weight
    [V_local, h] (this rank's vocabulary rows); the other arguments as `cross_entropy`. Backward recomputes
    each chunk's logits (one extra [tokens, h] × [h, V_local] matmul) instead of keeping them."""
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be ≥ 0 (0 = one chunk)")
    vocab_size = vocab_start + weight.shape[0] if vocab_size is None else vocab_size
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, vocab_start, vocab_size,
                                     all_reduce or _no_reduce, compile_backend)


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             reduction="none").view(labels.shape)
