"""ZeRO-3's input embedding looked up by rows instead of gathered whole.

Under zero_stage 3 the untied input embedding is a sharding unit of its own (parallel/fsdp_units.py). Gathering
it for a micro-batch's forward moves the whole table to every rank, and reduce-scattering its gradient moves the
whole table back, although a micro-batch of n tokens reads at most n of its rows. In a training forward, instead:

- every rank all-gathers the data-parallel group's token ids (n per rank);
- each rank answers every rank's ids with the part of each row that lies in its shard (zeros elsewhere), and one
  all-to-all hands each rank the answers to its own ids, which it sums: every element has exactly one owner,
  so the sum is the row itself, exactly;
- in backward, every rank all-gathers the group's output gradients and adds, rank by rank, those of the rows it
  owns into its gradient shard, each rank's sum divided by the group size before it is added, as the
  reduce-scatter path divides before it sums: with two ranks the shard equals the reduce-scatter's to the bit.

Per rank and micro-batch that moves about (N - 1) n (2 h e + 8) bytes (N ranks, h wide rows of e bytes, 8-byte
ids) where the gather and the reduce-scatter move 2 (N - 1) / N of the table; `lookup_worth_it` takes the row
path when it moves less. Forwards without gradient (evaluation, generation, whose shapes may differ between
ranks) gather the table as before, and every rank's training micro-batch must hold the same number of tokens,
as Trilith's loader makes them.
"""
from __future__ import annotations

import torch

from parallel import comm


def lookup_worth_it(rows: int, width: int, element: int, group_size: int, tokens: int) -> bool:
    """Whether `tokens` ids per rank and micro-batch move fewer bytes by rows than gathering and
    reduce-scattering a table of `rows` × `width` elements of `element` bytes over `group_size` ranks."""
    return group_size * tokens * (2 * width * element + 8) < 2 * rows * width * element


class ShardedEmbeddingLookup:
    """The row lookup of one ZeRO-3 embedding unit (a single [rows, width] table). `on_reduced(unit, shard)`
    receives each micro-batch's reduced gradient for this rank's shard (parallel/fsdp.py adds it in).
    `active` is set by the owner for the backward passes of a training step."""

    def __init__(self, unit, on_reduced):
        self.unit, self.on_reduced = unit, on_reduced
        self.size = comm.group_size(unit.group)
        self.width = unit.params[0].shape[1]
        self.count = max(0, min(unit.shard_numel, unit.numel - unit.shard_start))  # table elements in my shard
        self.first_row = unit.shard_start // self.width
        self.end_row = -(-(unit.shard_start + self.count) // self.width) if self.count else self.first_row
        self.offset = unit.shard_start - self.first_row * self.width  # my shard's start inside my rows
        self.active = False

    def applies(self, module: torch.nn.Module) -> bool:
        return self.active and module.training and torch.is_grad_enabled()

    def __call__(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """F.embedding(ids, weight) for a weight whose full table is not gathered."""
        return _RowLookup.apply(ids, weight, self)

    def owned_rows(self) -> torch.Tensor:
        """[end_row - first_row, width]: the rows my shard touches, zero where an element is another shard's."""
        shard = self.unit.param_shard
        if self.offset == 0 and self.count % self.width == 0:
            return shard[:self.count].view(-1, self.width)
        rows = torch.zeros(self.end_row - self.first_row, self.width, dtype=shard.dtype, device=shard.device)
        rows.view(-1)[self.offset:self.offset + self.count] = shard[:self.count]
        return rows

    def gather_ids(self, ids: torch.Tensor) -> torch.Tensor:
        mine = ids.reshape(-1).long().contiguous()
        every = torch.empty(self.size * mine.numel(), dtype=torch.long, device=mine.device)
        comm.all_gather_into(every, mine, self.unit.group)
        return every.view(self.size, -1)

    def _mine(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index into owned_rows, clamped into it, and whether I own any of the row [.., 1]) for each id;
        masks rather than boolean indexing, so that a GPU never waits for a count."""
        local = ids - self.first_row
        mine = (local >= 0) & (local < self.end_row - self.first_row)
        return local.clamp(0, max(self.end_row - self.first_row - 1, 0)), mine.unsqueeze(-1)

    def rows(self, every_ids: torch.Tensor) -> torch.Tensor:
        """This rank's looked-up rows [n, width], from the answers of every shard."""
        owned = self.owned_rows()
        local, mine = self._mine(every_ids)
        if owned.shape[0]:
            answers = torch.where(mine, owned[local], 0.0)
        else:  # a shard of padding only
            answers = torch.zeros(*every_ids.shape, self.width, dtype=owned.dtype, device=owned.device)
        received = torch.empty_like(answers)
        comm.all_to_all_into(received, answers, self.unit.group)
        return received.sum(0)

    def reduce(self, every_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Average the rows' gradients over the group into my shard, rank by rank. Tokens of rows I do not own
        add zeros (to a row of mine: x + 0 = x, so the sums are those of my tokens alone)."""
        mine_grad = grad.reshape(-1, self.width).contiguous()
        every = torch.empty(self.size * mine_grad.shape[0], self.width, dtype=grad.dtype, device=grad.device)
        comm.all_gather_into(every, mine_grad, self.unit.group)
        every = every.view(self.size, -1, self.width)
        local, mine = self._mine(every_ids)
        total = torch.zeros(self.end_row - self.first_row, self.width, dtype=grad.dtype, device=grad.device)
        part = torch.empty_like(total)
        if total.shape[0]:
            for rank in range(self.size):
                part.zero_().index_add_(0, local[rank], torch.where(mine[rank], every[rank], 0.0))
                total.add_(part.div_(self.size))
        self.on_reduced(self.unit, total.view(-1)[self.offset:self.offset + self.count])


class _RowLookup(torch.autograd.Function):
    """The weight is an input only so that autograd runs the backward, which reduces into the unit's
    gradient shard itself: the weight receives no gradient."""

    @staticmethod
    def forward(ctx, ids, weight, lookup):
        every_ids = lookup.gather_ids(ids)
        ctx.lookup = lookup
        ctx.save_for_backward(every_ids)
        return lookup.rows(every_ids).view(*ids.shape, lookup.width)

    @staticmethod
    def backward(ctx, grad):
        every_ids, = ctx.saved_tensors
        ctx.lookup.reduce(every_ids, grad)
        return None, None, None
