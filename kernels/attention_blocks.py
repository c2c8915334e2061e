"""Attention over one block of keys that also returns the log-sum-exp, forward and backward: what ring attention
(parallel/context_ring.py) computes per (query chunk, key chunk) pair and merges by the log-sum-exp.

Two ways, the same arithmetic in fp32 (fp64 stays fp64):
  fused      the pair needs no mask beyond causality on the diagonal: a fused kernel that returns the
             log-sum-exp and whose backward takes the final output and log-sum-exp (`fused_kernel` names it):
             on CPU aten's flash kernel for CPU (`_scaled_dot_product_flash_attention_for_cpu`, run in fp32:
             its bf16 path is slower), on CUDA aten's FlashAttention-2 (bf16/fp16, head dim ≤ 256, a multiple
             of 8). GQA is native to both.
  reference  any mask (documents, window), ALiBi's bias, dropout: the scores formed in fp32 from fp32 copies
             of q and k, so that the saved log-sum-exp is that of the scores the backward recomputes; the
             output in fp32.
Outputs and log-sum-exps are merged in fp32 (`merge_attention`), never rounded to the input dtype in between.
"""
from __future__ import annotations

import math

import torch


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision tensors, else their own (fp64 stays fp64: gradient checks)."""
    return torch.promote_types(t.dtype, torch.float32)


def fused_kernel(q: torch.Tensor, requested: str = "auto") -> str | None:
    """The fused kernel unmasked blocks of `q` go through ("cpu" or "cuda"), or None for the reference path:
    `requested` is model.attention_backend (reference asks for the reference path)."""
    if requested == "reference":
        return None
    if q.device.type == "cpu":
        return "cpu"
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0:
        return "cuda"
    return None


def block_fused(kernel: str, q, k, v, causal: bool) -> tuple:
    """(output in fp32, log-sum-exp [b, hq, sq] in fp32, what the backward needs from the kernel)."""
    if kernel == "cpu":  # in fp32: the CPU kernel's bf16 path is ~5× slower than its fp32 one (no bf16 matmul)
        acc = accumulation_dtype(q)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.to(acc), k.to(acc), v.to(acc), 0.0,
                                                                              causal)
        return out, lse, None
    # not run here (no GPU in this project's CI): the op's own outputs, as its autograd formula passes them on
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal)
    return out.float(), lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def block_fused_backward(kernel: str, state, grad_out, q, k, v, out, lse, causal: bool) -> tuple:
    """(dq, dk, dv) of one block given the FINAL output and log-sum-exp of the queries (over every block): the
    kernel then computes this block's share of the gradient. `grad_out`, `out` in q's dtype."""
    if kernel == "cpu":
        acc = accumulation_dtype(q)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.to(acc) for t in (grad_out, q, k, v, out)), lse, 0.0, causal)
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse.float().contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)


def block_reference(q, k, v, allowed, dropout=None, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [b, hq, sq, d] over k, v [b, hkv, sk, d] under the boolean mask `allowed` [b or 1, 1, sq,
    sk]: (output [b, hq, sq, d], log-sum-exp of the scores [b, hq, sq]), both fp32 (fp64 for fp64). A query that
    sees no key of the block gets output 0 and log-sum-exp -inf, so that `merge_attention` gives the block no
    weight. `dropout` [b, hq, sq, sk]: the factor each probability is multiplied by (0 where dropped, 1/(1−p)
    where kept); the log-sum-exp is of the scores before it. `bias` [h, sq, sk] is added to the scores (ALiBi)."""
    acc, groups = accumulation_dtype(q), q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1).to(acc), v.repeat_interleave(groups, dim=1).to(acc)
    scores = (q.to(acc) @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    seen = allowed.any(-1)
    # rows with no visible key get a finite stand-in, so that neither the value nor its gradient is NaN
    lse = torch.logsumexp(scores.masked_fill(~seen[..., None], 0.0), dim=-1)
    probs = torch.exp(scores - lse[..., None])
    if dropout is not None:
        probs = probs * dropout
    return probs @ v, lse.masked_fill(~seen, float("-inf"))


def block_reference_backward(q, k, v, allowed, lse, grad_out, delta, dropout=None, bias=None) -> tuple:
    """(dQ, dK, dV) in fp32 (fp64 for fp64) of one block's share of attention, given the final log-sum-exp of
    the queries and `delta` = rowsum(dO ∘ O); dK, dV [b, hkv, sk, d] summed over the query heads that share each
    KV head. `dropout`: the forward's factor per probability; `bias`: its additive bias (no gradient)."""
    groups, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    acc = accumulation_dtype(q)
    k_rep, v_rep = k.repeat_interleave(groups, dim=1).to(acc), v.repeat_interleave(groups, dim=1).to(acc)
    qf, gf = q.to(acc), grad_out.to(acc)
    scores = (qf @ k_rep.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias
    probs = torch.exp(scores.masked_fill(~allowed, float("-inf")) - lse[..., None])
    dropped = probs if dropout is None else probs * dropout
    dv = dropped.transpose(-2, -1) @ gf
    dprobs = gf @ v_rep.transpose(-2, -1)
    dscores = probs * ((dprobs if dropout is None else dprobs * dropout) - delta[..., None])
    dq = (dscores @ k_rep) * scale
    dk = (dscores.transpose(-2, -1) @ qf) * scale
    b, hq, sk, d = dk.shape
    return dq, dk.view(b, hq // groups, groups, sk, d).sum(2), dv.view(b, hq // groups, groups, sk, d).sum(2)


def merge_attention(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key blocks from each block's output and log-sum-exp (the
    online-softmax rescaling), in fp32: each output weighted by its share of the total exponential mass.
    `lse_a` must be finite (a block every query sees something of)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse
