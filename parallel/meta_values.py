"""Reading a device tensor's value back on the host, when the tensor may hold none.

Under a dry run (engine/dry_run) every tensor lives on the meta device: it has a shape and a dtype but no
storage, and the fake process group's collectives return at once. The program still runs every collective and
kernel; only the few places that read a value on the host (a loss to log, a gradient norm to clip by, a
flag that stops every rank) get a stand-in: the value of the program's ordinary path (a finite loss, a norm
that clips nothing, no flag raised), so that the dry run takes the path a healthy step takes.
"""
from __future__ import annotations

import torch


def readable(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds values to read (False on the meta device)."""
    return tensor.device.type != "meta"


def item(tensor: torch.Tensor, absent: float = 0.0):
    """tensor.item(), or `absent` when it holds no values."""
    return tensor.item() if readable(tensor) else absent


def host_values(tensor: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """`tensor`, or, when it holds no values, a CPU tensor of its shape and dtype filled with `fill`."""
    return tensor if readable(tensor) else torch.full(tensor.shape, fill, dtype=tensor.dtype, device="cpu")
