"""Sharded data parallelism (ZeRO stages 1, 2, 3 = FSDP), hand-written on `parallel.comm`.

The sharding unit is one transformer block, plus one unit for the embedding and one for the final norm and
LM head (one unit for embedding + norm when the output layer is the tied embedding on this chunk). A unit
owns one flat buffer of its parameters (each parameter is a view into it) and, on request, its own DP
process group. Its flat index space, padded to a multiple of the shard-group size N, is split into N
equal contiguous shards; DP rank r owns shard r of every unit: the fp32 master weights and Adam moments
(stage ≥ 1), the reduced gradients (stage ≥ 2) and the parameters themselves (stage 3).

Stage 3 frees a unit's flat buffer (its storage is resized to 0; the parameter views keep their shapes
and attributes) and all-gathers it just before the unit's forward and again before its backward, from
forward pre-hooks and gradient hooks on the unit's output, prefetching the next unit meanwhile. A unit's
gradients are reduce-scattered as soon as all its parameters' gradients are accumulated
(`register_post_accumulate_grad_hook`), asynchronously, so communication overlaps backward. Stages 2 and
3 reduce every micro-batch into a gradient shard; stage 1 keeps full gradients and reduces on the last.

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
from parallel.stage_layers import tied_embedding_weights


def unit_plan(chunk) -> list[dict]:
    """The units of one model chunk in forward order: their modules, and where they are entered and left."""
    bb = chunk.model
    tied_here = chunk.post_process and chunk.lm_head is None
    plan = []
    if bb.embed_tokens is not None:
        if tied_here:  # the output layer reuses the embedding: one unit used at both ends of the chunk
            plan.append(dict(modules=[bb.embed_tokens, bb.norm], entries=[bb.embed_tokens, bb.norm],
                             exits=[bb.embed_tokens, chunk]))
        else:
            plan.append(dict(modules=[bb.embed_tokens], entries=[bb.embed_tokens], exits=[bb.embed_tokens]))
    for layer in bb.layers.values():
        plan.append(dict(modules=[layer], entries=[layer], exits=[layer]))
    if chunk.post_process and not tied_here:
        plan.append(dict(modules=[m for m in (bb.norm, chunk.lm_head) if m is not None], entries=[bb.norm],
                         exits=[chunk]))
    return plan


def hierarchical_reduce_scatter(out: torch.Tensor, flat: torch.Tensor, intra, inter) -> None:
    """Reduce-scatter in two stages (inside the node group, then across), rank r of the whole DP group still
    receiving chunk r: the chunks are first reordered so that node-group member i collects chunks i, i+k, ..."""
    k, m = comm.group_size(intra), comm.group_size(inter)
    staged = flat.view(m, k, -1).transpose(0, 1).contiguous().view(-1)
    part = torch.empty(flat.numel() // k, dtype=flat.dtype, device=flat.device)
    comm.reduce_scatter_into(part, staged, intra)
    comm.reduce_scatter_into(out, part, inter)


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
        # gradients: stage 1 keeps full ones (persistent buffers); stages 2/3 keep only reduced shards
        self.full_grad = self.full_grad32 = None
        if stage == 1:
            self.full_grad = torch.zeros(self.padded, dtype=compute_dtype, device=device)
            self.full_grad32 = torch.zeros(self.fp32_numel, dtype=torch.float32, device=device)
        self.grad_shard = self.grad32 = None
        self.arrived = 0
        self.micro_batches_done = 0
        self.reduced = False  # reduced at least once this step
        self.tied: list = []  # parameters summed over the pipeline's embedding group before reduction
        self.in_backward = False  # between its pre-backward gather and its last gradient

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
    def add_grad(self, p: torch.Tensor) -> None:
        """Move `p.grad` into this unit's gradient buffers (the parameter's own gradient is released)."""
        if self.full_grad is None:
            self.full_grad = torch.zeros(self.padded, dtype=self.flat.dtype, device=p.grad.device)
            self.full_grad32 = torch.zeros(self.fp32_numel, dtype=torch.float32, device=p.grad.device)
        self.full_grad_view(p).add_(p.grad.reshape(-1))
        p.grad = None

    def full_grad_view(self, p: torch.Tensor) -> torch.Tensor:
        o = self.offsets[p]
        if o >= self.fp32_start:
            return self.full_grad32[o - self.fp32_start:o - self.fp32_start + p.numel()]
        return self.full_grad[o:o + p.numel()]

    def fp32_send_buffer(self) -> torch.Tensor:
        """The fp32 segment as N equal chunks (chunk r = the part inside rank r's shard, zero-padded)."""
        out = torch.zeros(self.shard_size, self.fp32_width, dtype=torch.float32, device=self.full_grad32.device)
        for r, (start, count) in enumerate(self.fp32_parts):
            out[r, :count] = self.full_grad32[start:start + count]
        return out.view(-1)

    def take_reduced(self, out: torch.Tensor, out32: torch.Tensor | None) -> None:
        count = self.fp32_local.stop - self.fp32_local.start
        if self.stage == 1:
            self.grad_shard = self.full_grad[self.shard_start:self.shard_start + self.shard_numel]
            self.grad_shard.copy_(out)
            self.grad32 = out32[:count].clone() if out32 is not None else None
            return
        if self.grad_shard is None:
            self.grad_shard = out
            self.grad32 = out32[:count].clone() if out32 is not None else None
        else:
            self.grad_shard.add_(out)
            if out32 is not None:
                self.grad32.add_(out32[:count])

    def master_grad(self) -> torch.Tensor:
        """This rank's reduced gradient shard in fp32 (zeros when no gradient arrived)."""
        if self.grad_shard is None:
            return torch.zeros(self.shard_numel, dtype=torch.float32, device=self.param_shard.device)
        g = self.grad_shard.float()
        if self.grad32 is not None:
            g[self.fp32_local] = self.grad32
        return g

    def zero_grad(self) -> None:
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
                            self.grad32) if t is not None]


class ShardedDataParallel:
    """Owns the units of every chunk, their hooks and their gradient reduction."""

    def __init__(self, chunks: list, stage: int, dp_group, dp_size: int, tp,
                 compute_dtype: torch.dtype, fp32_names=(), unit_groups=None, hsdp=None, hierarchy=None,
                 tied_group=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"ShardedDataParallel needs zero_stage 1, 2 or 3, got {stage}")
        self.stage, self.tp, self.dp_size = stage, tp, dp_size
        self.hierarchy, self.tied_group = hierarchy, tied_group
        # HSDP: shard inside the group of k ranks, all-reduce the shards across the replicas
        self.shard_group, self.replicate_group = hsdp if hsdp else (dp_group, None)
        shard_size, shard_rank = comm.group_size(self.shard_group), comm.group_rank(self.shard_group)
        self.units: list[Unit] = []
        self.chunk_units: list[list[Unit]] = []
        self.pending: collections.deque = collections.deque()
        self.num_micro_batches = 1
        self.peak_gathered_bytes = 0
        tied = tied_embedding_weights(chunks) if tied_group is not None else []
        for chunk in chunks:
            names = {p: n for n, p in chunk.named_parameters()}
            mine, seen = [], set()
            for plan in unit_plan(chunk):
                named = [(names[p], p) for m in plan["modules"] for p in m.parameters() if p not in seen]
                seen.update(p for _, p in named)
                i = len(self.units)
                group = unit_groups[i] if unit_groups else self.shard_group
                unit = Unit(i, named, stage, group, shard_size, shard_rank, compute_dtype, fp32_names)
                unit.tied = [p for _, p in named if any(p is t for t in tied)]
                self.units.append(unit)
                mine.append(unit)
                self._install_hooks(unit, plan, mine)
            missing = [n for p, n in names.items() if p not in seen]
            if missing:
                raise ValueError(f"parameters {missing} belong to no sharding unit; extend parallel/fsdp.unit_plan")
            self.chunk_units.append(mine)

    # -- hooks ---------------------------------------------------------------------------------------
    def _install_hooks(self, unit: Unit, plan: dict, chunk_units: list) -> None:
        for p in unit.params:
            p.register_post_accumulate_grad_hook(lambda param, u=unit: self._on_grad(u, param))
        if self.stage != 3:
            return
        position = len(chunk_units) - 1
        for k, module in enumerate(plan["entries"]):
            module.register_forward_pre_hook(lambda m, args, u=unit, first=k == 0, i=position, units=chunk_units:
                                             self._pre_forward(u, units, i, first))
        for module in plan["exits"]:
            module.register_forward_hook(lambda m, args, out, u=unit, i=position, units=chunk_units:
                                         self._post_forward(u, units, i, out))

    def _gather(self, unit: Unit, async_op: bool = False) -> None:
        unit.gather(async_op)
        held = sum(u.full_bytes for u in self.units if u.gathered or u.gather_handle is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)

    @staticmethod
    def _recomputing(unit: Unit) -> bool:
        """A forward that runs inside backward: activation recomputation (checkpointing)."""
        return unit.in_backward or torch._C._current_graph_task_id() != -1

    def _pre_forward(self, unit: Unit, units: list, i: int, first: bool) -> None:
        self._gather(unit)
        if first and i + 1 < len(units) and not self._recomputing(unit):
            self._gather(units[i + 1], async_op=True)

    def _post_forward(self, unit: Unit, units: list, i: int, out) -> None:
        if self._recomputing(unit):  # the backward about to run still needs the unit
            return
        unit.free()
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._pre_backward(unit, units, i))

    def _pre_backward(self, unit: Unit, units: list, i: int) -> None:
        unit.in_backward = True
        self._gather(unit)
        if i > 0:
            self._gather(units[i - 1], async_op=True)

    def _on_grad(self, unit: Unit, param: torch.Tensor) -> None:
        unit.add_grad(param)
        unit.arrived += 1
        if unit.arrived < len(unit.params):
            return
        unit.arrived = 0
        unit.micro_batches_done += 1
        unit.in_backward = False
        unit.free()
        if unit.tied:  # summed with the other pipeline end first, after the whole backward (finish_gradients)
            return
        if self.stage >= 2 or unit.micro_batches_done == self.num_micro_batches:
            self._reduce(unit)

    # -- gradient reduction --------------------------------------------------------------------------
    def _reduce(self, unit: Unit) -> None:
        unit.reduced = True
        full = unit.full_grad.div_(self.dp_size)
        out = torch.empty(unit.shard_numel, dtype=full.dtype, device=full.device)
        out32 = None
        send32 = unit.fp32_send_buffer().div_(self.dp_size) if unit.fp32_numel else None
        if send32 is not None:
            out32 = torch.empty(unit.fp32_width, dtype=torch.float32, device=full.device)
        handles = []
        if self.hierarchy:
            hierarchical_reduce_scatter(out, full, *self.hierarchy)
            if send32 is not None:
                hierarchical_reduce_scatter(out32, send32, *self.hierarchy)
        else:
            handles.append(comm.reduce_scatter_into(out, full, unit.group, async_op=True))
            if send32 is not None:
                handles.append(comm.reduce_scatter_into(out32, send32, unit.group, async_op=True))
        if self.stage >= 2:
            unit.full_grad = unit.full_grad32 = None  # the pending collective keeps its input alive
        self.pending.append((unit, out, out32, [h for h in handles if h is not None], full, send32))
        while len(self.pending) > 2:  # bound the memory held by in-flight reductions
            self._complete(self.pending.popleft())

    def _complete(self, item) -> None:
        unit, out, out32, handles, _, _ = item
        for h in handles:
            h.wait()
        comm.all_reduce(out, self.replicate_group)
        if out32 is not None:
            comm.all_reduce(out32, self.replicate_group)
        unit.take_reduced(out, out32)

    def start_step(self, num_micro_batches: int) -> None:
        self.num_micro_batches = num_micro_batches

    def finish_gradients(self) -> None:
        """Reduce what backward did not (parameters without gradients), wait for every reduction, then sum
        the gradient shards of TP-replicated-gradient parameters over the TP group."""
        for unit in self.units:
            if unit.tied or not unit.reduced:
                if unit.full_grad is None:
                    unit.full_grad = torch.zeros(unit.padded, dtype=unit.flat.dtype, device=unit.flat.device)
                    unit.full_grad32 = torch.zeros(unit.fp32_numel, dtype=torch.float32, device=unit.flat.device)
                for p in unit.tied:  # full gradients, so the two ends' different unit layouts do not matter
                    comm.all_reduce(unit.full_grad_view(p), self.tied_group)
                self._reduce(unit)
        while self.pending:
            self._complete(self.pending.popleft())
        for unit in self.units:  # nothing stays gathered between steps (the optimizer changes the shards)
            if unit.gather_handle is not None:
                unit.gather()
            unit.free()
        self._sum_replicated_over_tp()

    def _sum_replicated_over_tp(self) -> None:
        if self.tp.size == 1:
            return
        pieces = [self._grad_view(unit, r) for unit in self.units for r in unit.shard_ranges
                  if getattr(r.param, "tp_replicated_grad", False)]
        comm.all_reduce_flat(pieces, self.tp.group, dtype=torch.float32)

    def owned_gradients(self):
        """(name, parameter, first flattened index, reduced gradient piece) of this rank's shards after
        finish_gradients; over the DP group each element appears once (HSDP: first replica group only)."""
        if comm.group_rank(self.replicate_group) != 0:
            return
        for unit in self.units:
            if unit.grad_shard is None:
                continue
            for r in unit.shard_ranges:
                yield r.name, r.param, r.param_start, self._grad_view(unit, r)

    @staticmethod
    def _grad_view(unit: Unit, r: ShardRange) -> torch.Tensor:
        """The reduced gradient of the range: in the fp32 segment's own buffer when it lies there."""
        fp32 = unit.fp32_local
        if unit.grad32 is not None and fp32.start <= r.shard_start < fp32.stop:
            return unit.grad32[r.shard_start - fp32.start:r.shard_end - fp32.start]
        return unit.grad_shard[r.shard_start:r.shard_end]

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.zero_grad()

    # -- parameters after an optimizer step ------------------------------------------------------
    @torch.no_grad()
    def write_shards(self, masters: list) -> None:
        """New fp32 master shards → this rank's parameter shards; stages 1/2 all-gather the full buffers."""
        handles = []
        for unit, master in zip(self.units, masters):
            unit.param_shard.copy_(master)
            if self.stage != 3:
                handles.append(comm.all_gather_into(unit.flat, unit.param_shard.clone(), unit.group, async_op=True))
        for h in handles:
            if h is not None:
                h.wait()

    def held_tensors(self) -> list:
        return [t for u in self.units for t in u.held_tensors()]
