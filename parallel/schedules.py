"""Micro-batches, and forward(/backward) over the micro-batches of one step when there is no pipeline."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    """Packed samples `tokens` [b, s + 1] (inputs are tokens[:, :-1], labels tokens[:, 1:]) and, for
    document-masked training, per-input-token extras [b, s] (data/documents.py); None means off."""
    tokens: torch.Tensor
    segment_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None

    @staticmethod
    def of(batch) -> MicroBatch:
        return batch if isinstance(batch, MicroBatch) else MicroBatch(batch)

    def forward_args(self, first: bool, last: bool, received=None) -> tuple[tuple, dict]:
        """Positional and keyword arguments of a model chunk: token ids on the first chunk, else the hidden
        states `received`; labels and loss mask only on the last."""
        inputs = self.tokens[:, :-1] if first else received
        labels = self.tokens[:, 1:] if last else None
        kwargs = {"segment_ids": self.segment_ids, "position_ids": self.position_ids}
        if last:
            kwargs["loss_mask"] = self.loss_mask
        return (inputs, labels), kwargs


def forward_backward_no_pipeline(model, micro_batches: list, loss_scale: float = 1.0) -> torch.Tensor:
    """Each micro-batch's mean token loss, backpropagated with weight 1/m; returns those losses ([m], float32,
    detached). `micro_batches`: MicroBatch objects or plain token tensors [b, s + 1]."""
    micro_batches = [MicroBatch.of(mb) for mb in micro_batches]
    m = len(micro_batches)
    losses = []
    for mb in micro_batches:
        args, kwargs = mb.forward_args(first=True, last=True)
        loss = model(*args, **kwargs)
        (loss * (loss_scale / m)).backward()
        losses.append(loss.detach().float())
    return torch.stack(losses)


@torch.no_grad()
def forward_only_no_pipeline(model, micro_batches: list) -> torch.Tensor:
    """Evaluation: the mean of the micro-batches' mean token losses, no gradients."""
    losses = [model(*args, **kwargs).float() for args, kwargs in
              (MicroBatch.of(mb).forward_args(first=True, last=True) for mb in micro_batches)]
    return torch.stack(losses).mean()
