"""Data-parallel gradient averaging for replicated parameters."""
from __future__ import annotations

import torch

from parallel import comm


def allreduce_gradients(params, dp_group) -> None:
    """Average gradients over the data-parallel group in one flat all-reduce."""
    size = comm.group_size(dp_group)
    if size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(size)
    comm.all_reduce(flat, dp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
