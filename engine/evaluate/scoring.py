"""Summed token losses of token sequences at any layout: the measurement behind downstream tasks
(engine/evaluate/tasks.py) and bits per byte (tools/evaluate.py).

A request is a token list and how many of its last tokens to score (their negative log-likelihood given
everything before them, in nats). Requests longer than window + 1 tokens keep their last window + 1, as
lm-evaluation-harness truncates. A micro-batch is right-padded only to its longest request, rounded up to a
multiple of what splits the sequence (the TP size under sequence parallelism; 2c chunks under context
parallelism, each split again by sequence parallelism), so the
cost follows the text's tokens, not the model's context; `total_nll` sorts requests longest first, as the
harness's collator does, so that a micro-batch holds requests of similar length. A loss mask covers the
scored positions: the model's masked mean loss times the mask's count is the sum wanted, and the padding
after a sequence cannot change it (causal attention). This goes through the same forward-only paths as
validation (no pipeline, or `forward_only_pipeline` through the stages, whose exchanges take each
micro-batch's shape), so TP, PP and ZeRO-3 need nothing of their own; under context parallelism every CP rank
of a data-parallel rank builds the same micro-batch and the model keeps its chunks (the loss is summed over CP). Data-parallel ranks score every dp-th
micro-batch and share the results with one all-reduce; each runs the same number of forwards (an empty
request fills the gap) because ZeRO-3 gathers parameters collectively.
"""
from __future__ import annotations

import math

import torch

from parallel import comm
from parallel.context import ContextParallel
from parallel.micro_batch import MicroBatch
from parallel.pipeline_schedules import forward_only_no_pipeline, forward_only_pipeline

EMPTY = ([0], 0)  # a request that scores nothing: the forward a rank without work still joins


def rolling_windows(tokens: list[int], prefix: int, window: int) -> list[tuple[list[int], int]]:
    """lm-evaluation-harness's rolling log-likelihood requests for one document (its
    get_rolling_token_windows with context_len=1, each made disjoint): the first scores the first `window`
    tokens after `prefix`; each later one scores the next `window` tokens (fewer in the last) after the
    tokens before them, window + 1 tokens in all, so a short last window still sees a whole window's context.
    Every token is scored once."""
    if not tokens:
        return []
    first = min(window, len(tokens))
    out = [([prefix] + tokens[:first], first)]
    for start in range(first, len(tokens), window):
        end = min(start + window, len(tokens))
        out.append((tokens[end - window - 1:end], end - start))
    return out


class Scorer:
    """Requests through this rank's model chunks, `batch` sequences per micro-batch for `total_nll`;
    `nll_sums` always runs one sequence at a time (it needs each one's own sum). `pipe` is this scorer's own
    PipelineComm: it is reshaped for every micro-batch. `context`: the model's ContextParallel when c > 1."""

    def __init__(self, chunks, window: int, device, pipe=None, dp_group=None, dp_rank: int = 0, dp_size: int = 1,
                 batch: int = 1, sequence_shards: int = 1, context: ContextParallel | None = None):
        self.chunks, self.window, self.device, self.pipe = chunks, window, device, pipe
        self.dp_group, self.dp_rank, self.dp_size, self.batch = dp_group, dp_rank, dp_size, batch
        self.context = context
        c = context.size if context is not None else 1
        # the full length splits into 2c chunks and each rank's s/c tokens over the sequence-parallel ranks
        self.length_multiple = math.lcm(2 * c, c * sequence_shards) if c > 1 else sequence_shards
        self.local_divisor = c * sequence_shards

    def micro_batch(self, requests: list[tuple[list[int], int]]) -> MicroBatch:
        """One row per request: its last window + 1 tokens, right-padded to the longest row, with the loss
        mask on its scored tokens."""
        rows = [ids[-(self.window + 1):] for ids, _ in requests]
        length = max(max(len(ids) for ids in rows) - 1, 1)
        length = -(-length // self.length_multiple) * self.length_multiple
        tokens = torch.zeros(len(rows), length + 1, dtype=torch.long)
        mask = torch.zeros(len(rows), length)
        for row, (ids, (_, scored)) in enumerate(zip(rows, requests)):
            scored = min(scored, len(ids) - 1)
            tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, len(ids) - 1 - scored:len(ids) - 1] = 1.0  # label j is token j + 1
        return MicroBatch(tokens.to(self.device), loss_mask=mask.to(self.device), context=self.context)

    def _forward(self, mb: MicroBatch) -> torch.Tensor:
        with torch.no_grad():
            if self.pipe is None:
                return forward_only_no_pipeline(self.chunks[0], [mb])
            rows, length = mb.loss_mask.shape
            self.pipe.reshape((rows, length // self.local_divisor, self.pipe.shape[-1]))
            return forward_only_pipeline(self.chunks, [mb], self.pipe)

    def _masked_sums(self, groups: list[list]) -> torch.Tensor:
        """[len(groups)] summed losses of each group of requests (one micro-batch each), every rank."""
        for chunk in self.chunks:
            chunk.eval()
        sums = torch.zeros(len(groups), dtype=torch.float64, device=self.device)
        mine = list(range(self.dp_rank, len(groups), self.dp_size))
        for k in range(math.ceil(len(groups) / self.dp_size)):
            index = mine[k] if k < len(mine) else None
            mb = self.micro_batch(groups[index] if index is not None else [EMPTY])
            loss = self._forward(mb)
            if index is not None:  # the masked mean over the micro-batch, back to its sum
                sums[index] = loss.double() * mb.loss_mask.sum().double()
        if self.dp_size > 1:
            comm.all_reduce(sums, self.dp_group)
        return sums

    def nll_sums(self, requests: list[tuple[list[int], int]]) -> list[float]:
        """Summed negative log-likelihood (nats) of each request's scored tokens, the same on every rank."""
        return self._masked_sums([[r] for r in requests]).tolist()

    def total_nll(self, requests: list[tuple[list[int], int]]) -> float:
        """The nats summed over all requests' scored tokens, `batch` sequences per forward, longest first."""
        ordered = sorted(requests, key=lambda r: -min(len(r[0]), self.window + 1))
        return float(self._masked_sums([ordered[i:i + self.batch]
                                        for i in range(0, len(ordered), self.batch)]).sum())
