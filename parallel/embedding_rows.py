"""The input embedding's gradient, exchanged as the rows a step read instead of all-reduced whole (zero_stage 0).

A data-parallel rank's embedding gradient is zero outside the rows of the token ids it looked up this step: at
1,024 tokens per rank and an 8,192-row vocabulary, at most an eighth of the table. Each rank sends the rows its
ids touched, divided by the group size as the dense path divides before its all-reduce, and every rank adds
all ranks' rows in rank order into a table zeroed there, so the replicas stay bit-identical (with two ranks the
sum is the all-reduce's to the bit: a + b = b + a). Rows nobody read stay zero, and only the touched rows are
zeroed after the step.

Every rank receives every rank's rows, so the exchange's bytes grow with the group size where the ring
all-reduce's do not: it is taken only when even its worst case (every token of the step a distinct row) moves
fewer bytes than all-reducing the table, a decision every rank makes alike from the step's token count.
parallel/ddp.py takes the table out of its buckets only when the run's full batch makes the exchange the
cheaper; a step that reads more tokens divides and all-reduces the table whole. Tied embeddings (the table
also used as the output layer) have a dense gradient and are never exchanged this way.
"""
from __future__ import annotations

import torch

from parallel import comm


def rows_worth_it(weight: torch.Tensor, dp_size: int, tokens: int) -> bool:
    """Whether exchanging at most `tokens` rows of `weight` per rank (and their ids) moves fewer bytes per rank
    than a ring all-reduce of the whole table over `dp_size` ranks."""
    rows, width = weight.shape
    element = weight.element_size()
    worst = dp_size * min(tokens, rows) * (width * element + 8)
    return worst < 2 * (dp_size - 1) / dp_size * rows * width * element


class EmbeddingRows:
    """Owns the embedding table's `.grad` (persistent) and the token ids the step's forward passes read."""

    def __init__(self, embedding: torch.nn.Module, dp_group, dp_size: int):
        self.weight, self.dp_group, self.dp_size = embedding.weight, dp_group, dp_size
        self.weight.grad = torch.zeros_like(self.weight)
        self.grad = self.weight.grad
        self.rows_read: list = []
        self.touched = None  # rows that may be nonzero after the exchange; None: any row
        self.last_exchange = "none"  # "rows" or "dense": what the last step did, for tests and benchmarks
        embedding.register_forward_pre_hook(self._record)
        self._local_rows = embedding.local_rows

    def _record(self, module, args) -> None:
        if torch.is_grad_enabled() and module.training:  # evaluation and probe forwards have no gradient
            self.rows_read.append(args[0])

    def reduce(self) -> None:
        """Sum the table's gradient over the data-parallel group and divide it by the group size."""
        if self.weight.grad is not self.grad:  # something replaced it since the last step: take it over
            if self.weight.grad is not None:
                self.grad.copy_(self.weight.grad)
            self.weight.grad = self.grad
        tokens = sum(ids.numel() for ids in self.rows_read)
        read, self.rows_read = self.rows_read, []
        if not rows_worth_it(self.weight, self.dp_size, tokens):
            self.grad.div_(self.dp_size)
            comm.all_reduce(self.grad, self.dp_group)
            self.touched, self.last_exchange = None, "dense"
            return
        # Every shape below follows from the token count alone, never from the ids' values, so on a GPU nothing
        # waits for the device: the distinct rows this rank read come first in `mine`, then -1s.
        bound = min(tokens, self.grad.shape[0])  # rows per rank at most: the same number on every rank
        self.last_exchange = "rows"
        if bound == 0:  # no forward this step, on any rank: nothing was read, nothing to add
            self.touched = torch.empty(0, dtype=torch.long, device=self.grad.device)
            return
        mine = self._distinct_rows(read, bound)
        valid = mine >= 0
        rows = self.grad.index_select(0, mine.clamp(min=0)).div_(self.dp_size).masked_fill_(~valid.unsqueeze(1), 0.0)
        all_ids = torch.empty(self.dp_size * bound, dtype=torch.long, device=self.grad.device)
        comm.all_gather_into(all_ids, mine, self.dp_group)
        width = self.grad.shape[1]
        all_rows = torch.empty(self.dp_size * bound, width, dtype=self.grad.dtype, device=self.grad.device)
        comm.all_gather_into(all_rows, rows, self.dp_group)
        all_ids, all_rows = all_ids.view(self.dp_size, bound), all_rows.view(self.dp_size, bound, width)
        # -1 slots point at row 0 and carry zeros: zeroing row 0 there is harmless (a row this rank did not read
        # holds a zero gradient) and adding their zeros leaves it unchanged.
        self.grad.index_fill_(0, mine.clamp(min=0), 0.0)  # this rank's rows come back with the others', in order
        for rank in range(self.dp_size):
            self.grad.index_add_(0, all_ids[rank].clamp(min=0), all_rows[rank])
        self.touched = all_ids.reshape(-1).clamp(min=0)

    def _distinct_rows(self, read: list, bound: int) -> torch.Tensor:
        """[bound]: the distinct rows of this rank's table that `read` looked up, ascending, then -1s."""
        rows = self.grad.shape[0]
        if not read:
            return torch.full((bound,), -1, dtype=torch.long, device=self.grad.device)
        local = torch.sort(self._local_rows(torch.cat([ids.reshape(-1) for ids in read]))).values
        repeat = torch.zeros_like(local, dtype=torch.bool)
        repeat[1:] = local[1:] == local[:-1]
        distinct = torch.sort(local.masked_fill(repeat, rows)).values[:bound]  # other ranks' ids are `rows` too
        return distinct.masked_fill(distinct == rows, -1)

    def zero_grad(self) -> None:
        if self.weight.grad is not self.grad or self.rows_read:  # replaced, or a backward never reduced
            self.weight.grad, self.touched, self.rows_read = self.grad, None, []
        if self.touched is None:
            self.grad.zero_()
        else:
            self.grad.index_fill_(0, self.touched, 0.0)
        self.touched = torch.empty(0, dtype=torch.long, device=self.grad.device)
