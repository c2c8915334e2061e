"""Context parallelism (CP): every sequence split over the c ranks of the CP group.

The sequence of s tokens is cut into 2c chunks of s/2c; CP rank i holds chunks i and 2c−1−i, so that under
the causal mask every rank has the same work (an early chunk sees few keys, its partner many). Every CP rank
of a data-parallel replica reads the same samples and keeps its chunks (`shard`); RoPE uses the chunks'
global positions; the loss is summed over the CP group (`mean_loss`). Everything outside attention is
per-token and runs on the local chunks unchanged. Attention needs every earlier key, in one of three ways
(`parallel.context_attention`):

    allgather  K and V all-gathered over CP (their gradients reduce-scattered in backward); local queries
               against all keys, masked by global positions.
    ring       K/V blocks passed c−1 times around the ring (batch_isend_irecv); each block's partial result is
               merged with the others by its log-sum-exp. Chunk pairs that causality or the window hides
               entirely are not computed. Autograd runs backward through the blocks; the shifts' backward
               passes dK/dV back around the ring (comm.ring_pass).
    alltoall   Ulysses: one all-to-all turns [heads, local sequence] into [heads / c, full sequence]; ordinary
               attention over the whole sequence; one all-to-all back. KV heads are repeated just enough that
               each rank receives the KV heads its query heads use.

Positions here are indices in the full sequence, which decide causality and the window; documents are
separated by `segment_ids`, which every CP rank holds whole (it read the whole sample).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.attention import attention_with_lse, causal_attention, merge_attention, position_mask
from parallel import comm

STRATEGIES = ("allgather", "ring", "alltoall")


@dataclass
class ContextParallel:
    group: object = None
    size: int = 1
    rank: int = 0
    strategy: str = "allgather"
    ranks: tuple = ()  # global ranks of the CP group in CP-rank order (the ring)

    @classmethod
    def from_topology(cls, topo, strategy: str = "allgather") -> "ContextParallel":
        if strategy not in STRATEGIES:
            raise ValueError(f"parallel.context_attention={strategy!r} is not one of {', '.join(STRATEGIES)}")
        return cls(topo.cp_group, topo.cp_size, topo.cp_rank, strategy, tuple(topo.group_ranks["cp"]))

    # -- which tokens this rank holds ------------------------------------------------------------
    def chunk_ids(self, rank: int | None = None) -> tuple[int, int]:
        rank = self.rank if rank is None else rank
        return rank, 2 * self.size - 1 - rank

    def positions(self, seq_length: int, device=None, rank: int | None = None) -> torch.Tensor:
        """Indices in the full sequence of the tokens `rank` holds, in the order it holds them."""
        n = seq_length // (2 * self.size)
        return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in self.chunk_ids(rank)])

    def gathered_positions(self, seq_length: int, device=None) -> torch.Tensor:
        """Indices of every rank's tokens concatenated in CP-rank order (what a gather along the sequence holds)."""
        return torch.cat([self.positions(seq_length, device, r) for r in range(self.size)])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of the full sequence `x` along `dim`, concatenated."""
        if self.size == 1:
            return x
        n = x.shape[dim] // (2 * self.size)
        return torch.cat([x.narrow(dim, c * n, n) for c in self.chunk_ids()], dim=dim)

    # -- loss ------------------------------------------------------------------------------------
    def mean_loss(self, losses: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
        """The mean token loss of the whole sequences from this rank's per-token losses: local sums over the
        token count of the CP group, summed over the group (so every CP rank returns the unsplit loss)."""
        if loss_mask is None:
            local = losses.sum() / (losses.numel() * self.size)
        else:
            count = loss_mask.sum().detach().float().reshape(1)
            comm.all_reduce(count, self.group)
            local = (losses * loss_mask).sum() / count[0].clamp(min=1.0)
        return comm.sum_over_context(local, self.group)

    # -- attention -------------------------------------------------------------------------------
    def attention(self, q, k, v, window: int = 0, segment_ids=None, backend: str = "auto"):
        """Causal attention of the local queries q [b, hq, s/c, d] over the whole sequence's keys, whose local
        part is k, v [b, hkv, s/c, d] (RoPE applied); `segment_ids` [b, s] of the full sequence or None."""
        s = q.shape[2] * self.size
        if self.strategy == "allgather":
            return self._allgather(q, k, v, s, window, segment_ids)
        if self.strategy == "ring":
            return self._ring(q, k, v, s, window, segment_ids)
        return self._alltoall(q, k, v, s, window, segment_ids, backend)

    def _allgather(self, q, k, v, s, window, segment_ids):
        heads = k.shape[1]
        kv = comm.gather_from_sequence_region(torch.cat((k, v), dim=1), self.group, dim=2)
        k_all, v_all = kv[:, :heads], kv[:, heads:]
        q_pos, k_pos = self.positions(s, q.device), self.gathered_positions(s, q.device)
        q_seg = k_seg = None
        if segment_ids is not None:
            q_seg, k_seg = segment_ids[:, q_pos], segment_ids[:, k_pos]
        allowed = position_mask(q_pos, k_pos, window, q_seg, k_seg)
        return torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed,
                                                                enable_gqa=heads != q.shape[1])

    def _ring(self, q, k, v, s, window, segment_ids):
        n = s // (2 * self.size)
        heads = k.shape[1]
        mine = self.chunk_ids()
        q_chunks = q.split(n, dim=2)
        outputs: list = [None, None]  # per query chunk: (output, log-sum-exp) merged so far
        following, preceding = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]
        blocks = comm.ring_pass(torch.cat((k, v), dim=1), self.group, following, preceding)
        for step, block in enumerate(blocks):
            source = (self.rank - step) % self.size  # block `step` is the K/V of the rank that far back
            k_chunks, v_chunks = block[:, :heads].split(n, dim=2), block[:, heads:].split(n, dim=2)
            theirs = self.chunk_ids(source)
            for i, qc in enumerate(mine):
                visible = [j for j, kc in enumerate(theirs) if _chunk_visible(qc, kc, n, window)]
                if not visible:  # causality (or the window) hides the whole block from this chunk
                    continue
                k_pos = torch.cat([torch.arange(theirs[j] * n, (theirs[j] + 1) * n, device=q.device) for j in visible])
                q_pos = torch.arange(qc * n, (qc + 1) * n, device=q.device)
                q_seg = k_seg = None
                if segment_ids is not None:
                    q_seg, k_seg = segment_ids[:, q_pos], segment_ids[:, k_pos]
                part = attention_with_lse(q_chunks[i], torch.cat([k_chunks[j] for j in visible], dim=2),
                                          torch.cat([v_chunks[j] for j in visible], dim=2),
                                          position_mask(q_pos, k_pos, window, q_seg, k_seg))
                # step 0 holds the diagonal chunk: every query sees at least itself there, so the first
                # partial result has a finite log-sum-exp
                outputs[i] = part if outputs[i] is None else merge_attention(*outputs[i], *part)
        return torch.cat([out for out, _ in outputs], dim=2)

    def _alltoall(self, q, k, v, s, window, segment_ids, backend):
        c, hq, hkv = self.size, q.shape[1], k.shape[1]
        repeat = c // math.gcd(hkv, c)  # KV heads repeated until they split evenly, aligned with the queries
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        hk = k.shape[1]
        b, local, d = q.shape[0], q.shape[2], q.shape[3]
        # one exchange for q, k and v: rank j's block holds its query heads, then its key and value heads
        blocks = torch.cat([t.reshape(b, c, -1, local, d) for t in (q, k, v)], dim=2).reshape(b, -1, local, d)
        full = comm.all_to_all_region(blocks, self.group, scatter_dim=1, gather_dim=2)
        order = self.gathered_positions(s, q.device)
        full = full[:, :, torch.argsort(order)]  # CP-rank order to sequence order
        q_full, k_full, v_full = full.split([hq // c, hk // c, hk // c], dim=1)
        out = causal_attention(q_full, k_full, v_full, backend=backend, window=window, segment_ids=segment_ids)
        return comm.all_to_all_region(out[:, :, order], self.group, scatter_dim=2, gather_dim=1)


def _chunk_visible(q_chunk: int, k_chunk: int, n: int, window: int) -> bool:
    """Whether any query of chunk `q_chunk` may attend any key of chunk `k_chunk` (chunks of n tokens)."""
    if k_chunk > q_chunk:
        return False
    nearest = 0 if k_chunk == q_chunk else q_chunk * n - ((k_chunk + 1) * n - 1)
    return window == 0 or nearest < window
