"""Global batch-size ramp (train.batch_size_ramp = [start, increment, ramp_samples]), Megatron's
--rampup-batch-size: the global batch starts at `start` and grows by `increment` each time another
ramp_samples / ((final - start) / increment) samples have been consumed, until it reaches the final
train.global_batch_size. The batch of a step is a pure function of the samples consumed before it, so a
run resumed from any checkpoint (which stores consumed samples) continues with exactly the same batches.

The thresholds are computed in exact integer arithmetic (Megatron divides in floating point; the two agree
except where a float rounding lands exactly on a threshold).

Learning rate while ramping (Megatron counts its schedule in samples when ramping): the schedule of
engine/optim/lr_schedule.py, whose step k uses (k + 1) / warmup_steps during warm-up, is read in samples: k + 1
becomes the samples consumed by the end of the step over the final global batch, and train.steps the samples
the run's train.steps steps consume over the same batch. So optim.warmup_steps means warmup_steps ×
global_batch_size samples, and without a ramp the position is exactly the step.
"""
from __future__ import annotations


class BatchRamp:
    def __init__(self, start: int, increment: int, ramp_samples: int, final: int):
        if not (0 < start <= final and increment > 0 and ramp_samples > 0 and (final - start) % increment == 0):
            raise ValueError(f"batch ramp start {start}, increment {increment}, ramp samples {ramp_samples}, "
                             f"final {final}: need 0 < start ≤ final, a positive increment dividing final - start, "
                             f"and a positive number of ramp samples")
        self.start, self.increment, self.ramp_samples, self.final = start, increment, ramp_samples, final
        self.increments = (final - start) // increment

    def values(self) -> list[int]:
        """Every global batch size the ramp uses, in order."""
        return list(range(self.start, self.final + 1, self.increment))

    def __call__(self, consumed: int) -> int:
        """The global batch of the step that starts after `consumed` samples."""
        if self.increments == 0:
            return self.final
        # floor(consumed / (ramp_samples / increments)), exactly
        level = consumed * self.increments // self.ramp_samples
        return min(self.start + level * self.increment, self.final)

    def samples_after(self, steps: int) -> int:
        """Samples consumed by the first `steps` steps (one pass over the ramp's levels, not its steps)."""
        consumed, done = 0, 0
        while done < steps:
            batch = self(consumed)
            if batch == self.final:
                return consumed + (steps - done) * batch
            level = (batch - self.start) // self.increment
            threshold = -(-(level + 1) * self.ramp_samples // self.increments)  # first sample of the next level
            n = min(steps - done, -(-(threshold - consumed) // batch))
            consumed, done = consumed + n * batch, done + n
        return consumed


def batch_ramp(train) -> BatchRamp | None:
    """The ramp of a TrainConfig, or None when train.batch_size_ramp is empty."""
    if not train.batch_size_ramp:
        return None
    return BatchRamp(*train.batch_size_ramp, final=train.global_batch_size)


def global_batch(train):
    """What a loader takes as its global batch: the fixed size, or the ramp (consumed samples -> size)."""
    return batch_ramp(train) or train.global_batch_size


def samples_after(train, steps: int) -> int:
    """Samples the first `steps` steps consume, ramp or not."""
    ramp = batch_ramp(train)
    return ramp.samples_after(steps) if ramp else steps * train.global_batch_size


def lr_position(train, step: int, consumed_after: int) -> tuple[float, float]:
    """(position, length) on the learning-rate schedule of step `step` (0-based), which ends having consumed
    `consumed_after` samples: in steps without a ramp, in samples (units of the final global batch) with one."""
    if not train.batch_size_ramp:
        return step, train.steps
    g = train.global_batch_size
    return consumed_after / g - 1, samples_after(train, train.steps) / g


def ramp_problem(train, dp: int, pipeline_interleaved: int = 1) -> str | None:
    """One line naming the first ramp value the layout cannot split, or None. Every value must be a multiple
    of micro batch × data-parallel size (and of both micro batches when it changes at the switch step)."""
    if not train.batch_size_ramp:
        return None
    if len(train.batch_size_ramp) != 3:
        return (f"train.batch_size_ramp={train.batch_size_ramp} must be [start, increment, ramp_samples] "
                f"(Megatron's --rampup-batch-size), e.g. [32, 32, 2000000]")
    start, increment, _ = train.batch_size_ramp
    g = train.global_batch_size
    if start > g or (g - start) % increment:
        return (f"train.batch_size_ramp={train.batch_size_ramp}: start {start} must be ≤ train.global_batch_size="
                f"{g} and the increment {increment} must divide {g} - {start} = {g - start}")
    micros = [m for m in (train.micro_batch_size, train.micro_batch_size_after_switch) if m]
    for value in batch_ramp(train).values():
        for micro in micros:
            if value % (micro * dp):
                return (f"train.batch_size_ramp={train.batch_size_ramp} reaches a global batch of {value}, not "
                        f"divisible by micro batch × data-parallel size = {micro}×{dp} = {micro * dp}; use a start "
                        f"and an increment that are multiples of {micro * dp}")
            if (value // (micro * dp)) % pipeline_interleaved:
                return (f"train.batch_size_ramp={train.batch_size_ramp} reaches a global batch of {value}: "
                        f"{value // (micro * dp)} micro-batches, not a multiple of parallel.pipeline="
                        f"{pipeline_interleaved} as the interleaved schedule needs")
    return None
