"""Reductions in stages that follow one another, issued asynchronously (hierarchical reduction and HSDP).

A hierarchical all-reduce is a reduce-scatter inside the node group, an all-reduce of that shard across the
groups, an all-gather inside the group; HSDP reduce-scatters inside its shard group, then all-reduces the shard
across the replicas. Each stage reads what the one before wrote. Issued one after another from a backward hook,
the stages would hold the hook up (gloo waits on the host) or make the compute stream wait for each (NCCL), so
backward would not overlap them.

A `StagedReduction` issues its first stage at once and each later stage when `advance()` is called; the data
parallel objects advance every reduction in flight, oldest first, each time they start another, and finish them
all (`wait()`) in a fixed order after backward. Every rank therefore issues the same collectives in the same
order, whatever the timing. On CUDA the wait for a stage and the issue of the next run on a side stream: the
communicator's stream then waits for the previous stage, the compute stream for nothing until `wait()`.
On the CPU (gloo) the wait blocks the host, on a stage issued at least one launch earlier.
"""
from __future__ import annotations

import collections
import contextlib

import torch

_side_streams: dict = {}


def _after_previous_stage(device: torch.device):
    """Where to wait for a stage and issue the next: a side stream of `device` on CUDA, the host otherwise."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return torch.cuda.stream(_side_streams[device])


class StagedReduction:
    """Collectives in order, each issued (async_op) once the one before it is done. `stages` are callables
    that issue one collective and return its work handle (None: nothing to wait for)."""

    def __init__(self, stages: list, device: torch.device):
        self._stages = collections.deque(stages)
        self._device = device
        self._handle = self._stages.popleft()()

    @property
    def stages_left(self) -> int:
        """Stages not issued yet."""
        return len(self._stages)

    def advance(self) -> None:
        """Issue the next stage, after the current one completes (nothing when all are issued)."""
        if not self._stages:
            return
        with _after_previous_stage(self._device):
            if self._handle is not None:
                self._handle.wait()
            self._handle = self._stages.popleft()()

    def wait(self) -> None:
        """Issue the remaining stages and wait for the last; the result is then readable."""
        while self._stages:
            self.advance()
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
