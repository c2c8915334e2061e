"""Optimizer state in host memory (`optim.offload_fraction`, Megatron's meaning): the share of a rank's fp32
optimizer state (master weights and both Adam moments) that lives, and is stepped, on the host.

The share is taken in whole state tensors (a parameter's under DDP, a unit's shard under ZeRO), in the order
backward produces their gradients, each tensor going to the host when that keeps the offloaded elements nearest
the fraction: 0 keeps everything on the device, 1 moves everything. On a GPU the masters and the gradient
buffers that cross PCIe are pinned; the moments never move, so they are ordinary host memory.

Exactness: the gradient norm, unscaling and clipping still run on the device over the same tensors, and the
AdamW kernel is elementwise and per tensor, so a tensor stepped on the host gets the update it would get on the
device wherever the same kernel runs (on CPU: bit for bit).
"""
from __future__ import annotations

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


def pinned() -> bool:
    return torch.cuda.is_available()


def host_empty(like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host buffer shaped like `like`, pinned when a GPU will copy to or from it."""
    return torch.empty(like.shape, dtype=dtype, device=HOST, pin_memory=pinned())


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """An fp32 host copy of `t` (pinned when a GPU is present)."""
    return host_empty(t).copy_(t.detach())


def copy_to_host(pairs: list) -> None:
    """Copy each (host buffer, device tensor) pair, all issued before one wait (pinned: asynchronous)."""
    for host, device in pairs:
        host.copy_(device, non_blocking=True)
    if any(device.is_cuda for _, device in pairs):
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
