"""Validation loss during training (train.eval_interval, eval_iters, eval_per_dataset): the first eval_iters
global batches of a validation split, the same samples at every evaluation, dropout off, no gradients, at
any parallel layout."""
from __future__ import annotations

import torch

from engine.config.schema import TrainConfig
from parallel import comm
from parallel.pipeline_schedules import forward_only_no_pipeline, forward_only_pipeline


def forward_only(chunks: list, micro_batches: list, pipe) -> torch.Tensor:
    """The mean loss of `micro_batches` through this rank's model chunks, without gradients; on every
    pipeline stage (`pipe` None: no pipeline)."""
    if pipe is None:
        return forward_only_no_pipeline(chunks[0], micro_batches)
    return forward_only_pipeline(chunks, micro_batches, pipe)


def evaluation_due(step: int, t: TrainConfig) -> bool:
    """Every train.eval_interval steps, and after the last."""
    return t.eval_interval > 0 and (step % t.eval_interval == 0 or step == t.steps)


def validation_loss(chunks: list, pipe, loader, iters: int, to_micro_batch, topo, device: torch.device) -> float:
    """Mean loss over `iters` global batches of `loader` (to_micro_batch adds the document extras), averaged
    over the data-parallel ranks."""
    for chunk in chunks:
        chunk.eval()
    total = 0.0
    for _ in range(iters):
        micro_batches = [to_micro_batch(mb.to(device)) for mb in loader.next_global_batch()]
        loss = forward_only(chunks, micro_batches, pipe)
        comm.all_reduce(loss, topo.dp_group)
        total += loss.item() / topo.dp_size
    return total / iters
