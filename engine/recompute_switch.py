"""train.recompute_switch_step: from that step on, another activation-recompute mode and micro batch.

A run that starts without recomputation (fast) can switch to it, and to larger micro-batches, once it is
known to fit: the global batch and the data order stay the same, so the gradient does not change.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config.schema import TrainConfig


@dataclass(frozen=True)
class RecomputeSwitch:
    """The recompute mode and micro batch for each step; a function of the step alone, so resuming works."""
    switch_step: int  # the first step of the second setting; 0: never
    before: tuple[str, int]  # (recompute mode, micro batch) before it
    after: tuple[str, int]  # and from it on

    @classmethod
    def of(cls, t: TrainConfig) -> RecomputeSwitch:
        return cls(t.recompute_switch_step, (t.recompute, t.micro_batch_size),
                   (t.recompute_after_switch, t.micro_batch_size_after_switch or t.micro_batch_size))

    def at(self, step: int) -> tuple[str, int]:
        """(recompute mode, micro batch size) of step `step` (counted from 1)."""
        return self.after if 0 < self.switch_step <= step else self.before
