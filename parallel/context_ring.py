"""Ring attention (parallel.context_attention=ring): each CP rank's K/V block travels once around the ring of c
ranks; every rank attends its two query chunks to each block as it arrives, overlapping the next block's exchange
with the current block's computation, and merges the partial results by their log-sum-exp.

Forward, at step t a rank holds the block of the rank t places back. The send of that block onward and the receive
of the next are posted (batch_isend_irecv) before the block is computed and waited for after, so the transfer
runs under the computation. Only the (query chunk, key chunk) pairs in `pairs` are computed: those that causality,
the window or document boundaries leave entirely masked are skipped (parallel/context.py decides).

Backward is written out (the flash-attention backward in plain PyTorch) so that it overlaps too: with the
forward's blocks kept, each block's dK/dV is computed locally, and the gradients travel back around the ring
accumulating, step c−1 first: the shift of what has been summed so far is posted before the next block's
gradient is computed. The same c−1 shifts of one block's size as forward, and every rank runs every shift even
when it skipped all of a block, so no rank waits for a send that never comes.
"""
from __future__ import annotations

import math

import torch

from kernels.attention import accumulation_dtype, attention_with_lse, merge_attention, position_bias, position_mask
from parallel import comm


class RingAttention(torch.autograd.Function):
    """q [b, hq, 2n, d] (this rank's two chunks of n queries), kv [b, 2·hkv, 2n, d] (its keys then values).
    `pairs[t][i]`: the key-chunk indices (0 or 1 within the block of step t) that query chunk i attends;
    `masks[t][i]`: their boolean mask [b or 1, 1, n, n·len(pairs[t][i])]. `ring`: (group, next rank, previous
    rank) in global ranks. `dropout_p` > 0: attention dropout, each block's kept probabilities drawn here from the
    current RNG stream (each CP rank its own) and kept for backward. `biases[t][i]`: ALiBi's bias for the pair's
    scores [h, n, n·len(pairs[t][i])], or None."""

    @staticmethod
    def forward(ctx, q, kv, pairs, masks, ring, dropout_p=0.0, biases=None):
        group, following, preceding = ring
        c, n, heads = len(pairs), q.shape[2] // 2, kv.shape[1] // 2
        q_chunks = q.split(n, dim=2)
        merged: list = [None, None]  # per query chunk: (output, log-sum-exp) so far
        blocks, kept = [kv], {}  # kept[step, i]: the probabilities dropout kept (boolean)
        for step in range(c):
            pending = comm.start_ring_shift(blocks[-1], group, following, preceding) if step < c - 1 else None
            k, v = _chunks(blocks[step], heads, n)
            for i, visible in enumerate(pairs[step]):
                if not visible:
                    continue
                factor = None
                if dropout_p > 0:
                    kept[step, i] = torch.rand(*q_chunks[i].shape[:3], n * len(visible), device=q.device) >= dropout_p
                    factor = kept[step, i] / (1 - dropout_p)
                part = attention_with_lse(q_chunks[i], torch.cat([k[j] for j in visible], dim=2),
                                          torch.cat([v[j] for j in visible], dim=2), masks[step][i], factor,
                                          None if biases is None else biases[step][i])
                # step 0 holds each query chunk's diagonal, where every query sees at least itself: the first
                # partial result has a finite log-sum-exp, as merge_attention wants
                merged[i] = part if merged[i] is None else merge_attention(*merged[i], *part)
            if pending is not None:
                blocks.append(comm.finish_ring_shift(pending))
        out = torch.cat([o for o, _ in merged], dim=2)
        ctx.save_for_backward(q, out, merged[0][1], merged[1][1], *blocks)
        ctx.pairs, ctx.masks, ctx.ring, ctx.kept, ctx.dropout_p = pairs, masks, ring, kept, dropout_p
        ctx.biases = biases
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse0, lse1, *blocks = ctx.saved_tensors
        group, following, preceding = ctx.ring
        c, n, heads = len(blocks), q.shape[2] // 2, blocks[0].shape[1] // 2
        q_chunks, outs, grads = q.split(n, dim=2), out.split(n, dim=2), grad_out.split(n, dim=2)
        lses = (lse0, lse1)
        # the softmax's backward term: rowsum(dO ∘ O) per query
        acc = accumulation_dtype(q)
        deltas = [(g.to(acc) * o.to(acc)).sum(-1) for g, o in zip(grads, outs)]
        dq = [torch.zeros_like(qc, dtype=acc) for qc in q_chunks]
        total, pending = None, None
        for step in range(c - 1, -1, -1):
            dkv = torch.zeros_like(blocks[step], dtype=acc)
            k, v = _chunks(blocks[step], heads, n)
            dk, dv = _chunks(dkv, heads, n)
            for i, visible in enumerate(ctx.pairs[step]):
                if not visible:
                    continue
                factor = ctx.kept[step, i] / (1 - ctx.dropout_p) if ctx.dropout_p > 0 else None
                bias = None if ctx.biases is None else ctx.biases[step][i]
                k_part, v_part = _block_backward(q_chunks[i], torch.cat([k[j] for j in visible], dim=2),
                                                 torch.cat([v[j] for j in visible], dim=2), ctx.masks[step][i],
                                                 lses[i], grads[i], deltas[i], dq[i], factor, bias)
                for index, j in enumerate(visible):
                    dk[j].add_(k_part[:, :, index * n:(index + 1) * n])  # views of dkv
                    dv[j].add_(v_part[:, :, index * n:(index + 1) * n])
            # what came back from the rank one further on (the gradients of this block's later travels) plus
            # this rank's own share; the sum goes back one more rank, to where the block came from
            total = dkv if pending is None else comm.finish_ring_shift(pending) + dkv
            if step > 0:
                pending = comm.start_ring_shift(total, group, preceding, following)
        return torch.cat(dq, dim=2).to(q.dtype), total.to(blocks[0].dtype), None, None, None, None, None


def _chunks(block: torch.Tensor, heads: int, n: int) -> tuple:
    """(key chunks, value chunks) of a [b, 2·heads, 2n, d] block: two views of n positions each."""
    return block[:, :heads].split(n, dim=2), block[:, heads:].split(n, dim=2)


def _block_backward(q, k, v, allowed, lse, grad_out, delta, dq, dropout=None, bias=None):
    """Gradients of one block's share of attention, given the final log-sum-exp of the queries: adds dQ to `dq`
    and returns (dK, dV) [b, hkv, sk, d] in fp32 (fp64 for fp64), summed over the query heads that share each KV head. `dropout`:
    the forward's factor per probability (`delta` is then rowsum(dO ∘ O) of the dropped output, as without);
    `bias`: the forward's additive bias (a constant: no gradient of its own)."""
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
    dq += (dscores @ k_rep) * scale
    dk = (dscores.transpose(-2, -1) @ qf) * scale
    b, hq, sk, d = dk.shape
    return dk.view(b, hq // groups, groups, sk, d).sum(2), dv.view(b, hq // groups, groups, sk, d).sum(2)


def ring_masks(pairs, chunk_ids, q_chunk_ids, n: int, window: int, segment_ids, device, slopes=None) -> tuple:
    """(the boolean masks RingAttention wants for `pairs`, ALiBi's biases for them or None without `slopes`):
    `chunk_ids(step)` names the two chunks of step's block, `q_chunk_ids` this rank's two query chunks."""
    masks, biases = [], []
    for step, per_query in enumerate(pairs):
        theirs, row, bias_row = chunk_ids(step), [], []
        for qc, visible in zip(q_chunk_ids, per_query):
            if not visible:
                row.append(None)
                bias_row.append(None)
                continue
            k_pos = torch.cat([torch.arange(theirs[j] * n, (theirs[j] + 1) * n, device=device) for j in visible])
            q_pos = torch.arange(qc * n, (qc + 1) * n, device=device)
            q_seg = k_seg = None
            if segment_ids is not None:
                q_seg, k_seg = segment_ids[:, q_pos], segment_ids[:, k_pos]
            row.append(position_mask(q_pos, k_pos, window, q_seg, k_seg))
            bias_row.append(None if slopes is None else position_bias(slopes, q_pos, k_pos))
        masks.append(row)
        biases.append(bias_row)
    return masks, (None if slopes is None else biases)
