"""Muon on sharded matrices: each matrix's Newton–Schulz run once, by an owner rank, on the whole matrix.

Tensor parallelism splits a matrix by rows or columns and ZeRO flattens and shards it, but Newton–Schulz
needs all of it (orthogonal blocks do not concatenate into an orthogonal matrix). Among the ranks of one
pipeline stage (TP × CP × DP, `Topology.build_stage_group`: they hold the same layers) every Muon matrix gets
one owner, greedily by Newton–Schulz FLOPs so that each rank does about 1/(TP·CP·DP) of the work (Moonlight's
distributed Muon). A step is then two all-to-alls of the NS dtype over that group:

    gather:  every piece a rank holds goes to its matrix's owner (a piece held by several replicas is sent by
             one of them, by the owner itself when it holds it: under DDP without TP nothing moves)
    NS:      the owner assembles the whole matrix (TP slices concatenated along their split dimension) and
             orthogonalises it
    return:  every holder of a piece gets that piece of the result

The pieces are copies, so the result is bit for bit what one process computes from the same input: the layouts
differ from one process only by the order of the gradient reductions. The plan is agreed once, at construction,
from every rank's list of pieces (one all_gather_object).
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.optim import muon
from parallel import comm

FP32 = 4


class Piece(NamedTuple):
    """A range [start, end) of the flattened TP slice `slot` (its TP rank; 0 when not split) of matrix `name`."""

    name: str
    full_shape: tuple
    tp_dim: int | None
    slot: int
    start: int
    end: int

    @property
    def key(self) -> tuple:
        return self.name, self.slot, self.start, self.end


def assign_owners(flops: dict[str, int], ranks: int) -> dict[str, int]:
    """Each matrix to the least-loaded rank so far, largest first (ties: the lower rank, then the name)."""
    load, owner = [0] * ranks, {}
    for name in sorted(flops, key=lambda n: (-flops[n], n)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[name], load[rank] = rank, load[rank] + flops[name]
    return owner


def local_shape(full_shape: tuple, tp_dim, tp_size: int) -> tuple:
    shape = list(full_shape)
    if tp_dim is not None:
        shape[tp_dim] //= tp_size
    return tuple(shape)


def size(key: tuple) -> int:
    return key[3] - key[2]


@dataclass
class OwnerPlan:
    """Who orthogonalises what and what moves, from every rank's pieces (`owner_plan`): the run's exchange and the
    memory estimate and time model (engine/memory_estimate.py, engine/plan/volumes.py) read the same plan."""

    held: list  # per rank of the stage group: its pieces, in its inputs' order
    matrices: dict  # name -> a Piece of it (its full shape and TP split)
    owner: dict  # name -> the rank that orthogonalises it
    pieces_of: dict  # name -> the keys of all its pieces, over all ranks, sorted
    sender: dict  # key -> the rank that sends the piece to its owner (the owner itself when it holds it)
    gather: list  # gather[a][b]: the keys rank a sends rank b before Newton–Schulz
    result: list  # result[a][b]: the keys of the result rank a sends rank b after it

    @property
    def world(self) -> int:
        return len(self.held)

    @functools.cached_property  # read for every rank by transient_bytes, a walk over every message
    def gather_chunk(self) -> int:
        return chunk(self.gather)

    @functools.cached_property
    def result_chunk(self) -> int:
        return chunk(self.result)

    def owned(self, rank: int) -> list[str]:
        return sorted(n for n, r in self.owner.items() if r == rank)

    def buffer_bytes(self, element_size: int) -> int:
        """The send buffers of one step's two all-to-alls (one padded chunk per rank; all but this rank's own
        chunk cross the wire, and as many bytes arrive)."""
        return self.world * (self.gather_chunk + self.result_chunk) * element_size

    def transient_bytes(self, rank: int, element_size: int, nesterov: bool) -> int:
        """The most bytes `MuonPart.step` allocates at once on `rank` beyond the held state, in an NS dtype of
        `element_size` bytes, phase by phase as the step runs: the NS inputs, the gather's buffers, each owned
        matrix whole with `muon.work_bytes`, the results' buffers, the update upcast to fp32 as it is applied.
        Kernel workspaces are not counted (a bf16 matmul's fp32 accumulators on a CPU, a strided addmm's packing:
        the estimate's tests measure them)."""
        held, world = self.held[rank], self.world
        mine, keys = [size(p.key) for p in held], {p.key for p in held}
        cast = FP32 if nesterov and element_size != FP32 else 0  # the fp32 Nesterov input before its cast
        staged = [element_size * n for n in mine] if nesterov or element_size != FP32 else [0] * len(mine)
        inputs = sum(staged)
        peak = max((sum(staged[:i + 1]) + cast * n for i, n in enumerate(mine)), default=0)
        gather = world * self.gather_chunk * element_size
        peak = max(peak, inputs + 2 * gather)  # send and receive buffers
        gathered = gather if any(self.gather[r][rank] for r in range(world)) else 0  # kept while pieces are used
        done = kept = 0  # results of the owned matrices; the part of them this rank holds itself
        for name in self.owned(rank):
            m = self.matrices[name]
            whole = element_size * m.full_shape[0] * m.full_shape[1]
            peak = max(peak, inputs + gathered + done + whole + muon.work_bytes(m.full_shape, element_size))
            done += whole
            mine_of = [k for k in self.pieces_of[name] if k in keys]
            kept += element_size * sum(size(k) for k in mine_of) if copied(m) else whole if mine_of else 0
        result = world * self.result_chunk * element_size
        peak = max(peak, inputs + done + 2 * result)
        received = result if any(self.result[r][rank] for r in range(world)) else 0
        upcast = FP32 * max(mine, default=0) if element_size != FP32 else 0  # master.add_ of a 16-bit update
        return max(peak, inputs + received + kept + upcast)


def chunk(messages) -> int:
    """An all-to-all's per-rank chunk: the largest message (0: nothing to move)."""
    return max((sum(size(k) for k in m) for row in messages for m in row), default=0)


def owner_plan(everyone: list[list[Piece]], ns_steps: int) -> OwnerPlan:
    """The plan for the pieces `everyone[r]` each rank r of a stage group holds."""
    matrices: dict[str, Piece] = {}
    holders: dict[tuple, list[int]] = {}
    for rank, pieces in enumerate(everyone):
        for p in pieces:
            matrices.setdefault(p.name, p)
            holders.setdefault(p.key, []).append(rank)
    world = len(everyone)
    owner = assign_owners({n: muon.ns_flops(p.full_shape, ns_steps) for n, p in matrices.items()}, world)
    pieces_of: dict[str, list[tuple]] = {}
    for k in sorted(holders):
        pieces_of.setdefault(k[0], []).append(k)
    sender = {k: owner[k[0]] if owner[k[0]] in h else h[0] for k, h in holders.items()}
    gather = [[[] for _ in range(world)] for _ in range(world)]
    result = [[[] for _ in range(world)] for _ in range(world)]
    for k in sorted(holders):
        o = owner[k[0]]
        if sender[k] != o:
            gather[sender[k]][o].append(k)
        for h in holders[k]:
            if h != o:
                result[o][h].append(k)
    return OwnerPlan(everyone, matrices, owner, pieces_of, sender, gather, result)


def row_parts(cols: int, start: int, end: int) -> list[tuple]:
    """(rows, columns, flat range) slices tiling the row-major range [start, end) of a matrix of `cols` columns:
    a partial first row, the whole rows, a partial last row (so a strided region is copied without a temporary)."""
    (r0, c0), (r1, c1) = divmod(start, cols), divmod(end, cols)
    if r0 == r1:
        return [(slice(r0, r0 + 1), slice(c0, c1), slice(0, end - start))]
    head, whole = cols - c0, (r1 - r0 - 1) * cols
    parts = [(slice(r0, r0 + 1), slice(c0, cols), slice(0, head)),
             (slice(r0 + 1, r1), slice(0, cols), slice(head, head + whole))]
    return parts + ([(slice(r1, r1 + 1), slice(0, c1), slice(head + whole, end - start))] if c1 else [])


def write(region: torch.Tensor, start: int, values: torch.Tensor) -> None:
    """Put the flat `values` at row-major offset `start` of the 2-D `region` (a column slice: strided)."""
    for rows, cols, flat in row_parts(region.size(1), start, start + values.numel()):
        region[rows, cols] = values[flat].view(rows.stop - rows.start, cols.stop - cols.start)


def read(region: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The row-major range [start, end) of the 2-D `region`: a view where it is contiguous, else a copy."""
    if region.is_contiguous():
        return region.view(-1)[start:end]
    piece = region.new_empty(end - start)
    for rows, cols, flat in row_parts(region.size(1), start, end):
        piece[flat].view(rows.stop - rows.start, cols.stop - cols.start).copy_(region[rows, cols])
    return piece


def copied(m: Piece) -> bool:
    """Whether the result pieces of `m` are copies (its output strided: a tall matrix, whose iteration runs on
    the transpose, or a column slice of a TP split), not views of the output."""
    return m.full_shape[0] > m.full_shape[1] or m.tp_dim == 1


class OwnerExchange:
    """The agreed plan for `held` (this rank's pieces, in the order its inputs come) over `group`."""

    def __init__(self, held: list[Piece], group, tp_size: int, ns_steps: int):
        self.group, self.tp_size, self.held = group, tp_size, held
        self.world, self.me = comm.group_size(group), comm.group_rank(group)
        everyone = [None] * self.world
        if self.world > 1:
            comm.all_gather_object(everyone, held, group)
        else:
            everyone = [held]
        self.plan = owner_plan(everyone, ns_steps)
        self.matrices = self.plan.matrices

    def owned(self) -> list[str]:
        return self.plan.owned(self.me)

    def buffer_bytes(self, element_size: int) -> int:
        return self.plan.buffer_bytes(element_size)

    def _all_to_all(self, messages, chunk_size: int, values: dict, dtype, device) -> dict:
        """Send values[k] for the keys of messages[me][r] to each rank r; returns {key: tensor} received."""
        if chunk_size == 0:
            return {}
        send = torch.zeros(self.world, chunk_size, dtype=dtype, device=device)
        for r, keys in enumerate(messages[self.me]):
            offset = 0
            for k in keys:
                send[r, offset:offset + size(k)] = values[k]
                offset += size(k)
        recv = torch.empty_like(send)
        comm.all_to_all_into(recv.view(-1), send.view(-1), self.group)
        out = {}
        for r in range(self.world):
            offset = 0
            for k in messages[r][self.me]:
                out[k] = recv[r, offset:offset + size(k)]
                offset += size(k)
        return out

    def _orthogonalise_owned(self, mine: dict, dtype, device, coefficients, steps: int, eps: float) -> dict:
        """Gather the pieces of this rank's matrices, orthogonalise each whole; {key: result piece}."""
        plan = self.plan
        arrived = {**self._all_to_all(plan.gather, plan.gather_chunk, mine, dtype, device),
                   **{k: x for k, x in mine.items() if plan.sender[k] == self.me}}
        results = {}
        for name in self.owned():
            results.update(self._orthogonalise_one(name, arrived, dtype, device, coefficients, steps, eps))
        return results

    def _orthogonalise_one(self, name: str, arrived: dict, dtype, device, coefficients, steps: int,
                           eps: float) -> dict:
        """Matrix `name` assembled from its pieces in `arrived` and orthogonalised; {key: result piece}. Its own
        call, so that the assembled input and the output's buffer are freed once the pieces are taken."""
        m, keys = self.plan.matrices[name], self.plan.pieces_of[name]
        slots = self.tp_size if m.tp_dim is not None else 1
        width = m.full_shape[m.tp_dim] // slots if slots > 1 else 0

        def region(t, k):
            return t.narrow(m.tp_dim, k[1] * width, width) if slots > 1 else t

        full = torch.empty(m.full_shape, dtype=dtype, device=device)
        for k in keys:  # the pieces tile the matrix: every element is written
            write(region(full, k), k[2], arrived[k])
        out = muon.orthogonalise(full, coefficients, steps, eps)
        del full  # the iteration's scratch: freed before the pieces are copied out
        return {k: read(region(out, k), k[2], k[3]) for k in keys}

    def orthogonalise(self, inputs: list[torch.Tensor], dtype, device, coefficients, steps: int,
                      eps: float) -> list[torch.Tensor]:
        """NS of every matrix from this rank's `inputs` (flat, aligned with `held`, in `dtype`); returns the
        result's pieces, aligned likewise."""
        results = self._orthogonalise_owned({p.key: x for p, x in zip(self.held, inputs)}, dtype, device,
                                            coefficients, steps, eps)
        results.update(self._all_to_all(self.plan.result, self.plan.result_chunk, results, dtype, device))
        return [results[p.key] for p in self.held]


class MuonPart:
    """The Muon-stepped share of an optimizer: one momentum buffer per held piece (fp32, beside the master
    piece), the exchange, and the step. `masters` are flat fp32 views the update writes in place."""

    def __init__(self, held: list[Piece], masters: list[torch.Tensor], cfg, group, tp_size: int, device):
        self.cfg, self.held, self.masters, self.device = cfg, held, masters, device
        self.momentum = [torch.zeros_like(m) for m in masters]
        self.dtype = muon.NS_DTYPES[cfg.muon_ns_dtype]
        self.exchange = OwnerExchange(held, group, tp_size, cfg.muon_ns_steps)
        self.scales = [muon.lr_scale(cfg.muon_adjust_lr_fn, p.full_shape) for p in held]

    def lr(self, lr: float) -> float:
        """Muon's learning rate at this step: optim.muon_lr, scaled by the schedule as optim.lr is."""
        return self.cfg.muon_lr * lr / self.cfg.lr

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        """One Muon step from the (clipped) fp32 gradient pieces `grads`, aligned with `held`."""
        c, lr = self.cfg, self.lr(lr)
        inputs = [muon.momentum_input(g, buf, c.muon_momentum, c.muon_nesterov).to(self.dtype)
                  for g, buf in zip(grads, self.momentum)]
        if not self.exchange.matrices:
            return
        updates = self.exchange.orthogonalise(inputs, self.dtype, self.device, tuple(c.muon_ns_coefficients),
                                              c.muon_ns_steps, c.muon_eps)
        for master, update, scale in zip(self.masters, updates, self.scales):
            muon.apply(master, update, lr, scale, c.muon_weight_decay)
