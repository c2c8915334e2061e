"""Ring attention (parallel.context_attention=ring): each CP rank's K/V block travels once around the ring of c
ranks; every rank attends its two query chunks to each block as it arrives, overlapping the next block's exchange
with the current block's computation, and merges the partial results by their log-sum-exp, in fp32.

Forward, at step t a rank holds the block of the rank t places back. The send of that block onward and the receive
of the next are posted (batch_isend_irecv) before the block is computed and waited for after, so the transfer
runs under the computation. Only the (query chunk, key chunk) pairs in `RingPlan.pairs` are computed: those that
causality, the window or document boundaries leave entirely masked are skipped (parallel/context.py decides).
Each pair goes through kernels/attention_blocks.py: a fused kernel when nothing but causality masks it, else the
reference path in fp32. Masks, ALiBi biases and dropout masks are built per pair from the chunks' positions, the
document ids and a per-pair seed, and built again in backward: nothing n²-sized outlives its pair.

Backward is written out so that it overlaps too: with the forward's blocks kept, each block's dK/dV is computed
locally from the final output and log-sum-exp, and the gradients travel back around the ring accumulating (fp32),
step c−1 first: the shift of what has been summed so far is posted before the next block's gradient is computed.
The same c−1 shifts of one block's size as forward, and every rank runs every shift even when it skipped all of a
block, so no rank waits for a send that never comes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import attention_blocks
from kernels.attention import position_bias, position_mask
from parallel import comm


@dataclass
class RingPlan:
    """What one ring attention computes, in plain Python. `pairs[t][i]`: the key-chunk indices (0 or 1 within
    the block of step t) that query chunk i attends; `q_chunks`: this rank's two chunk ids; `block_chunks[t]`:
    the chunk ids of step t's block; chunks of `n` tokens. `ring`: (group, next rank, previous rank) in global
    ranks. `kernel`: kernels.attention_blocks.fused_kernel's choice for unmasked pairs (None: every pair by the
    reference path). `dropout_p` > 0: attention dropout, each pair's kept probabilities drawn from a seed taken
    from the current CPU RNG stream (each CP rank its own), drawn again in backward. `whole`: which chunk pairs
    documents leave uncut (ContextParallel's host copy), so that they too take the fused kernel."""
    pairs: list
    q_chunks: tuple
    block_chunks: list
    n: int
    ring: tuple
    window: int = 0
    kernel: str | None = None
    dropout_p: float = 0.0
    whole: list | None = None  # with documents, whole[qc][kc]: both chunks inside one document on every row

    def fused(self, step: int, i: int, j: int, documents: bool, alibi: bool) -> bool:
        """Whether the pair needs no mask but causality on its diagonal (the window reaches past all of it, no
        document boundary crosses it)."""
        qc, kc = self.q_chunks[i], self.block_chunks[step][j]
        farthest = (qc + 1) * self.n - 1 - kc * self.n
        uncut = not documents or (self.whole is not None and self.whole[qc][kc])
        return (self.kernel is not None and uncut and not alibi and self.dropout_p == 0
                and (self.window == 0 or farthest < self.window))

    def masks(self, step, i, j, segment_ids, slopes, seed, shape, device):
        """(boolean mask, ALiBi bias or None, dropout factor or None) of the reference path's pair."""
        n, qc, kc = self.n, self.q_chunks[i], self.block_chunks[step][j]
        q_pos = torch.arange(qc * n, (qc + 1) * n, device=device)
        k_pos = torch.arange(kc * n, (kc + 1) * n, device=device)
        q_seg = k_seg = None
        if segment_ids is not None:
            q_seg, k_seg = segment_ids[:, qc * n:(qc + 1) * n], segment_ids[:, kc * n:(kc + 1) * n]
        bias = None if slopes is None else position_bias(slopes, q_pos, k_pos)
        factor = None
        if self.dropout_p > 0:
            generator = torch.Generator(device).manual_seed(seed)
            kept = torch.rand(*shape, n, generator=generator, device=device) >= self.dropout_p
            factor = kept / (1 - self.dropout_p)
        return position_mask(q_pos, k_pos, self.window, q_seg, k_seg), bias, factor


class RingAttention(torch.autograd.Function):
    """q [b, hq, 2n, d] (this rank's two chunks of n queries), kv [b, 2·hkv, 2n, d] (its keys then values),
    `segment_ids` [b, s] of the whole sequence or None, `slopes` [hq] (ALiBi) or None, `plan` a RingPlan."""

    @staticmethod
    def forward(ctx, q, kv, segment_ids, slopes, plan):
        group, following, preceding = plan.ring
        c, n, heads = len(plan.pairs), plan.n, kv.shape[1] // 2
        q_chunks = q.split(n, dim=2)
        merged: list = [None, None]  # per query chunk: (output, log-sum-exp) so far, fp32
        blocks, seeds, states = [kv], {}, {}
        for step in range(c):
            pending = comm.start_ring_shift(blocks[-1], group, following, preceding) if step < c - 1 else None
            k, v = _chunks(blocks[step], heads, n)
            for i, visible in enumerate(plan.pairs[step]):
                for j in visible:
                    if plan.fused(step, i, j, segment_ids is not None, slopes is not None):
                        *part, states[step, i, j] = attention_blocks.block_fused(
                            plan.kernel, q_chunks[i], k[j], v[j], plan.q_chunks[i] == plan.block_chunks[step][j])
                    else:
                        if plan.dropout_p > 0:
                            seeds[step, i, j] = int(torch.randint(2 ** 62, (1,)))
                        allowed, bias, factor = plan.masks(step, i, j, segment_ids, slopes, seeds.get((step, i, j)),
                                                           q_chunks[i].shape[:3], q.device)
                        part = attention_blocks.block_reference(q_chunks[i], k[j], v[j], allowed, factor, bias)
                    # step 0 holds each query chunk's diagonal, where every query sees at least itself: the first
                    # partial result has a finite log-sum-exp, as merge_attention wants
                    merged[i] = part if merged[i] is None else attention_blocks.merge_attention(*merged[i], *part)
            if pending is not None:
                blocks.append(comm.finish_ring_shift(pending))
        out = torch.cat([o for o, _ in merged], dim=2).to(q.dtype)
        ctx.save_for_backward(q, out, merged[0][1], merged[1][1], segment_ids, slopes, *blocks)
        ctx.plan, ctx.seeds, ctx.states = plan, seeds, states
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse0, lse1, segment_ids, slopes, *blocks = ctx.saved_tensors
        plan = ctx.plan
        group, following, preceding = plan.ring
        c, n, heads = len(blocks), plan.n, blocks[0].shape[1] // 2
        q_chunks, outs, grads = q.split(n, dim=2), out.split(n, dim=2), grad_out.contiguous().split(n, dim=2)
        lses = (lse0, lse1)
        acc = attention_blocks.accumulation_dtype(q)
        deltas = [None, None]  # the softmax's backward term rowsum(dO ∘ O) per query, for the reference path
        dq = [torch.zeros_like(qc, dtype=acc) for qc in q_chunks]
        total, pending = None, None
        for step in range(c - 1, -1, -1):
            dkv = torch.zeros_like(blocks[step], dtype=acc)
            k, v = _chunks(blocks[step], heads, n)
            dk, dv = _chunks(dkv, heads, n)
            for i, visible in enumerate(plan.pairs[step]):
                for j in visible:
                    if (step, i, j) in ctx.states:
                        shares = attention_blocks.block_fused_backward(
                            plan.kernel, ctx.states[step, i, j], grads[i], q_chunks[i], k[j], v[j], outs[i],
                            lses[i], plan.q_chunks[i] == plan.block_chunks[step][j])
                    else:
                        if deltas[i] is None:
                            deltas[i] = (grads[i].to(acc) * outs[i].to(acc)).sum(-1)
                        allowed, bias, factor = plan.masks(step, i, j, segment_ids, slopes,
                                                           ctx.seeds.get((step, i, j)), q_chunks[i].shape[:3],
                                                           q.device)
                        shares = attention_blocks.block_reference_backward(
                            q_chunks[i], k[j], v[j], allowed, lses[i], grads[i], deltas[i], factor, bias)
                    dq[i].add_(shares[0])
                    dk[j].add_(shares[1])  # views of dkv
                    dv[j].add_(shares[2])
            # what came back from the rank one further on (the gradients of this block's later travels) plus
            # this rank's own share; the sum goes back one more rank, to where the block came from
            total = dkv if pending is None else comm.finish_ring_shift(pending) + dkv
            if step > 0:
                pending = comm.start_ring_shift(total, group, preceding, following)
        return torch.cat(dq, dim=2).to(q.dtype), total.to(blocks[0].dtype), None, None, None


def _chunks(block: torch.Tensor, heads: int, n: int) -> tuple:
    """(key chunks, value chunks) of a [b, 2·heads, 2n, d] block: two views of n positions each."""
    return block[:, :heads].split(n, dim=2), block[:, heads:].split(n, dim=2)
