"""Summed token losses of single sequences at any layout: the measurement behind downstream tasks
(engine/evaluate/tasks.py) and bits per byte (tools/evaluate.py).

A request is a token list and how many of its last tokens to score (their negative log-likelihood given
everything before them, in nats). Each request is one micro-batch of one sequence, right-padded to
model.seq_length + 1 tokens, with a loss mask on the scored positions: the model's masked mean loss times
the mask's count is the sum wanted, and the padding after the sequence cannot change it (causal
attention). This goes through the same forward-only paths as validation (no pipeline, or
`forward_only_pipeline` through the stages), so TP, PP and ZeRO-3 need nothing of their own. Data-parallel
ranks score every dp-th request and share the results with one all-reduce; each runs the same number of
forwards (an empty request fills the gap) because ZeRO-3 gathers parameters collectively.
"""
from __future__ import annotations

import math

import torch

from parallel import comm
from parallel.micro_batch import MicroBatch
from parallel.pipeline_schedules import forward_only_no_pipeline, forward_only_pipeline


class Scorer:
    """`batch` sequences per micro-batch for `total_nll` (the pipeline's exchange shape is [batch, s, h]);
    `nll_sums` always runs one sequence at a time (it needs each one's own sum)."""

    def __init__(self, chunks, seq_length: int, device, pipe=None, dp_group=None, dp_rank: int = 0,
                 dp_size: int = 1, batch: int = 1):
        self.chunks, self.seq_length, self.device, self.pipe = chunks, seq_length, device, pipe
        self.dp_group, self.dp_rank, self.dp_size, self.batch = dp_group, dp_rank, dp_size, batch

    def micro_batch(self, requests: list[tuple[list[int], int]]) -> MicroBatch:
        """One row per request: its last seq_length + 1 tokens (lm-evaluation-harness truncates on the left
        too), right-padded, with the loss mask on its scored tokens."""
        tokens = torch.zeros(len(requests), self.seq_length + 1, dtype=torch.long)
        mask = torch.zeros(len(requests), self.seq_length)
        for row, (ids, scored) in enumerate(requests):
            ids = ids[-(self.seq_length + 1):]
            scored = min(scored, len(ids) - 1)
            tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, len(ids) - 1 - scored:len(ids) - 1] = 1.0  # label j is token j + 1
        return MicroBatch(tokens.to(self.device), loss_mask=mask.to(self.device))

    def _masked_sums(self, groups: list[list]) -> torch.Tensor:
        """[len(groups)] summed losses of each group of requests (one micro-batch each), every rank."""
        for chunk in self.chunks:
            chunk.eval()
        sums = torch.zeros(len(groups), dtype=torch.float64, device=self.device)
        mine = list(range(self.dp_rank, len(groups), self.dp_size))
        for k in range(math.ceil(len(groups) / self.dp_size)):
            index = mine[k] if k < len(mine) else None
            group = groups[index] if index is not None else [([0], 0)] * len(groups[0])
            mb = self.micro_batch(group)
            with torch.no_grad():
                if self.pipe is None:
                    loss = forward_only_no_pipeline(self.chunks[0], [mb])
                else:
                    loss = forward_only_pipeline(self.chunks, [mb], self.pipe)
            if index is not None:  # the masked mean over the micro-batch, back to its sum
                sums[index] = loss.double() * mb.loss_mask.sum().double()
        if self.dp_size > 1:
            comm.all_reduce(sums, self.dp_group)
        return sums

    def nll_sums(self, requests: list[tuple[list[int], int]]) -> list[float]:
        """Summed negative log-likelihood (nats) of each request's scored tokens, the same on every rank."""
        if self.batch != 1:
            raise ValueError("nll_sums scores one sequence per micro-batch: build the Scorer with batch=1")
        return self._masked_sums([[r] for r in requests]).tolist()

    def total_nll(self, requests: list[tuple[list[int], int]]) -> float:
        """The nats summed over all requests' scored tokens, `batch` sequences per forward."""
        padded = requests + [([0], 0)] * (-len(requests) % self.batch)
        return float(self._masked_sums([padded[i:i + self.batch]
                                        for i in range(0, len(padded), self.batch)]).sum())
