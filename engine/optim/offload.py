"""Optimizer state in host memory (`optim.offload_fraction`, Megatron's meaning): the share of a rank's fp32
optimizer state (master weights and both Adam moments) that lives, and is stepped, on the host.

The share is taken in whole state tensors (a parameter's under DDP, a unit's shard under ZeRO), in the order
backward produces their gradients, each tensor going to the host when that keeps the offloaded elements nearest
the fraction: 0 keeps everything on the device, 1 moves everything. On a GPU what crosses PCIe is pinned (the
masters, the gradients' staging buffers); the moments and the fp32 gradients a 16-bit one is upcast into never
move, so they are ordinary host memory.

Exactness: the gradient norm, unscaling and clipping still run on the device over the same tensors, and the
AdamW kernel is elementwise and per tensor, so a tensor stepped on the host gets the update it would get on the
device wherever the same kernel runs (on CPU: bit for bit).
"""
from __future__ import annotations

import os

import torch

HOST = torch.device("cpu")


def offloaded(numels: list[int], fraction: float) -> list[bool]:
    """Which of these state tensors (in order) go to the host so that their elements come nearest `fraction`
    of the total: a tensor goes when at least half of it fits under the target."""
    target, taken, out = fraction * sum(numels), 0, []
    for n in numels:
        go = n > 0 and taken + n / 2 <= target
        taken += n if go else 0
        out.append(go)
    return out


def host_threads(cfg) -> int:
    """Intra-op threads of the host step's worker (optim.offload_threads; 0: the node's cores over its local
    ranks, minus one for the rank's own autograd and loader thread, at least one)."""
    if cfg.offload_threads > 0:
        return cfg.offload_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) - 1)


def pinned() -> bool:
    return torch.cuda.is_available()


def host_empty(like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host buffer shaped like `like`, pinned when a GPU will copy to or from it."""
    return torch.empty(like.shape, dtype=dtype, device=HOST, pin_memory=pinned())


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """An fp32 host copy of `t` (pinned when a GPU is present)."""
    return host_empty(t).copy_(t.detach())


class HostGrad:
    """Where an offloaded piece's gradient lands on the host. It crosses PCIe in the device gradient's own
    dtype: a 16-bit gradient into a pinned 16-bit `staging` buffer (half the bytes of an fp32 copy), then upcast
    on the host into `fp32`, what the host step reads (the upcast is exact: the same bits as upcasting on the
    device); an fp32 gradient straight into `fp32`, then the one pinned. A ZeRO unit's fp32-reduced elements
    (`tail`, positions in its shard, parallel/fsdp_units.Unit.grad32) cross in fp32, in the staging buffer's last
    bytes, and overwrite their positions after the upcast, as Unit.master_grad does on the device."""

    def __init__(self, like: torch.Tensor, dtype: torch.dtype, tail: slice = slice(0, 0)):
        n, count = like.numel(), tail.stop - tail.start
        self.fp32 = torch.empty(like.shape, dtype=torch.float32, device=HOST,
                                pin_memory=pinned() and dtype == torch.float32)
        self.tail, self.staging, self.has_tail = tail, None, False
        if dtype != torch.float32:
            main = n + n % 2  # the fp32 tail starts 4-byte aligned
            self.staging = torch.empty(main + 2 * count, dtype=dtype, device=HOST, pin_memory=pinned())
            self.main, self.tail32 = self.staging[:n], self.staging[main:].view(torch.float32)

    def send(self, grad: torch.Tensor, tail32: torch.Tensor | None = None) -> None:
        """Issue the copies from the device (asynchronous when pinned: wait for the stream before `land`)."""
        if self.staging is None:
            self.fp32.view(-1).copy_(grad.reshape(-1), non_blocking=True)
            return
        self.main.copy_(grad.reshape(-1), non_blocking=True)
        self.has_tail = tail32 is not None
        if self.has_tail:
            self.tail32.copy_(tail32, non_blocking=True)

    def land(self) -> torch.Tensor:
        """After the copies are complete: the fp32 gradient on the host (upcast here)."""
        if self.staging is not None:
            flat = self.fp32.view(-1)
            flat.copy_(self.main)
            if self.has_tail:
                flat[self.tail].copy_(self.tail32)
        return self.fp32

    def tensors(self) -> list:
        return [self.fp32] + ([self.staging] if self.staging is not None else [])


def wait_for_device(tensors: list) -> None:
    """The copies issued on the current stream from these device tensors are complete (no-op on CPU)."""
    if any(t.is_cuda for t in tensors):
        torch.cuda.current_stream().synchronize()


def by_device(tensors: list) -> list[list]:
    """`tensors` grouped by device (a multi-tensor kernel runs on one device at a time)."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def copy_to_device(pairs: list) -> None:
    """Copy each (device tensor, master) pair (the master possibly on the host), all issued before one wait:
    the host must not step a master again while its copy is in flight."""
    for device, master in pairs:
        device.copy_(master, non_blocking=True)
    if any(device.is_cuda for device, _ in pairs):
        torch.cuda.current_stream().synchronize()
