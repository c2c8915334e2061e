"""Forward/backward over the micro-batches of one step when there is no pipeline."""
from __future__ import annotations

import torch


def forward_backward_no_pipeline(model, micro_batches: list, loss_scale: float = 1.0) -> torch.Tensor:
    """Each micro-batch's mean token loss, backpropagated with weight 1/m; returns the mean loss (detached)."""
    total = torch.zeros((), dtype=torch.float32, device=micro_batches[0].device)
    m = len(micro_batches)
    for tokens in micro_batches:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        (loss * (loss_scale / m)).backward()
        total += loss.detach().float()
    return total / m
