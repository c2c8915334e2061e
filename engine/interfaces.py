"""The two objects the Trainer and the Checkpointer use without knowing which data-parallel strategy made them.

`engine/data_parallel.build_data_parallel` returns one of two pairs: bucketed DDP with a replicated AdamW
(`parallel/ddp.BucketedDDP`, `engine/optim/replicated.MixedPrecisionAdamW`; parallel.zero_stage=0), or sharding units
with a sharded AdamW (`parallel/fsdp.ShardedDataParallel`, `engine/optim/zero.ZeroAdamW`; stages 1-3).
Both sides of each pair satisfy the Protocols below; nothing else of theirs is called from outside.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from engine.optim.replicated import LossScaler


class DataParallel(Protocol):
    """Gradient synchronisation over the data-parallel group for one optimizer step."""

    def start_step(self, num_micro_batches: int) -> None:
        """Before the step's first backward: only the `num_micro_batches`-th backward of a parameter communicates
        (stage 0 and 1; stages 2 and 3 reduce every micro-batch into a shard)."""

    def finish_gradients(self) -> None:
        """After the step's last backward: every reduction done, TP-partial and tied gradients summed; the
        gradients the optimizer reads are final."""

    def owned_gradients(self) -> Iterator[tuple[str, torch.nn.Parameter, int, torch.Tensor]]:
        """(name, parameter, first flattened index, flat reduced gradient piece) of what this rank owns after
        finish_gradients; over the data-parallel group each element appears exactly once."""


class Optimizer(Protocol):
    """AdamW on fp32 masters of what this rank owns, and the checkpoint's view of that state."""

    scaler: LossScaler  # the fp16 loss scale (1 and never changed under fp32/bf16)
    adam_step: int  # Adam's step count, for the bias corrections
    writes_state: bool  # False on ranks whose state is an exact copy of one that writes (saved once)

    def begin_step(self, lr: float) -> None:
        """Before the step's first backward, with the learning rate `step` will get."""

    def step(self, lr: float) -> tuple[float, bool]:
        """Unscale, clip by the global gradient norm, update; returns (norm, skipped because not finite)."""

    def offload_readings(self) -> dict:
        """metrics.jsonl fields of optimizer offload overlap (host seconds, seconds hidden, redos); {} if none."""

    def wait_writes(self) -> None:
        """Offloaded state's new parameters, copied back without blocking, are complete on the device before
        something other than a forward reads the parameters (engine/optim/offload.WriteBack)."""

    def zero_grad(self) -> None:
        """Release the step's gradients (zero them where they are views into persistent buckets: stage 0)."""

    def owned_state(self) -> dict[str, dict]:
        """{parameter name: {"shape", "range": (start, end) in the flattened parameter, "master", "exp_avg",
        "exp_avg_sq"}} of the elements this rank owns ("momentum" in place of the moments for Muon's matrices)."""

    def load_owned_state(self, read: Callable[[str, str, int, int], torch.Tensor]) -> None:
        """Fill the owned elements from `read(name, key, start, end)` (a checkpoint at any layout), then the
        model parameters from the masters."""

    def keeps_loaded(self) -> frozenset[str]:
        """The state keys ("exp_avg", ...) whose tensors from `read` load_owned_state keeps as its state; it copies
        the others out, so a reader may hand those as views of memory that lives only for the load."""
