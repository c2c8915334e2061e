"""Bucketed data parallelism for replicated parameters (zero_stage 0), hand-written on `parallel.comm`.

Gradients live in persistent contiguous buckets of about `bucket_mb` megabytes, as in Megatron's
parameter-and-gradient buffer: each bucket owns one flat buffer, and each parameter's `.grad` is a view into
it, set once at construction. Autograd accumulates into an existing `.grad` in place, so backward writes
straight into the buckets, the all-reduce runs on the buffer itself, and a step allocates and copies no
gradient memory. `zero_grad()` zeroes each buffer (one kernel per bucket) instead of dropping the gradients.
Between start_step and finish_gradients the linear and embedding layers add their weight gradients into the
buckets themselves, inside the matmul (kernels/grad_accumulation.py), instead of returning a new tensor
for autograd to add; a pipeline stage may queue some of them until after it sent its input gradient, and
those parameters count as ready when the queue has added them.

Each parameter's `register_post_accumulate_grad_hook` counts its backward passes in the step; on the last
micro-batch it marks itself ready, and a bucket whose parameters are all ready is divided by the group size
and its all-reduce launched asynchronously at once, so communication overlaps the rest of backward. Earlier
micro-batches only accumulate locally (no communication). `finish_gradients()` waits for the buckets and
sums the gradients of TP-replicated-gradient parameters over TP, in fp32.

Under bf16/fp16, parameters whose name matches `fp32_names` (norm weights by default) go into fp32 buckets,
so their sum over ranks is taken in fp32. Their low-precision `.grad` cannot be a view of an fp32 buffer:
those (few, small) gradients are copied in at launch and back after the reduction.
The untied input embedding leaves the buckets when exchanging the rows a step read is the cheaper exchange
(parallel/embedding_rows.py). With `hierarchy=(intra, inter)` an all-reduce becomes reduce-scatter inside the
node group, all-reduce across nodes, all-gather inside the node group (NCCL grouping), each stage issued
asynchronously once the one before is done: every bucket launch advances the buckets in flight by one stage
(parallel/staged_reduction.py), and finish_gradients issues what is left.
"""
from __future__ import annotations

import torch

from kernels import grad_accumulation
from parallel import comm
from parallel.embedding_rows import EmbeddingRows, rows_worth_it
from parallel.stage_layers import sum_tied_gradients, tied_embedding_weights
from parallel.staged_reduction import StagedReduction
from parallel.tensor import TensorParallel, allreduce_replicated_grads
from parallel.weak_hooks import weak_method


def reduces_in_fp32(name: str, fp32_names) -> bool:
    return "norm" in name or any(s in name for s in fp32_names)


def hierarchical_all_reduce(flat: torch.Tensor, intra, inter) -> StagedReduction:
    """Sum `flat` (numel divisible by the intra size) over intra × inter groups, in three stages, the first
    issued now; `flat` holds the sum once the returned reduction's wait() returns."""
    part = torch.empty(flat.numel() // comm.group_size(intra), dtype=flat.dtype, device=flat.device)
    return StagedReduction([lambda: comm.reduce_scatter_into(part, flat, intra, async_op=True),
                            lambda: comm.all_reduce(part, inter, async_op=True),
                            lambda: comm.all_gather_into(flat, part, intra, async_op=True)], flat.device)


class _Bucket:
    """One contiguous gradient buffer and, per parameter, the view of it shaped like the parameter. When every
    parameter has the buffer's dtype (`in_place`) the views are the parameters' `.grad`; otherwise the
    gradients are copied through the buffer around the reduction."""

    def __init__(self, params: list, dtype: torch.dtype, pad_to: int, in_place: bool):
        self.params, self.dtype, self.in_place = params, dtype, in_place
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(-(-numel // pad_to) * pad_to, dtype=dtype, device=params[0].device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = 0
        self.launched = False
        self.handle = None

    def attach(self) -> None:
        """Point every `.grad` at its view (keeping a gradient already accumulated)."""
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view


class BucketedDDP:
    def __init__(self, named_params: list, dp_group, tp: TensorParallel, chunks: list, bucket_mb: float = 25.0,
                 fp32_names=(), hierarchy=None, tied_group=None, row_exchange_tokens: int = 0):
        self.dp_group, self.tp, self.chunks, self.hierarchy = dp_group, tp, chunks, hierarchy
        self.named_params = named_params
        self.tied_group = tied_group
        self.tied = tied_embedding_weights(chunks) if tied_group is not None else []
        self.dp_size = comm.group_size(dp_group)
        self.num_micro_batches = 1
        self.launched_in_backward = 0
        self.staged: list[StagedReduction] = []  # hierarchical reductions with stages not yet issued, oldest first
        # called with an in-place bucket's parameters once its reduction is waited for (then their `.grad` is the
        # DP average; TP and tied sums still follow in finish_gradients): engine/optim/offload_overlap.py starts
        # their host step. While set, launching a bucket waits for the one launched before it.
        self.on_reduced = None
        self.in_flight: list[_Bucket] = []
        pad_to = comm.group_size(hierarchy[0]) if hierarchy else 1
        self.embedding_rows = self._row_exchange(chunks, fp32_names, row_exchange_tokens) \
            if row_exchange_tokens and self.dp_size > 1 and hierarchy is None else None
        skip = self.embedding_rows.weight if self.embedding_rows else None
        # Backward produces gradients roughly in reverse order of definition: fill buckets that way.
        ordered = [(n, p) for n, p in reversed(named_params) if p.requires_grad and p is not skip]
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict = {}
        self.own_grads: list = []  # low-precision parameters of fp32 buckets when there is nothing to reduce
        limit = bucket_mb * 2**20
        for fp32 in (False, True):  # an fp32 parameter needs no separate fp32 bucket: one collective fewer
            members = [p for n, p in ordered
                       if (reduces_in_fp32(n, fp32_names) and p.dtype != torch.float32) == fp32]
            current, size = [], 0
            for p in members:
                dtype = torch.float32 if fp32 else p.dtype
                current.append(p)
                size += p.numel() * torch.tensor([], dtype=dtype).element_size()
                if size >= limit:
                    self._add_bucket(current, dtype, pad_to)
                    current, size = [], 0
            if current:
                self._add_bucket(current, torch.float32 if fp32 else current[0].dtype, pad_to)
        self.calls = {p: 0 for b in self.buckets for p in b.params}
        # parameters whose `.grad` is persistent storage of this object: the layers may add into it themselves
        self.persistent_grads = [p for b in self.buckets if b.in_place for p in b.params] + \
            ([self.embedding_rows.weight] if self.embedding_rows else [])
        if self.dp_size > 1:
            on_grad = weak_method(self._on_grad)
            for p in self.calls:
                p.register_post_accumulate_grad_hook(on_grad)
                p.on_deferred_grad = on_grad  # when a WeightGradQueue completes its gradient later

    def _row_exchange(self, chunks: list, fp32_names, tokens: int) -> EmbeddingRows | None:
        """The untied input embedding of this rank's first chunk, its gradient exchanged by rows
        (parallel/embedding_rows.py) when `tokens` per step and rank make that the cheaper exchange; None
        where there is none, it is not cheaper or its gradient is reduced in fp32."""
        for chunk in chunks:
            table = chunk.model.embed_tokens if chunk.pre_process else None
            if table is None or chunk.cfg.tie_embeddings or not table.weight.requires_grad:
                continue
            name = next(n for n, p in self.named_params if p is table.weight)
            if (table.weight.dtype != torch.float32 and reduces_in_fp32(name, fp32_names)) or \
                    not rows_worth_it(table.weight, self.dp_size, tokens):
                return None
            return EmbeddingRows(table, self.dp_group, self.dp_size)
        return None

    def _add_bucket(self, params, dtype, pad_to) -> None:
        in_place = all(p.dtype == dtype for p in params)
        if not in_place and self.dp_size == 1:  # nothing to reduce: no fp32 buffer is needed
            self.own_grads += params
            return
        bucket = _Bucket(list(params), dtype, pad_to, in_place)
        if in_place:
            bucket.attach()
        self.buckets.append(bucket)
        for p in params:
            self.bucket_of[p] = bucket

    def start_step(self, num_micro_batches: int) -> None:
        """Declare how many backward passes this step has; only the last one communicates. Until
        finish_gradients the layers add their weight gradients into the buckets themselves
        (kernels/grad_accumulation.py)."""
        self.num_micro_batches = num_micro_batches
        self.launched_in_backward = 0
        for p in self.calls:
            self.calls[p] = 0
        self._fuse_accumulation(True)

    def _fuse_accumulation(self, on: bool) -> None:
        for p in self.persistent_grads:
            p.fuse_grad_accumulation = on

    def zero_grad(self) -> None:
        """Zero every bucket in place (the views stay the `.grad`s); copied gradients are dropped as usual."""
        for bucket in self.buckets:
            if bucket.in_place:
                bucket.buffer.zero_()
                bucket.attach()  # in case something replaced a `.grad` since the last step
            else:
                for p in bucket.params:
                    p.grad = None
        for p in self.own_grads:
            p.grad = None
        if self.embedding_rows:
            self.embedding_rows.zero_grad()

    def _on_grad(self, param: torch.Tensor) -> None:
        if grad_accumulation.is_pending(param):  # counted when the queue adds it
            return
        self.calls[param] += 1
        if self.calls[param] != self.num_micro_batches:
            return
        bucket = self.bucket_of[param]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)
            self.launched_in_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        if not bucket.in_place:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
        bucket.buffer.div_(self.dp_size)
        bucket.launched = True
        if self.hierarchy:
            for staged in self.staged:  # the same order on every rank: launch order
                staged.advance()
            bucket.handle = hierarchical_all_reduce(bucket.buffer, *self.hierarchy)
            self.staged = [r for r in self.staged if r.stages_left] + [bucket.handle]
        else:
            bucket.handle = comm.all_reduce(bucket.buffer, self.dp_group, async_op=True)
            if self.on_reduced is not None:
                for earlier in self.in_flight:
                    self._wait_and_tell(earlier)
                self.in_flight = [bucket]

    def _wait_and_tell(self, bucket: _Bucket) -> None:
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
        if self.on_reduced is not None and bucket.in_place and bucket.launched:
            self.on_reduced(bucket.params)

    def finish_gradients(self) -> None:
        """Wait for every bucket (the averages are then in `.grad`), then sum TP-partial gradients over TP:
        those of an fp32 bucket (SP norm weights under bf16) while still in fp32, so they are rounded once."""
        self._fuse_accumulation(False)
        summed = set()
        if self.dp_size > 1:
            for bucket in self.buckets:
                if not bucket.launched:  # a parameter that received no gradient this step
                    self._launch(bucket)
                if self.hierarchy and bucket.handle is not None:
                    bucket.handle.wait()
                elif bucket.handle is not None:
                    self._wait_and_tell(bucket)
                if not bucket.in_place:
                    partial = [(p, view) for p, view in zip(bucket.params, bucket.views)
                               if getattr(p, "tp_replicated_grad", False)]
                    if partial and self.tp.size > 1:
                        comm.all_reduce_flat([view for _, view in partial], self.tp.group)
                        summed.update(id(p) for p, _ in partial)
                    for p, view in zip(bucket.params, bucket.views):
                        if p.grad is None:
                            p.grad = view.to(p.dtype)
                        else:
                            p.grad.copy_(view)
                bucket.launched, bucket.handle, bucket.ready = False, None, 0
            self.staged, self.in_flight = [], []
            if self.embedding_rows:
                self.embedding_rows.reduce()
        for chunk in self.chunks:
            allreduce_replicated_grads(chunk, self.tp, frozenset(summed))
        sum_tied_gradients([p.grad for p in self.tied], self.tied_group)  # the embedding and its output-layer copy

    def owned_gradients(self):
        """(name, parameter, 0, flat reduced gradient) after finish_gradients, from DP rank 0 only: the
        gradients are replicated, and each element must be counted once over the DP group."""
        if comm.group_rank(self.dp_group) != 0:
            return
        for name, p in self.named_params:
            if p.grad is not None:
                yield name, p, 0, p.grad.reshape(-1)

    def grad_bytes(self) -> int:
        params = [*self.calls, *self.own_grads, *([self.embedding_rows.weight] if self.embedding_rows else [])]
        return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
