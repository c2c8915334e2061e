"""The unit a schedule works on: one micro-batch of packed samples and its document extras."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import flash_varlen_in_use, remember_offsets
from parallel.context import ContextParallel


@dataclass
class MicroBatch:
    """Packed samples `tokens` [b, s + 1] (inputs are tokens[:, :-1], labels tokens[:, 1:]) and, for
    document-masked training, per-input-token extras [b, s] (data/documents.py); None means off. Under
    context parallelism (`context`) the model receives this rank's chunks of them (segment_ids stay whole)."""
    tokens: torch.Tensor
    segment_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    context: ContextParallel | None = None

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch on `device`, copied without waiting. When flash-attn's varlen kernel will read the
        documents, their offsets are computed here from the host copy, so that no layer reads them back; so are
        the chunk pairs context parallelism skips."""
        def moved(t):
            return None if t is None else t.to(device, non_blocking=True)
        out = MicroBatch(moved(self.tokens), moved(self.segment_ids), moved(self.position_ids), moved(self.loss_mask),
                         self.context)
        if self.segment_ids is not None and flash_varlen_in_use():
            remember_offsets(out.segment_ids, self.segment_ids)
        if self.segment_ids is not None and self.context is not None:
            self.context.remember_documents(out.segment_ids, self.segment_ids)
        return out

    @staticmethod
    def of(batch) -> MicroBatch:
        return batch if isinstance(batch, MicroBatch) else MicroBatch(batch)

    def forward_args(self, first: bool, last: bool, received=None) -> tuple[tuple, dict]:
        """Positional and keyword arguments of a model chunk: token ids on the first chunk, else the hidden
        states `received`; labels and loss mask only on the last."""
        shard = self.context.shard if self.context is not None else (lambda t: t)
        inputs = shard(self.tokens[:, :-1]) if first else received
        labels = shard(self.tokens[:, 1:]) if last else None
        positions = None if self.position_ids is None else shard(self.position_ids)
        kwargs = {"segment_ids": self.segment_ids, "position_ids": positions}
        if last:
            kwargs["loss_mask"] = None if self.loss_mask is None else shard(self.loss_mask)
        return (inputs, labels), kwargs
