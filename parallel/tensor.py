"""Tensor-parallel layers (Megatron's column/row split) with optional sequence parallelism.

A `TensorParallel` context carries the TP group and whether sequence parallelism is on. Blocks call
`tp.enter(x)` before their column-parallel projections and row-parallel layers leave the region
themselves, so each block issues exactly one collective in and one out, forward and backward:

    without SP:  enter = f (identity / all-reduce)    exit = g (all-reduce / identity)
    with SP:     enter = all-gather / reduce-scatter    exit = reduce-scatter / all-gather

Every parameter records how it maps onto the full (TP=1) tensor: `tp_dim` (split dimension or None),
`full_shape`, and `valid_rows` for vocabulary padding. Initialisation and checkpoints use that.
"""
from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.cross_entropy import cross_entropy, linear_cross_entropy
from kernels.grad_accumulation import embedding, linear
from parallel import comm


@dataclass
class TensorParallel:
    group: object = None
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False

    @classmethod
    def from_topology(cls, topo, sequence_parallel: bool = False) -> "TensorParallel":
        return cls(topo.tp_group, topo.tp_size, topo.tp_rank, sequence_parallel and topo.tp_size > 1)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated (or sequence-sharded) activations → the input every TP rank needs in full."""
        if self.sequence_parallel:
            return comm.gather_from_sequence_region(x, self.group, dim=1)
        return comm.copy_to_tensor_region(x, self.group)

    def exit(self, partial: torch.Tensor) -> torch.Tensor:
        """Per-rank partial sums → the summed (or summed and sequence-sharded) activations."""
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sequence_region(partial, self.group, dim=1)
        return comm.reduce_from_tensor_region(partial, self.group)


def describe(param: nn.Parameter, full_shape, tp_dim, std: float | None, valid_rows: int | None = None,
             tp_replicated_grad: bool = False) -> nn.Parameter:
    """Attach the mapping onto the full tensor; `std=None` means initialise to ones (norm weights)."""
    param.full_shape = tuple(full_shape)
    param.tp_dim = tp_dim
    param.init_std = std
    param.valid_rows = valid_rows
    param.tp_replicated_grad = tp_replicated_grad
    return param


def divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}={a} is not divisible by the tensor-parallel size {b}")
    return a // b


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Vocabulary rows as the model holds them: rounded up to a multiple of the TP size (the extra rows are
    zeros that never reach the softmax)."""
    return math.ceil(vocab_size / tp_size) * tp_size


def _bias(rows: int, full: int, tp_dim, tp_replicated_grad: bool = False) -> nn.Parameter:
    """An output bias (zero at initialisation, as in Megatron-LM), split like its weight's rows."""
    return describe(nn.Parameter(torch.empty(rows)), (full,), tp_dim, 0.0, tp_replicated_grad=tp_replicated_grad)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ (+ b) with W's output rows (and b) split across TP ranks; input must already be in the region."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, std: float,
                 valid_rows: int | None = None, bias: bool = False):
        super().__init__()
        self.tp = tp
        local_out = divide(out_features, tp.size, "output features")
        tp_dim = 0 if tp.size > 1 else None
        self.weight = describe(nn.Parameter(torch.empty(local_out, in_features)), (out_features, in_features),
                               tp_dim, std, valid_rows)
        self.bias = _bias(local_out, out_features, tp_dim) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_r W_rᵀ with W's input columns split; leaves the region (all-reduce or reduce-scatter)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, std: float):
        super().__init__()
        self.tp = tp
        local_in = divide(in_features, tp.size, "input features")
        self.weight = describe(nn.Parameter(torch.empty(out_features, local_in)), (out_features, in_features),
                               1 if tp.size > 1 else None, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.exit(linear(x, self.weight))


class ReplicatedRowsLinear(nn.Module):
    """A full weight on every TP rank of which each rank uses a block of rows (KV heads when there are
    fewer KV heads than TP ranks). Each rank's gradient covers only its rows, so the gradients are summed
    over the TP group after backward (`tp_replicated_grad`)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, std: float, rows: slice,
                 bias: bool = False):
        super().__init__()
        self.rows = rows
        self.weight = describe(nn.Parameter(torch.empty(out_features, in_features)), (out_features, in_features),
                               None, std, tp_replicated_grad=tp.size > 1)
        self.bias = _bias(out_features, out_features, None, tp_replicated_grad=tp.size > 1) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight[self.rows], None if self.bias is None else self.bias[self.rows])


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across TP ranks; vocabulary padded to a multiple of the TP size."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, std: float):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        padded = padded_vocab_size(vocab_size, tp.size)
        self.rows_per_rank = padded // tp.size
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = describe(nn.Parameter(torch.empty(self.rows_per_rank, hidden_size)), (padded, hidden_size),
                               0 if tp.size > 1 else None, std, valid_rows=vocab_size)
        self.row_lookup = None  # ZeRO-3: looks rows up from the shards (parallel/embedding_shards.py)

    def local_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """For each of `ids` (flattened), the row of this rank's table it reads, or `rows_per_rank` where another
        rank holds it: one entry per id, so that no shape depends on the values (no host synchronisation)."""
        local = ids.reshape(-1).long() - self.vocab_start
        return local.masked_fill((local < 0) | (local >= self.rows_per_rank), self.rows_per_rank)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lookup = self.row_lookup if self.row_lookup is not None and self.row_lookup.applies(self) else embedding
        if self.tp.size == 1:
            return lookup(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = lookup(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.exit(out)


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, tp: TensorParallel,
                                 vocab_size: int, chunk_tokens: int = 0, compile_backend: str | None = None
                                 ) -> torch.Tensor:
    """Per-token loss [..] from this rank's logits slice [.., V_padded / tp], never gathering the full logits.

    The softmax statistics are combined over the TP group with three all-reduces of one fp32 value per token
    (max, target logit, sum of exponentials); `chunk_tokens` > 0 bounds the fp32 working set to that many
    rows (kernels/cross_entropy.py), 0 processes all tokens at once; `compile_backend` compiles the per-chunk
    kernels (the all-reduces stay outside them)."""
    vocab_start = tp.rank * local_logits.shape[-1]
    reduce = functools.partial(_all_reduce_over, tp.group) if tp.group is not None else None
    return cross_entropy(local_logits, labels, chunk_tokens, vocab_start, vocab_size, reduce, compile_backend)


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, local_weight: torch.Tensor, labels: torch.Tensor,
                                        tp: TensorParallel, vocab_size: int, chunk_tokens: int,
                                        compile_backend: str | None = None) -> torch.Tensor:
    """Per-token loss of the output layer (this rank's vocabulary rows [V_padded / tp, h]) and cross-entropy in
    one (kernels/cross_entropy.linear_cross_entropy): the logits slice is never held whole. `hidden` must
    be the full sequence on every TP rank (after tp.enter), as for the unfused output layer."""
    vocab_start = tp.rank * local_weight.shape[0]
    reduce = functools.partial(_all_reduce_over, tp.group) if tp.group is not None else None
    return linear_cross_entropy(hidden, local_weight, labels, chunk_tokens, vocab_start, vocab_size, reduce,
                                compile_backend)


def _all_reduce_over(group, tensor: torch.Tensor, op: str) -> None:
    comm.all_reduce(tensor, group, op=torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM)


def allreduce_replicated_grads(module: nn.Module, tp: TensorParallel, done: frozenset = frozenset()) -> None:
    """Sum gradients of TP-replicated parameters whose per-rank gradients are partial (SP norms, shared KV),
    in fp32 whatever their dtype, skipping the parameters whose ids are in `done` (summed already)."""
    if tp.size == 1:
        return
    grads = [p.grad for p in module.parameters() if getattr(p, "tp_replicated_grad", False) and p.grad is not None
             and id(p) not in done]
    comm.all_reduce_flat(grads, tp.group, torch.float32)


def parameter_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def full_initial_value(param: nn.Parameter, name: str, seed: int) -> torch.Tensor:
    """The TP=1 value of a parameter: depends only on (seed, name), never on the layout."""
    if param.init_std is None:
        return torch.ones(param.full_shape)
    gen = torch.Generator().manual_seed(parameter_seed(seed, name))
    rows = param.valid_rows or param.full_shape[0]
    value = torch.zeros(param.full_shape)
    value[:rows] = torch.randn((rows,) + tuple(param.full_shape[1:]), generator=gen) * param.init_std
    return value


def local_slice(full: torch.Tensor, param: nn.Parameter, tp: TensorParallel) -> torch.Tensor:
    if param.tp_dim is None:
        return full
    return full.chunk(tp.size, dim=param.tp_dim)[tp.rank]


@torch.no_grad()
def initialize_parameters(module: nn.Module, seed: int, tp: TensorParallel) -> None:
    for name, param in module.named_parameters():
        # A tied output layer on the last pipeline stage starts from the embedding's values.
        init_name = getattr(param, "init_name", name)
        param.copy_(local_slice(full_initial_value(param, init_name, seed), param, tp))
