"""The communication of memory snapshots (engine/checkpoint/memory_snapshot.py): the partner copy and recovery.

Pairing: nodes are ordered by their lowest rank; the rank with local index i on node n sends its snapshot to
the rank with local index i on node (n + 1) mod N, and holds the snapshot of local index i on node n - 1. With
ranks packed by node (torchrun, SLURM's block distribution), R ranks per node: rank r -> (r + R) mod world. One
node, or nodes of different rank counts: no partner (the node's shared memory is the only copy).

Everything here moves CPU byte tensors on gloo groups: the partner copy on a group of its own, so that it can go
on in a background thread while training uses the world's groups (NCCL on GPUs); the recovery's gather and
deliveries, before training starts, on the checkpointer's host group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import comm
from parallel.distributed import host_backend


def partners(nodes: list[str]) -> list[int | None]:
    """For every rank, the rank its snapshot is copied to (None on a single node), from every rank's node name."""
    order = list(dict.fromkeys(nodes))
    if len(order) < 2:
        return [None] * len(nodes)
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    if len({len(m) for m in members.values()}) > 1:  # uneven nodes: no one-to-one pairing, no partner copies
        return [None] * len(nodes)
    out = []
    for rank, node in enumerate(nodes):
        index = members[node].index(rank)
        target = members[order[(order.index(node) + 1) % len(order)]]
        out.append(target[index])
    return out


def as_tensor(payload) -> torch.Tensor:
    """A writable buffer (bytearray, memory map) as a uint8 tensor on its memory (torch.frombuffer refuses an
    empty one)."""
    return torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)


class SnapshotExchange:
    """Built on every rank at once (on several nodes it makes a process group); `nodes` is every rank's node name,
    `group` a host group over every rank for the recovery's gather and deliveries, used only by the training
    thread."""

    def __init__(self, rank: int, nodes: list[str], group=None):
        self.rank, self.world = rank, len(nodes)
        self.partner_of = partners(nodes)
        self.partner = self.partner_of[rank]
        sources = [r for r, p in enumerate(self.partner_of) if p == rank]
        self.source = sources[0] if sources else None  # whose snapshot this rank holds
        self.coordination = group if self.world > 1 else None
        # The partner copies run in a background thread beside the checkpointer's own use of `group`, hence a
        # group of their own; without partners (partners() gives every rank one or none) none is made, saving its
        # connection set-up, which waits for every rank
        self.group = dist.new_group(backend=host_backend()) if self.partner is not None else None
        comm.register_group(self.group, "snapshot")

    def swap(self, head: bytes, body, receive, between=lambda: None):
        """Send this rank's snapshot to its partner and receive its source's (blocking; background thread): first
        each side's `head` (its manifest) and body size, then the bodies (the state files), this one sent from its
        own memory and the source's received straight into `receive(head, size)`, a writable buffer of that
        size; returns the source's head, or None without a partner. `between` runs after the
        sizes are exchanged, before the bytes (a test's injected fault)."""
        if self.partner is None:
            return None
        sizes_in = torch.zeros(2, dtype=torch.int64)
        comm.host_send_recv(torch.tensor([len(head), len(body)], dtype=torch.int64), self.partner, sizes_in,
                            self.source, self.group)
        between()
        head_in = torch.empty(int(sizes_in[0]), dtype=torch.uint8)
        comm.host_send_recv(as_tensor(bytearray(head)), self.partner, head_in, self.source, self.group)
        theirs = head_in.numpy().tobytes()
        into = receive(theirs, int(sizes_in[1]))
        comm.host_send_recv(as_tensor(body), self.partner, as_tensor(into), self.source, self.group)
        return theirs

    def gather(self, obj) -> list:
        """Every rank's `obj` (what snapshots it holds), in rank order."""
        if self.coordination is None:
            return [obj]
        out = [None] * self.world
        comm.all_gather_object(out, obj, self.coordination)
        return out

    def deliver(self, moves: list[tuple[int, int]], payload_of) -> dict[int, memoryview]:
        """Carry out `moves` [(holder, owner)], the same list on every rank, one at a time in order: the holder
        sends `payload_of(owner)`, the owner receives. Returns {owner: payload} of what this rank received."""
        received = {}
        for holder, owner in moves:
            if self.rank == holder:
                data = payload_of(owner)
                comm.host_send_recv(torch.tensor([len(data)], dtype=torch.int64), owner, None, -1, self.coordination)
                comm.host_send_recv(as_tensor(data), owner, None, -1, self.coordination)
            elif self.rank == owner:
                size = torch.zeros(1, dtype=torch.int64)
                comm.host_send_recv(None, -1, size, holder, self.coordination)
                data_in = torch.empty(int(size.item()), dtype=torch.uint8)
                comm.host_send_recv(None, -1, data_in, holder, self.coordination)
                received[owner] = memoryview(data_in.numpy())
        return received
