"""Sharded data parallelism (ZeRO stages 1, 2, 3 = FSDP), hand-written on `parallel.comm`.

`ShardedDataParallel` cuts every model chunk into the units of `parallel.fsdp_units` (one flat buffer per
transformer block, split into equal shards over the DP group) and owns their hooks and their gradient
reduction. DP rank r keeps shard r of every unit: the fp32 master weights and Adam moments (stage ≥ 1,
engine/optim/zero.py), the reduced gradients (stage ≥ 2) and the parameters themselves (stage 3).

Stage 3 frees a unit's flat buffer (its storage is resized to 0; the parameter views keep their shapes
and attributes) and all-gathers it just before the unit's forward and again before its backward, from
forward pre-hooks and gradient hooks on the unit's output, prefetching the next unit meanwhile (issued
before waiting on the current unit's own gather when that one is already in flight). The unit that runs
last in a chunk's forward (final norm + LM head, or the tied embedding unit) stays gathered for its
backward when `keep_last` is set (FSDP2's reshard_after_forward=False on the root): one all-gather per
micro-batch fewer per chunk, for one more unit held between forward and backward. The embedding unit is
not gathered for backward at all (its backward does not read the weight). A unit's
gradients are reduce-scattered as soon as all its parameters' gradients are accumulated
(`register_post_accumulate_grad_hook`), asynchronously, so communication overlaps backward; so are the later
stages of hierarchical reduction and HSDP's all-reduce across replicas, each reduction advanced by one stage
whenever another unit's starts (parallel/staged_reduction.py). At stages 1 and 3
backward accumulates straight into the units' full-gradient buffers: each `.grad` is a view of its slice
(`Unit.attach_grads`: stage 1 for the whole step, stage 3 from the unit's `_pre_backward`), the linear layers
add inside their matmul (kernels/grad_accumulation.py), and a pipeline stage may queue those until its
input gradient is sent (counted when the queue adds them).
The untied input embedding may be looked up by rows instead of gathered (parallel/embedding_shards.py). Stages 2 and
3 reduce every micro-batch into a gradient shard; stage 1 keeps full gradients and reduces on the last.
Full gradients and reduction outputs come from a BufferPool, so steady-state steps allocate none.
"""
from __future__ import annotations

import collections

import torch

from kernels import grad_accumulation
from parallel import comm
from parallel.embedding_shards import ShardedEmbeddingLookup, lookup_worth_it
from parallel.fsdp_units import BufferPool, ShardRange, Unit, unit_plan
from parallel.stage_layers import sum_tied_gradients, tied_embedding_weights
from parallel.staged_reduction import StagedReduction
from parallel.weak_hooks import weak_method


def hierarchical_reduce_scatter(out: torch.Tensor, flat: torch.Tensor, intra, inter) -> list:
    """The two stages of a reduce-scatter inside the node group, then across (for a StagedReduction), rank r
    of the whole DP group still receiving chunk r: the chunks are first reordered so that node-group member i
    collects chunks i, i+k, ..."""
    k, m = comm.group_size(intra), comm.group_size(inter)
    staged = flat.view(m, k, -1).transpose(0, 1).contiguous().view(-1)
    part = torch.empty(flat.numel() // k, dtype=flat.dtype, device=flat.device)
    return [lambda: comm.reduce_scatter_into(part, staged, intra, async_op=True),
            lambda: comm.reduce_scatter_into(out, part, inter, async_op=True)]


class ShardedDataParallel:
    """Owns the units of every chunk, their hooks and their gradient reduction."""

    def __init__(self, chunks: list, stage: int, dp_group, dp_size: int, tp,
                 compute_dtype: torch.dtype, fp32_names=(), unit_groups=None, hsdp=None, hierarchy=None,
                 tied_group=None, keep_last: bool = False, lookup_tokens: int = 0):
        if stage not in (1, 2, 3):
            raise ValueError(f"ShardedDataParallel needs zero_stage 1, 2 or 3, got {stage}")
        self.stage, self.tp, self.dp_size = stage, tp, dp_size
        self.hierarchy, self.tied_group, self.keep_last = hierarchy, tied_group, keep_last
        self.pool = BufferPool()
        # HSDP: shard inside the group of k ranks, all-reduce the shards across the replicas
        self.shard_group, self.replicate_group = hsdp if hsdp else (dp_group, None)
        shard_size, shard_rank = comm.group_size(self.shard_group), comm.group_rank(self.shard_group)
        self.units: list[Unit] = []
        self.chunk_units: list[list[Unit]] = []
        self.pending: collections.deque = collections.deque()
        self.num_micro_batches = 1
        self.peak_gathered_bytes = 0
        tied = tied_embedding_weights(chunks) if tied_group is not None else []
        self.row_lookups: list[ShardedEmbeddingLookup] = []
        self.fusing = False  # stages 1 and 3, inside a step: backward accumulates into the full gradient buffers
        # called with each unit whose reduced gradient shard is complete for the step (the TP sum of
        # TP-replicated gradients aside): engine/optim/offload_overlap.py starts its host step
        self.on_reduced = None
        self.unwritten: dict = {}  # unit index → its write-back in flight (write_shards)
        for chunk in chunks:
            names = {p: n for n, p in chunk.named_parameters()}
            mine, seen = [], set()
            plans = unit_plan(chunk)
            final_exit = chunk if any(m is chunk for p in plans for m in p["exits"]) else plans[-1]["exits"][-1]
            for plan in plans:
                named = [(names[p], p) for m in plan["modules"] for p in m.parameters() if p not in seen]
                seen.update(p for _, p in named)
                i = len(self.units)
                group = unit_groups[i] if unit_groups else self.shard_group
                unit = Unit(i, named, stage, group, shard_size, shard_rank, compute_dtype, fp32_names)
                unit.tied = [p for _, p in named if any(p is t for t in tied)]
                unit.backward_reads_params = plan.get("backward_reads_params", True)
                self._maybe_look_up_rows(unit, plan, lookup_tokens)
                self.units.append(unit)
                mine.append(unit)
                self._install_hooks(unit, plan, mine, final_exit)
            missing = [n for p, n in names.items() if p not in seen]
            if missing:
                raise ValueError(f"parameters {missing} belong to no sharding unit; extend parallel/fsdp_units.unit_plan")
            self.chunk_units.append(mine)

    def _maybe_look_up_rows(self, unit: Unit, plan: dict, tokens: int) -> None:
        """Stage 3's untied input embedding, when `tokens` per micro-batch make looking it up by rows the smaller
        exchange (parallel/embedding_shards.py); not under HSDP or hierarchical reduction."""
        table = plan["modules"][0]
        if not (tokens and self.stage == 3 and plan.get("backward_reads_params", True) is False
                and self.replicate_group is None and self.hierarchy is None and unit.fp32_numel == 0
                and getattr(table, "row_lookup", False) is None  # a VocabParallelEmbedding, not yet set up
                and unit.params == [table.weight]
                and comm.group_size(unit.group) > 1):
            return
        rows, width = table.weight.shape
        if lookup_worth_it(rows, width, table.weight.element_size(), comm.group_size(unit.group), tokens):
            table.row_lookup = ShardedEmbeddingLookup(unit, self._take_rows)
            unit.row_lookup = table.row_lookup
            self.row_lookups.append(table.row_lookup)

    def _take_rows(self, unit: Unit, shard_grad: torch.Tensor) -> None:
        """A micro-batch's reduced gradient of a unit looked up by rows, added in as a reduce-scatter's."""
        out = unit.reduce_target(self.pool)
        out[:shard_grad.numel()].copy_(shard_grad)
        out[shard_grad.numel():].zero_()
        unit.reduced = True
        unit.micro_batches_done += 1
        unit.take_reduced(out, None)
        if out is not unit.grad_buffer:
            self.pool.give(out)

    # -- hooks ---------------------------------------------------------------------------------------
    def _install_hooks(self, unit: Unit, plan: dict, chunk_units: list, final_exit) -> None:
        on_grad = weak_method(self._on_unit_grad)  # by index: a unit holds its group and parameters
        for p in unit.params:
            p.register_post_accumulate_grad_hook(lambda param, i=unit.index: on_grad(i, param))
            # when a pipeline's WeightGradQueue completes its gradient after the hook ran
            p.on_deferred_grad = lambda param, i=unit.index: on_grad(i, param)
        if self.stage != 3:
            return
        position = len(chunk_units) - 1
        for k, module in enumerate(plan["entries"]):
            module.register_forward_pre_hook(lambda m, args, u=unit, first=k == 0, i=position, units=chunk_units:
                                             self._pre_forward(u, units, i, first, m))
        for module in plan["exits"]:
            module.register_forward_hook(lambda m, args, out, u=unit, i=position, units=chunk_units,
                                         last=module is final_exit: self._post_forward(u, units, i, out, last))

    def _gather(self, unit: Unit, async_op: bool = False) -> None:
        self.wait_written(unit)
        unit.gather(async_op)
        held = sum(u.full_bytes for u in self.units if u.gathered or u.gather_handle is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)

    @staticmethod
    def _recomputing(unit: Unit) -> bool:
        """A forward that runs inside backward: activation recomputation (checkpointing)."""
        return unit.in_backward or torch._C._current_graph_task_id() != -1

    def _gather_and_prefetch(self, unit: Unit, following: Unit | None) -> None:
        """Gather `unit` and start gathering `following`. A gather already in flight (prefetched) is ahead in
        the queue, so the next one is issued before waiting on it; an unissued one goes first alone, its
        wait being on the critical path either way."""
        if following is not None and unit.gather_handle is not None:
            self._gather(following, async_op=True)
        self._gather(unit)
        if following is not None:
            self._gather(following, async_op=True)

    def _pre_forward(self, unit: Unit, units: list, i: int, first: bool, module) -> None:
        prefetch = first and i + 1 < len(units) and not self._recomputing(unit)
        following = units[i + 1] if prefetch else None
        if unit.row_lookup is not None and unit.row_lookup.applies(module):  # nothing to gather
            self.wait_written(unit)  # the lookup reads the shard
            if following is not None:
                self._gather(following, async_op=True)
            return
        self._gather_and_prefetch(unit, following)

    def _post_forward(self, unit: Unit, units: list, i: int, out, last: bool) -> None:
        if self._recomputing(unit):  # the backward about to run still needs the unit
            return
        backward_follows = torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad
        if not (last and self.keep_last and backward_follows):  # kept: freed when its gradients are done
            unit.free()
        if backward_follows and unit.backward_reads_params:
            out.register_hook(lambda grad: self._pre_backward(unit, units, i, last))

    def _pre_backward(self, unit: Unit, units: list, i: int, last: bool) -> None:
        unit.in_backward = True
        if last and i == 0:  # the tied embedding unit at the chunk's end: the last block's backward is next
            following = units[-1] if units[-1] is not unit else None
        else:
            following = units[i - 1] if i > 0 else None
        if following is not None and not following.backward_reads_params:
            following = None
        self._gather_and_prefetch(unit, following)
        if self.fusing:  # stage 3
            unit.borrow_full_grad(self.pool)
            unit.attach_grads()

    def _on_unit_grad(self, index: int, param: torch.Tensor) -> None:
        self._on_grad(self.units[index], param)

    def _on_grad(self, unit: Unit, param: torch.Tensor) -> None:
        if param.grad is None and unit.row_lookup is not None:  # its lookup reduced it (_take_rows)
            return
        if grad_accumulation.is_pending(param):  # counted when the queue adds it
            return
        unit.borrow_full_grad(self.pool)
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
            self._reduce(unit, final=unit.micro_batches_done == self.num_micro_batches)

    # -- gradient reduction --------------------------------------------------------------------------
    def _reduce(self, unit: Unit, final: bool) -> None:
        """Start reducing `unit`'s gradients (`final`: the step's last reduction of it)."""
        out = unit.reduce_target(self.pool)
        unit.reduced = True
        full = unit.full_grad.div_(self.dp_size)
        out32 = None
        send32 = unit.fp32_send_buffer(self.pool).div_(self.dp_size) if unit.fp32_numel else None
        if send32 is not None:
            out32 = self.pool.take(unit.fp32_width, torch.float32, full.device)
        for _, _, _, in_flight, *_ in self.pending:  # the same order on every rank: the order of the reductions
            for staged in in_flight:
                staged.advance()
        reductions = [StagedReduction(self._stages(unit.group, target, source), full.device)
                      for target, source in ((out, full), (out32, send32)) if source is not None]
        full32 = None
        if self.stage >= 2:  # the pending item keeps the inputs until the collective is done, then pools them
            full32, unit.full_grad, unit.full_grad32 = unit.full_grad32, None, None
        else:
            full = None  # stage 1 keeps its own full gradient buffers
        self.pending.append((unit, out, out32, reductions, full, full32, send32, final))
        while len(self.pending) > 2:  # bound the memory held by in-flight reductions
            self._complete(self.pending.popleft())

    def _stages(self, group, out: torch.Tensor, full: torch.Tensor) -> list:
        """The collectives that reduce `full` into this rank's shard `out`: one reduce-scatter over `group` (the
        unit's), or two under hierarchical reduction; HSDP then all-reduces the shard across the replicas."""
        if self.hierarchy:
            return hierarchical_reduce_scatter(out, full, *self.hierarchy)
        stages = [lambda: comm.reduce_scatter_into(out, full, group, async_op=True)]
        if self.replicate_group is not None:
            stages.append(lambda: comm.all_reduce(out, self.replicate_group, async_op=True))
        return stages

    def _complete(self, item) -> None:
        unit, out, out32, reductions, full, full32, send32, final = item
        for staged in reductions:
            staged.wait()
        unit.take_reduced(out, out32)
        self.pool.give(full, full32, send32, out32, None if out is unit.grad_buffer else out)
        if final and self.on_reduced is not None:
            self.on_reduced(unit)

    def start_step(self, num_micro_batches: int) -> None:
        """Declare the step's backward passes. Until finish_gradients, stages 1 and 3 have backward accumulate
        into the units' full gradient buffers in place (`Unit.attach_grads`): stage 1 into its own buffers,
        attached here for the whole step, stage 3 into each micro-batch's, attached as a unit's backward begins."""
        self.num_micro_batches = num_micro_batches
        self._fuse_accumulation(self.stage in (1, 3))
        if self.stage == 1:
            for unit in self.units:
                unit.attach_grads()

    def _fuse_accumulation(self, on: bool) -> None:
        self.fusing = on
        for unit in self.units:
            for p in unit.params:
                p.fuse_grad_accumulation = on
        for lookup in self.row_lookups:
            lookup.active = on

    def finish_gradients(self) -> None:
        """Reduce what backward did not (parameters without gradients), wait for every reduction, then sum
        the gradient shards of TP-replicated-gradient parameters over the TP group."""
        self._fuse_accumulation(False)
        for unit in self.units:
            unit.detach_grads()
        tied = [unit for unit in self.units if unit.tied]
        for unit in tied:
            unit.borrow_full_grad(self.pool)
        # full gradients, so the two ends' different unit layouts do not matter
        sum_tied_gradients([unit.full_grad_view(p) for unit in tied for p in unit.tied], self.tied_group)
        for unit in self.units:
            if unit.tied or not unit.reduced:
                unit.borrow_full_grad(self.pool)
                self._reduce(unit, final=True)
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
    def write_shards(self, masters: list, write_backs: dict | None = None) -> None:
        """New fp32 master shards → this rank's parameter shards; stages 1/2 all-gather the full buffers.
        `write_backs` (unit index → the optimizer's host-to-device copy, engine/optim/offload.WriteBack) carry the
        host-held masters' shards, all issued first; each is waited for (a stream wait) just before its shard is
        read: its all-gather here at stages 1/2, its unit's next gather (or row lookup) at stage 3."""
        write_backs = write_backs or {}
        for unit, master in zip(self.units, masters):
            unit.free()  # stage 3: a gathered copy would hold the old values
            if unit.index in write_backs:
                write_backs[unit.index].send(unit.param_shard, master)
                self.unwritten[unit.index] = write_backs[unit.index]
            elif master is not unit.param_shard:
                unit.param_shard.copy_(master)
        if self.stage == 3:
            return
        handles = []
        for unit in self.units:
            self.wait_written(unit)
            handles.append(comm.all_gather_into(unit.flat, unit.param_shard.clone(), unit.group, async_op=True))
        for h in handles:
            if h is not None:
                h.wait()

    def wait_written(self, unit: Unit) -> None:
        """Before `unit`'s parameter shard is read: its write-back, if one is in flight, is waited for."""
        write_back = self.unwritten.pop(unit.index, None)
        if write_back is not None:
            write_back.wait()

    def wait_writes(self) -> None:
        for unit in self.units:
            self.wait_written(unit)

    def held_tensors(self) -> list:
        return [t for u in self.units for t in u.held_tensors()]
