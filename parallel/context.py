"""Context parallelism (CP): every sequence split over the c ranks of the CP group.

The sequence of s tokens is cut into 2c chunks of s/2c; CP rank i holds chunks i and 2c−1−i, so that under
the causal mask every rank has the same work (an early chunk sees few keys, its partner many). Every CP rank
of a data-parallel replica reads the same samples and keeps its chunks (`shard`); RoPE uses the chunks'
global positions; the loss is summed over the CP group (`mean_loss`). Everything outside attention is
per-token and runs on the local chunks unchanged. Attention needs every earlier key, in one of three ways
(`parallel.context_attention`):

    allgather  K and V all-gathered over CP (their gradients reduce-scattered in backward); local queries
               against all keys, masked by global positions.
    ring       K/V blocks passed c−1 times around the ring (batch_isend_irecv), each exchange overlapped with
               the current block's computation; each block's partial result is merged with the others by its
               log-sum-exp; backward sends dK/dV back around the ring, overlapped likewise
               (parallel/context_ring.py).
    alltoall   Ulysses: one all-to-all turns [heads, local sequence] into [heads / c, full sequence]; ordinary
               attention over the whole sequence; one all-to-all back. KV heads are repeated just enough that
               each rank receives the KV heads its query heads use.

Positions here are indices in the full sequence, which decide causality, the window and ALiBi's bias; documents are
separated by `segment_ids`, which every CP rank holds whole (it read the whole sample). allgather and ring
compute attention per (query chunk, key chunk) pair and skip the pairs that causality, the window or document
boundaries leave entirely masked (`visible_chunks`); alltoall runs the ordinary kernel over the whole
sequence, where flash-attn's varlen kernel skips what documents hide and SDPA masks it. Attention dropout
draws from the current RNG stream, each CP rank's own.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from kernels.attention import attention_entropy, causal_attention, position_bias, position_mask, select_backend
from kernels.attention_blocks import fused_kernel
from parallel import comm
from parallel.context_ring import RingAttention, RingPlan

STRATEGIES = ("allgather", "ring", "alltoall")
_host_meet: dict = {}  # id(segment_ids) -> (chunks, _documents_meet), from the host copy (remember_documents)


@dataclass
class ContextParallel:
    group: object = None
    size: int = 1
    rank: int = 0
    strategy: str = "allgather"
    ranks: tuple = ()  # global ranks of the CP group in CP-rank order (the ring)
    blocks_computed: int = 0  # (query chunk, key chunk) pairs attended so far by allgather and ring (tests)
    _visible_cache: tuple = (None, None, None)  # (weak reference to segment_ids, its key, _documents_meet)

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
    # Eager under train.compile: Dynamo would break the graph at the ring's batch_isend_irecv and rewrite the other
    # collectives into functional ones; the compiled block runs around it (test_compiled_blocks_equal_eager_under_cp).
    @torch.compiler.disable
    def attention(self, q, k, v, window: int = 0, segment_ids=None, backend: str = "auto", dropout_p: float = 0.0,
                  slopes=None):
        """Causal attention of the local queries q [b, hq, s/c, d] over the whole sequence's keys, whose local
        part is k, v [b, hkv, s/c, d] (RoPE applied); `segment_ids` [b, s] of the full sequence or None;
        `slopes` [hq]: ALiBi's, of this rank's query heads (its bias from the tokens' global positions).
        Attention dropout draws from the current RNG stream, which is each CP rank's own (parallel/random.py),
        so every rank drops its own queries' probabilities independently."""
        s = q.shape[2] * self.size
        select_backend(backend, q)  # an explicit backend is honoured or refused as without CP
        if self.strategy == "allgather":
            return self._allgather(q, k, v, s, window, segment_ids, dropout_p, slopes)
        if self.strategy == "ring":
            return self._ring(q, k, v, s, window, segment_ids, dropout_p, slopes, backend)
        return self._alltoall(q, k, v, s, window, segment_ids, backend, dropout_p, slopes)

    @torch.compiler.disable
    @torch.no_grad()
    def attention_entropy(self, q, k, window: int = 0, segment_ids=None, slopes=None) -> tuple[float, int]:
        """kernels.attention.attention_entropy of this rank's queries over the whole sequence's keys (gathered
        over CP): summed over the CP ranks (the monitor sums over every rank) it is the unsplit model's."""
        s = q.shape[2] * self.size
        k_all = comm.gather_from_sequence_region(k.contiguous(), self.group, dim=2)
        q_pos, k_pos = self.positions(s, q.device), self.gathered_positions(s, q.device)
        q_seg = k_seg = None
        if segment_ids is not None:
            q_seg, k_seg = segment_ids[:, q_pos], segment_ids[:, k_pos]
        bias = None if slopes is None else position_bias(slopes, q_pos, k_pos)
        return attention_entropy(q, k_all, bias, allowed=position_mask(q_pos, k_pos, window, q_seg, k_seg))

    # -- which chunk pairs are computed ---------------------------------------------------------------
    def remember_documents(self, segment_ids: torch.Tensor, host_segment_ids: torch.Tensor) -> None:
        """Which chunks documents let meet, from the host copy of `segment_ids` before the device has it:
        `visible_chunks` then reads nothing back from the device (as kernels.attention.remember_offsets does for
        the varlen kernel's offsets). Forgotten with the tensor."""
        if self.size == 1:
            return
        key = id(segment_ids)
        _host_meet[key] = (2 * self.size, _documents_meet(host_segment_ids, 2 * self.size))
        weakref.finalize(segment_ids, _host_meet.pop, key, None)

    def visible_chunks(self, seq_length: int, window: int, segment_ids=None) -> list[list[bool]]:
        """[2c][2c]: whether any query of chunk i may attend any key of chunk j (of n = s/2c tokens). Causality
        and the window decide by the chunks' places; documents by their segment-id ranges per row (a pair is
        skipped when no row's ranges meet, exact for the increasing ids of packed documents and never wrong
        for any ids), read from the host copy `remember_documents` saw, else once per segment_ids tensor."""
        n, chunks = seq_length // (2 * self.size), 2 * self.size
        meet = [[True] * chunks for _ in range(chunks)]
        if segment_ids is not None:
            meet = self._documents(segment_ids)[0]
        return [[meet[i][j] and _chunk_visible(i, j, n, window) for j in range(chunks)] for i in range(chunks)]

    def _documents(self, segment_ids: torch.Tensor) -> tuple[list, list]:
        """`_documents_meet` of `segment_ids`: from the host copy when remembered, else one host read kept for
        the tensor (every layer sees the same one)."""
        chunks = 2 * self.size
        remembered = _host_meet.get(id(segment_ids))
        if remembered is not None and remembered[0] == chunks:
            return remembered[1]
        ref, version, cached = self._visible_cache
        if ref is None or ref() is not segment_ids or version != (chunks, segment_ids._version):
            cached = _documents_meet(segment_ids, chunks)
            self._visible_cache = (weakref.ref(segment_ids), (chunks, segment_ids._version), cached)
        return cached

    def _allgather(self, q, k, v, s, window, segment_ids, dropout_p, slopes):
        heads, n = k.shape[1], s // (2 * self.size)
        kv = comm.gather_from_sequence_region(torch.cat((k, v), dim=1), self.group, dim=2)
        k_all, v_all = kv[:, :heads], kv[:, heads:]
        visible = self.visible_chunks(s, window, segment_ids)
        outputs = []
        for qc, q_chunk in zip(self.chunk_ids(), q.split(n, dim=2)):
            # the key chunks this query chunk sees, found at their slots of the gather (CP-rank order)
            kcs = [j for j in range(2 * self.size) if visible[qc][j]]
            self.blocks_computed += len(kcs)
            slots = [2 * min(j, 2 * self.size - 1 - j) + (j >= self.size) for j in kcs]
            k_sel = torch.cat([k_all[:, :, t * n:(t + 1) * n] for t in slots], dim=2)
            v_sel = torch.cat([v_all[:, :, t * n:(t + 1) * n] for t in slots], dim=2)
            q_pos = torch.arange(qc * n, (qc + 1) * n, device=q.device)
            k_pos = torch.cat([torch.arange(j * n, (j + 1) * n, device=q.device) for j in kcs])
            q_seg = k_seg = None
            if segment_ids is not None:
                q_seg, k_seg = segment_ids[:, q_pos], segment_ids[:, k_pos]
            allowed = position_mask(q_pos, k_pos, window, q_seg, k_seg)
            if slopes is not None:  # an additive mask: the bias where allowed, -inf elsewhere
                allowed = position_bias(slopes, q_pos, k_pos).to(q.dtype).masked_fill(~allowed, float("-inf"))
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                q_chunk, k_sel, v_sel, attn_mask=allowed, dropout_p=dropout_p, enable_gqa=heads != q.shape[1]))
        return torch.cat(outputs, dim=2)

    def _ring(self, q, k, v, s, window, segment_ids, dropout_p, slopes, backend):
        n = s // (2 * self.size)
        visible = self.visible_chunks(s, window, segment_ids)
        mine = self.chunk_ids()
        block_chunks = [self.chunk_ids((self.rank - step) % self.size) for step in range(self.size)]
        pairs = [[[j for j, kc in enumerate(theirs) if visible[qc][kc]] for qc in mine] for theirs in block_chunks]
        self.blocks_computed += sum(len(p) for per_query in pairs for p in per_query)
        ring = (self.group, self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size])
        whole = None if segment_ids is None else self._documents(segment_ids)[1]
        plan = RingPlan(pairs, mine, block_chunks, n, ring, window, fused_kernel(q, backend), dropout_p, whole)
        return RingAttention.apply(q, torch.cat((k, v), dim=1), segment_ids, slopes, plan)

    def _alltoall(self, q, k, v, s, window, segment_ids, backend, dropout_p, slopes):
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
        if slopes is not None:  # this rank now holds query heads [rank · hq/c, (rank + 1) · hq/c)
            slopes = slopes[self.rank * (hq // c):(self.rank + 1) * (hq // c)]
        out = causal_attention(q_full, k_full, v_full, dropout_p=dropout_p, backend=backend, slopes=slopes,
                               window=window, segment_ids=segment_ids)
        return comm.all_to_all_region(out[:, :, order], self.group, scatter_dim=2, gather_dim=1)


def _chunk_visible(q_chunk: int, k_chunk: int, n: int, window: int) -> bool:
    """Whether any query of chunk `q_chunk` may attend any key of chunk `k_chunk` (chunks of n tokens)."""
    if k_chunk > q_chunk:
        return False
    nearest = 0 if k_chunk == q_chunk else q_chunk * n - ((k_chunk + 1) * n - 1)
    return window == 0 or nearest < window


def _documents_meet(segment_ids: torch.Tensor, chunks: int) -> tuple[list, list]:
    """([chunks][chunks] whether chunks i and j of some row share a segment-id range, the same for whether on
    every row both lie inside one document: their pair then needs no document mask)."""
    ids = segment_ids.reshape(segment_ids.shape[0], chunks, -1)
    low, high = ids.amin(-1), ids.amax(-1)  # [b, chunks]
    meet = ((low[:, None, :] <= high[:, :, None]) & (low[:, :, None] <= high[:, None, :])).any(0)
    single = low == high
    whole = (single[:, :, None] & single[:, None, :] & (low[:, :, None] == low[:, None, :])).all(0)
    return meet.tolist(), whole.tolist()
