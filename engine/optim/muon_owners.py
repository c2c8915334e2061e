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

from typing import NamedTuple

import torch

from engine.optim import muon
from parallel import comm


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
        self.matrices: dict[str, Piece] = {}
        holders: dict[tuple, list[int]] = {}
        for rank, pieces in enumerate(everyone):
            for p in pieces:
                self.matrices.setdefault(p.name, p)
                holders.setdefault(p.key, []).append(rank)
        self.owner = assign_owners({n: muon.ns_flops(p.full_shape, ns_steps) for n, p in self.matrices.items()},
                                   self.world)
        self.pieces_of: dict[str, list[tuple]] = {}  # every piece of each matrix, over all ranks
        for k in sorted(holders):
            self.pieces_of.setdefault(k[0], []).append(k)
        # sender of each piece to its owner, and the (piece, offset) lists of each rank-to-rank message
        self.sender = {k: self.owner[k[0]] if self.owner[k[0]] in h else h[0] for k, h in holders.items()}
        self.gather = [[[] for _ in range(self.world)] for _ in range(self.world)]
        self.result = [[[] for _ in range(self.world)] for _ in range(self.world)]
        for k in sorted(holders):
            owner = self.owner[k[0]]
            if self.sender[k] != owner:
                self.gather[self.sender[k]][owner].append(k)
            for h in holders[k]:
                if h != owner:
                    self.result[owner][h].append(k)
        self.gather_chunk = self._chunk(self.gather)
        self.result_chunk = self._chunk(self.result)

    def _chunk(self, messages) -> int:
        """The all-to-all's per-rank chunk: the largest message (0: nothing to move)."""
        return max((sum(k[3] - k[2] for k in m) for row in messages for m in row), default=0)

    def owned(self) -> list[str]:
        return sorted(n for n, r in self.owner.items() if r == self.me)

    def buffer_bytes(self, element_size: int) -> int:
        """The send buffers of one step's two all-to-alls (one padded chunk per rank; all but this rank's own
        chunk cross the wire, and as many bytes arrive)."""
        return self.world * (self.gather_chunk + self.result_chunk) * element_size

    def _all_to_all(self, messages, chunk: int, values: dict, dtype, device) -> dict:
        """Send values[k] for the keys of messages[me][r] to each rank r; returns {key: tensor} received."""
        if chunk == 0:
            return {}
        send = torch.zeros(self.world, chunk, dtype=dtype, device=device)
        for r, keys in enumerate(messages[self.me]):
            offset = 0
            for k in keys:
                send[r, offset:offset + k[3] - k[2]] = values[k]
                offset += k[3] - k[2]
        recv = torch.empty_like(send)
        comm.all_to_all_into(recv.view(-1), send.view(-1), self.group)
        out = {}
        for r in range(self.world):
            offset = 0
            for k in messages[r][self.me]:
                out[k] = recv[r, offset:offset + k[3] - k[2]]
                offset += k[3] - k[2]
        return out

    def orthogonalise(self, inputs: list[torch.Tensor], dtype, device, coefficients, steps: int,
                      eps: float) -> list[torch.Tensor]:
        """NS of every matrix from this rank's `inputs` (flat, aligned with `held`, in `dtype`); returns the
        result's pieces, aligned likewise."""
        mine = {p.key: x for p, x in zip(self.held, inputs)}
        arrived = {**self._all_to_all(self.gather, self.gather_chunk, mine, dtype, device),
                   **{k: x for k, x in mine.items() if self.sender[k] == self.me}}
        results = {}
        for name in self.owned():
            m, keys = self.matrices[name], self.pieces_of[name]
            split = m.tp_dim is not None
            shape = local_shape(m.full_shape, m.tp_dim, self.tp_size if split else 1)
            slots = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.tp_size if split else 1)]
            for k in keys:
                slots[k[1]].view(-1)[k[2]:k[3]] = arrived[k]
            full = torch.cat(slots, dim=m.tp_dim) if split else slots[0]
            out = muon.orthogonalise(full, coefficients, steps, eps)
            parts = out.chunk(len(slots), dim=m.tp_dim) if split else [out]
            for k in keys:
                results[k] = parts[k[1]].reshape(-1)[k[2]:k[3]]
        results.update(self._all_to_all(self.result, self.result_chunk, results, dtype, device))
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
