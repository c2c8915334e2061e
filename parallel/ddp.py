"""Bucketed data parallelism for replicated parameters (zero_stage 0), hand-written on `parallel.comm`.

Gradients are averaged over the data-parallel group in buckets of about `bucket_mb` megabytes. Each
parameter's `register_post_accumulate_grad_hook` counts its backward passes in the step; on the last
micro-batch it marks itself ready, and a bucket whose parameters are all ready is flattened and its
all-reduce launched asynchronously at once, so communication overlaps the rest of backward. Earlier
micro-batches only accumulate locally (no communication). `finish_gradients()` waits for the buckets,
copies the averages back into `.grad` and sums the gradients of TP-replicated-gradient parameters over TP.

Parameters whose name matches `fp32_names` (norm weights by default) go into fp32 buckets, so their sum
over ranks is taken in fp32 even when the model computes in bf16/fp16. With `hierarchy=(intra, inter)` an
all-reduce becomes reduce-scatter inside the node group, all-reduce across nodes, all-gather inside the
node group (NCCL grouping); it then runs synchronously, stage after stage.
"""
from __future__ import annotations

import torch

from parallel import comm
from parallel.stage_layers import tied_embedding_weights
from parallel.tensor import TensorParallel, allreduce_replicated_grads


def reduces_in_fp32(name: str, fp32_names) -> bool:
    return "norm" in name or any(s in name for s in fp32_names)


def hierarchical_all_reduce(flat: torch.Tensor, intra, inter) -> None:
    """Sum `flat` (numel divisible by the intra size) over intra × inter groups, in three stages."""
    part = torch.empty(flat.numel() // comm.group_size(intra), dtype=flat.dtype, device=flat.device)
    comm.reduce_scatter_into(part, flat, intra)
    comm.all_reduce(part, inter)
    comm.all_gather_into(flat, part.clone(), intra)


class _Bucket:
    def __init__(self, params: list, dtype: torch.dtype, pad_to: int):
        self.params, self.dtype = params, dtype
        numel = sum(p.numel() for p in params)
        self.numel = -(-numel // pad_to) * pad_to
        self.ready = 0
        self.flat = self.handle = None


class BucketedDDP:
    def __init__(self, named_params: list, dp_group, tp: TensorParallel, chunks: list, bucket_mb: float = 25.0,
                 fp32_names=(), hierarchy=None, tied_group=None):
        self.dp_group, self.tp, self.chunks, self.hierarchy = dp_group, tp, chunks, hierarchy
        self.named_params = named_params
        self.tied_group = tied_group
        self.tied = tied_embedding_weights(chunks) if tied_group is not None else []
        self.dp_size = comm.group_size(dp_group)
        self.num_micro_batches = 1
        self.launched_in_backward = 0
        pad_to = comm.group_size(hierarchy[0]) if hierarchy else 1
        # Backward produces gradients roughly in reverse order of definition: fill buckets that way.
        ordered = [(n, p) for n, p in reversed(named_params) if p.requires_grad]
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict = {}
        limit = bucket_mb * 2**20
        for fp32 in (False, True):
            members = [p for n, p in ordered if reduces_in_fp32(n, fp32_names) == fp32]
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
        if self.dp_size > 1:
            for p in self.calls:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _add_bucket(self, params, dtype, pad_to) -> None:
        bucket = _Bucket(list(params), dtype, pad_to)
        self.buckets.append(bucket)
        for p in params:
            self.bucket_of[p] = bucket

    def start_step(self, num_micro_batches: int) -> None:
        """Declare how many backward passes this step has; only the last one communicates."""
        self.num_micro_batches = num_micro_batches
        self.launched_in_backward = 0
        for p in self.calls:
            self.calls[p] = 0

    def _on_grad(self, param: torch.Tensor) -> None:
        self.calls[param] += 1
        if self.calls[param] != self.num_micro_batches:
            return
        bucket = self.bucket_of[param]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)
            self.launched_in_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        flat = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.params[0].device)
        offset = 0
        for p in bucket.params:
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        flat.div_(self.dp_size)
        bucket.flat = flat
        if self.hierarchy:
            hierarchical_all_reduce(flat, *self.hierarchy)
        else:
            bucket.handle = comm.all_reduce(flat, self.dp_group, async_op=True)

    def finish_gradients(self) -> None:
        """Wait for every bucket, write the averages into `.grad`, then sum TP-partial gradients over TP."""
        if self.dp_size > 1:
            for bucket in self.buckets:
                if bucket.flat is None:  # a parameter that received no gradient this step
                    self._launch(bucket)
                if bucket.handle is not None:
                    bucket.handle.wait()
                offset = 0
                for p in bucket.params:
                    value = bucket.flat[offset:offset + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = value.to(p.dtype)
                    else:
                        p.grad.copy_(value)
                    offset += p.numel()
                bucket.flat = bucket.handle = None
                bucket.ready = 0
        for chunk in self.chunks:
            allreduce_replicated_grads(chunk, self.tp)
        for p in self.tied:  # the embedding and its output-layer copy on the last pipeline stage
            comm.all_reduce(p.grad, self.tied_group)

    def owned_gradients(self):
        """(name, parameter, 0, flat reduced gradient) after finish_gradients, from DP rank 0 only: the
        gradients are replicated, and each element must be counted once over the DP group."""
        if comm.group_rank(self.dp_group) != 0:
            return
        for name, p in self.named_params:
            if p.grad is not None:
                yield name, p, 0, p.grad.reshape(-1)

    def grad_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.calls if p.grad is not None)
