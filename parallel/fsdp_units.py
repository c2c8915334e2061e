"""Sharding units of ZeRO stages 1-3: which parameters share a flat buffer, and who owns which slice of it.

The sharding unit is one transformer block, plus one unit for the embedding and one for the final norm and
LM head (one unit for embedding + norm when the output layer is the tied embedding on this chunk). A unit
owns one flat buffer of its parameters (each parameter is a view into it). Its flat index space, padded to
a multiple of the shard-group size N, is split into N equal contiguous shards; DP rank r owns shard r of
every unit. `ShardRange` names the piece of a parameter inside this rank's shard, in both index spaces
(the flattened parameter and the shard), so checkpoints, the optimizer and the replica checks agree.

Under bf16/fp16, parameters reduced in fp32 (`reduces_in_fp32`: norm weights and configured names) are
laid out at the end of the unit; their gradients are kept in fp32 and reduce-scattered in fp32, each
rank's part of that segment padded to the largest part so the collective has equal chunks.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from parallel import comm
from parallel.ddp import reduces_in_fp32


def unit_plan(chunk) -> list[dict]:
    """The units of one model chunk in forward order: their modules, where they are entered and left, and
    whether their backward reads the parameters (an embedding's does not: its gradient is the output
    gradient scattered by token id, so ZeRO-3 does not gather it again for backward)."""
    bb = chunk.model
    tied_here = chunk.post_process and chunk.lm_head is None
    plan = []
    if bb.embed_tokens is not None:
        if tied_here:  # the output layer reuses the embedding: one unit used at both ends of the chunk
            plan.append(dict(modules=[bb.embed_tokens, bb.norm], entries=[bb.embed_tokens, bb.norm],
                             exits=[bb.embed_tokens, chunk]))
        else:
            plan.append(dict(modules=[bb.embed_tokens], entries=[bb.embed_tokens], exits=[bb.embed_tokens],
                             backward_reads_params=False))
    for layer in bb.layers.values():
        plan.append(dict(modules=[layer], entries=[layer], exits=[layer]))
    if chunk.post_process and not tied_here:
        plan.append(dict(modules=[m for m in (bb.norm, chunk.lm_head) if m is not None], entries=[bb.norm],
                         exits=[chunk]))
    return plan


@dataclass(frozen=True, eq=False)
class ShardRange:
    """The elements of one parameter that fall inside this rank's shard of its unit's flat buffer.

    `param_start:param_end` index the flattened parameter (what a checkpoint stores as the piece's range);
    `shard_start:shard_end` index the same elements in this rank's shard (master weights, moments, gradient).
    """
    name: str
    param: torch.Tensor
    param_start: int
    param_end: int
    shard_start: int
    shard_end: int


class BufferPool:
    """Flat buffers reused by (numel, dtype, device). ZeRO-2/3's full gradients and reduction outputs live only
    while a unit's reduction is in flight, so after the first step every step takes the ones it made."""

    def __init__(self):
        self.free: dict = collections.defaultdict(list)
        self.created = 0  # buffers allocated so far: constant from the second step on

    def take(self, numel: int, dtype: torch.dtype, device, zero: bool = False) -> torch.Tensor:
        stack = self.free[(numel, dtype, device)]
        if stack:
            buf = stack.pop()
            return buf.zero_() if zero else buf
        self.created += 1
        return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)

    def give(self, *bufs) -> None:
        for buf in bufs:
            if buf is not None:
                self.free[(buf.numel(), buf.dtype, buf.device)].append(buf)


class Unit:
    """One sharding unit: a flat buffer holding its parameters, split into equal shards over a DP group.

    index: position among all units of the rank (selects its process group when units have their own).
    named: (name, parameter) pairs in the unit, in forward order; each parameter becomes a view into `flat`.
    stage: the ZeRO stage (1: full gradients kept, 2: gradient shards, 3: parameters sharded too).
    group: the process group the unit's shards are gathered and reduced over.
    shard_size, shard_rank: the number of shards (the shard group's size) and which one this rank owns.
    compute_dtype: the dtype of the parameters and of `flat`; under bf16/fp16 the parameters that reduce in
        fp32 (`fp32_names`, see parallel.ddp.reduces_in_fp32) are placed last, as the fp32 segment.
    """

    def __init__(self, index: int, named: list, stage: int, group, shard_size: int, shard_rank: int,
                 compute_dtype: torch.dtype, fp32_names):
        self.index, self.stage, self.group = index, stage, group
        split = compute_dtype != torch.float32
        main = [(n, p) for n, p in named if not (split and reduces_in_fp32(n, fp32_names))]
        fp32 = [(n, p) for n, p in named if split and reduces_in_fp32(n, fp32_names)]
        self.named = main + fp32
        self.params = [p for _, p in self.named]
        self.offsets, offset = {}, 0
        for _, p in self.named:
            self.offsets[p] = offset
            offset += p.numel()
        self.numel = offset
        self.fp32_start = sum(p.numel() for _, p in main)  # segment [fp32_start, numel) reduces in fp32
        self.shard_numel = -(-max(offset, 1) // shard_size)
        self.padded = self.shard_numel * shard_size
        self.shard_size, self.shard_rank = shard_size, shard_rank
        self.shard_start = shard_rank * self.shard_numel
        # Per rank: (start in the fp32 segment, count) of the fp32 elements inside that rank's shard.
        self.fp32_parts = []
        for r in range(shard_size):
            first = max(self.fp32_start, r * self.shard_numel)
            end = min(self.numel, (r + 1) * self.shard_numel)
            self.fp32_parts.append((first - self.fp32_start, max(end - first, 0)))
        self.fp32_width = max(count for _, count in self.fp32_parts)
        start, count = self.fp32_parts[shard_rank]
        first = self.fp32_start + start - self.shard_start
        self.fp32_local = slice(first, first + count)  # this rank's fp32 elements, as positions in its shard
        self.shard_ranges = self._shard_ranges()

        device = self.params[0].device
        self.flat = torch.zeros(self.padded, dtype=compute_dtype, device=device)
        with torch.no_grad():
            for p in self.params:
                self.flat[self.offsets[p]:self.offsets[p] + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat[self.offsets[p]:self.offsets[p] + p.numel()].view(p.shape)
        self.full_bytes = self.padded * self.flat.element_size()
        self.gather_handle = None
        shard = slice(self.shard_start, self.shard_start + self.shard_numel)
        if stage == 3:
            self.param_shard = self.flat[shard].clone()
            self.flat.untyped_storage().resize_(0)
            self.gathered = False
        else:
            self.param_shard = self.flat[shard]
            self.gathered = True
        self.fp32_numel = self.numel - self.fp32_start
        # gradients: stage 1 keeps full ones; stages 2/3 keep only reduced shards (persistent, filled by the
        # step's first reduction) and borrow full ones from the BufferPool while a micro-batch reduces
        self.full_grad = self.full_grad32 = None
        self.grad_buffer = self.grad32_buffer = None
        local32 = self.fp32_local.stop - self.fp32_local.start
        if stage == 1:
            self.full_grad = torch.zeros(self.padded, dtype=compute_dtype, device=device)
            self.full_grad32 = torch.zeros(self.fp32_numel, dtype=torch.float32, device=device)
        else:
            self.grad_buffer = torch.zeros(self.shard_numel, dtype=compute_dtype, device=device)
        if self.fp32_numel:
            self.grad32_buffer = torch.zeros(local32, dtype=torch.float32, device=device)
        self.grad_shard = self.grad32 = None  # the buffers above once this step's gradient is in them
        self.arrived = 0
        self.micro_batches_done = 0
        self.reduced = False  # reduced at least once this step
        self.tied: list = []  # parameters summed over the pipeline's embedding group before reduction
        self.backward_reads_params = True  # False: stage 3 does not gather it for backward (unit_plan)
        self.in_backward = False  # between its pre-backward gather and its last gradient
        self.row_lookup = None  # stage 3's input embedding looked up by rows (parallel/embedding_shards.py)
        self.attached: dict = {}  # id(parameter) -> its `.grad`, a view of full_grad (attach_grads)

    def _shard_ranges(self) -> list[ShardRange]:
        """The parameters (or parts) inside this rank's shard, in buffer order."""
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        ranges = []
        for name, p in self.named:
            first, end = max(self.offsets[p], lo), min(self.offsets[p] + p.numel(), hi)
            if first < end:
                ranges.append(ShardRange(name, p, first - self.offsets[p], end - self.offsets[p], first - lo, end - lo))
        return ranges

    # -- parameters (stage 3) ----------------------------------------------------------------------
    def gather(self, async_op: bool = False) -> None:
        if self.gathered:
            return
        if self.gather_handle is None:
            self.flat.untyped_storage().resize_(self.full_bytes)
            self.gather_handle = comm.all_gather_into(self.flat, self.param_shard, self.group, async_op=True)
            if self.gather_handle is None:  # group of one: copied synchronously
                self.gathered = True
                return
        if not async_op:
            self.gather_handle.wait()
            self.gather_handle, self.gathered = None, True

    def free(self) -> None:
        if self.stage == 3 and self.gathered:
            self.flat.untyped_storage().resize_(0)
            self.gathered = False

    # -- gradients ---------------------------------------------------------------------------------
    def borrow_full_grad(self, pool: BufferPool) -> None:
        """Zeroed full gradient buffers from `pool` for this micro-batch (stages 2/3; stage 1 owns its own)."""
        if self.full_grad is None:
            self.full_grad = pool.take(self.padded, self.flat.dtype, self.flat.device, zero=True)
            self.full_grad32 = pool.take(self.fp32_numel, torch.float32, self.flat.device, zero=True)

    def attach_grads(self) -> None:
        """Point each parameter's `.grad` at its slice of the full gradient buffer (but the fp32 segment's, of
        another dtype): backward then accumulates there in place, the linear layers inside their weight-gradient
        matmul (kernels/grad_accumulation.py), and `add_grad` has nothing left to add."""
        for p in self.params:
            if self.offsets[p] < self.fp32_start:
                p.grad = self.full_grad_view(p).view_as(p)
                self.attached[id(p)] = p.grad

    def detach_grads(self) -> None:
        """Release the `.grad` views still attached: stage 1's at the end of a step, stage 3's of parameters
        that received no gradient (their buffer goes back to a pool)."""
        for p in self.params:
            if id(p) in self.attached:
                p.grad = None
        self.attached.clear()

    def add_grad(self, p: torch.Tensor) -> None:
        """Move `p.grad` into this unit's gradient buffers (the parameter's own gradient is released). An
        attached `.grad` is there already; stage 1's stays attached for the step's next micro-batches (its
        buffer is the unit's own), stage 3's is released with the micro-batch's buffer."""
        view = self.attached.get(id(p))
        if view is None:
            self.full_grad_view(p).add_(p.grad.reshape(-1))
            p.grad = None
            return
        if p.grad is not view:  # autograd replaced it (out of place) by the sum it accumulated
            view.copy_(p.grad)
        if self.stage == 1:
            p.grad = view
        else:
            del self.attached[id(p)]
            p.grad = None

    def full_grad_view(self, p: torch.Tensor) -> torch.Tensor:
        o = self.offsets[p]
        if o >= self.fp32_start:
            return self.full_grad32[o - self.fp32_start:o - self.fp32_start + p.numel()]
        return self.full_grad[o:o + p.numel()]

    def fp32_send_buffer(self, pool: BufferPool) -> torch.Tensor:
        """The fp32 segment as N equal chunks (chunk r = the part inside rank r's shard, zero-padded)."""
        out = pool.take(self.shard_size * self.fp32_width, torch.float32, self.full_grad32.device, zero=True)
        rows = out.view(self.shard_size, self.fp32_width)
        for r, (start, count) in enumerate(self.fp32_parts):
            rows[r, :count] = self.full_grad32[start:start + count]
        return out

    def reduce_target(self, pool: BufferPool) -> torch.Tensor:
        """Where the next reduce-scatter writes: the gradient shard itself for stage 2/3's first reduction of
        the step, else a pooled shard that take_reduced adds in (or, stage 1, copies into its full gradient)."""
        if self.stage >= 2 and not self.reduced:
            return self.grad_buffer
        return pool.take(self.shard_numel, self.flat.dtype, self.flat.device)

    def take_reduced(self, out: torch.Tensor, out32: torch.Tensor | None) -> None:
        count = self.fp32_local.stop - self.fp32_local.start
        first = self.grad_shard is None
        if self.stage == 1:
            self.grad_shard = self.full_grad[self.shard_start:self.shard_start + self.shard_numel]
            self.grad_shard.copy_(out)
        elif first:  # out is grad_buffer (reduce_target)
            self.grad_shard = out
        else:
            self.grad_shard.add_(out)
        if out32 is not None:
            if first or self.stage == 1:
                self.grad32 = self.grad32_buffer.copy_(out32[:count])
            else:
                self.grad32.add_(out32[:count])

    def master_grad(self) -> torch.Tensor:
        """This rank's reduced gradient shard in fp32 (zeros when no gradient arrived); under fp32 the gradient
        shard itself, which the optimizer may scale in place."""
        if self.grad_shard is None:
            return torch.zeros(self.shard_numel, dtype=torch.float32, device=self.param_shard.device)
        if self.grad_shard.dtype == torch.float32 and self.grad32 is None:
            return self.grad_shard
        g = self.grad_shard.float()
        if self.grad32 is not None:
            g[self.fp32_local] = self.grad32
        return g

    def zero_grad(self) -> None:
        self.detach_grads()
        if self.stage == 1:
            self.full_grad.zero_()
            self.full_grad32.zero_()
        else:
            self.full_grad = self.full_grad32 = None
        self.grad_shard = self.grad32 = None
        self.arrived = self.micro_batches_done = 0
        self.reduced = False

    def held_tensors(self) -> list:
        return [t for t in (self.flat, self.param_shard, self.full_grad, self.full_grad32, self.grad_shard,
                            self.grad32, self.grad_buffer, self.grad32_buffer) if t is not None]
