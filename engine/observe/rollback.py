"""Loss spikes, and rolling back past the data that caused them (as PaLM's training did, Chowdhery et al., 2022, §5.1).

A step's loss is a *spike* when it lies more than `run.spike_zscore` standard deviations above the mean of
the last `run.spike_window` sound steps (judged once that many exist; spikes and non-finite steps never enter
the window, so one bad step does not hide the next). Rank 0 writes `run.dir/spikes/step_00000012.json` naming
the micro-batches above the threshold (else the highest one) with each sample's tokens and provenance, as
engine/observe/monitor.py does for non-finite steps.

When `run.rollback_after` spikes or non-finite steps fall within the last `run.spike_window` steps, every rank
reloads the newest checkpoint older than the first of them and goes on reading data where it stands: the
global samples consumed since that checkpoint are never trained on. The checkpoint is saved again at once
(same step, same state) so its metadata records the data position and the skipped ranges (`skipped_samples`,
`rollbacks`), and a crash right after the rollback resumes past the bad window too. A second rollback whose
first bad step lies within an earlier rollback's window stops the run (status 1): the trouble is not the data.
"""
from __future__ import annotations

import json
import statistics
from collections import deque
from pathlib import Path

import torch

from engine.checkpoint.files import STEP_DIR, step_dirs
from engine.observe.monitor import NonFiniteTraining
from parallel.placement import compact_ranges


class RollbackFailed(NonFiniteTraining):
    """Rolling back cannot help (no earlier checkpoint, or the same window went bad twice): the run stops."""


def merge_ranges(ranges: list) -> list[list[int]]:
    """[start, end) sample ranges, sorted, with overlapping or touching ones joined."""
    out: list[list[int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


class LossGuard:
    """Judges every step's loss and decides when to roll back; every rank holds one and sees the same losses."""

    def __init__(self, cfg, run_dir: Path, rank: int, console, resumed: dict | None = None):
        self.run, self.run_dir, self.console = cfg.run, Path(run_dir), console
        self.is_reporter = rank == 0
        self.window: deque = deque(maxlen=self.run.spike_window)  # (step, loss) of sound steps, oldest first
        self.bad_steps: list[int] = []  # spikes and non-finite steps within the last spike_window steps
        resumed = resumed or {}
        # What checkpoints record (Checkpointer.extra_metadata); replaced, never mutated, so a background save
        # serialises a consistent copy.
        self.metadata = {"skipped_samples": resumed.get("skipped_samples", []),
                         "rollbacks": resumed.get("rollbacks", [])}

    @property
    def rollback_due(self) -> bool:
        return 0 < self.run.rollback_after <= len(self.bad_steps)

    def observe(self, step: int, loss: float, nonfinite: bool, losses_by_rank: torch.Tensor, window_start: int,
                micro_batch_size: int, describe) -> dict:
        """Judge step `step` (already counted); returns what to add to its record. losses_by_rank: [dp, m]
        micro-batch losses; window_start: the step's first global sample; describe(i): where sample i is from."""
        self.bad_steps = [s for s in self.bad_steps if s > step - self.run.spike_window]
        if nonfinite:  # engine/observe/monitor.py has traced its samples
            self.bad_steps.append(step)
            return {}
        if not self._is_spike(loss):
            self.window.append((step, loss))
            return {}
        self.bad_steps.append(step)
        mean, std = self._stats()
        threshold = mean + self.run.spike_zscore * std
        samples = self._report(step, loss, mean, std, threshold, losses_by_rank, window_start, micro_batch_size,
                               describe)
        return {"loss_spike_zscore": (loss - mean) / std, "loss_spike_samples": samples}

    def _stats(self) -> tuple[float, float]:
        losses = [loss for _, loss in self.window]
        return statistics.fmean(losses), statistics.pstdev(losses)

    def _is_spike(self, loss: float) -> bool:
        if self.run.spike_zscore <= 0 or len(self.window) < self.run.spike_window:
            return False
        mean, std = self._stats()
        return std > 0 and loss > mean + self.run.spike_zscore * std

    def _report(self, step, loss, mean, std, threshold, losses_by_rank, window_start, micro_batch_size,
                describe) -> list[int]:
        """The spike's culprit micro-batches (above the threshold themselves, else the highest): their samples,
        and on rank 0 a JSON report with their tokens and provenance."""
        per_rank = losses_by_rank.shape[1] * micro_batch_size  # this step's share (the batch may ramp)
        above = (losses_by_rank > threshold).nonzero().tolist()
        culprits = above or [list(divmod(int(losses_by_rank.argmax()), losses_by_rank.shape[1]))]
        groups = [(r, k, window_start + r * per_rank + k * micro_batch_size) for r, k in culprits]
        samples = [i for _, _, first in groups for i in range(first, first + micro_batch_size)]
        if self.is_reporter:
            report = {"step": step, "loss": loss, "window_mean": mean, "window_std": std,
                      "zscore": (loss - mean) / std, "run.spike_zscore": self.run.spike_zscore,
                      "micro_batches": [{"dp_rank": r, "micro_batch": k, "loss": losses_by_rank[r, k].item(),
                                         "samples": [describe(i) for i in range(first, first + micro_batch_size)]}
                                        for r, k, first in groups]}
            path = self.run_dir / "spikes" / f"step_{step:08d}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1))
            self.console(f"WARNING step {step}: loss spike {loss:.4f}, {(loss - mean) / std:.1f} std above the mean "
                         f"{mean:.4f} of the last {len(self.window)} steps (run.spike_zscore="
                         f"{self.run.spike_zscore}); samples {compact_ranges(samples, ', ')}, details in {path}")
        return samples

    # -- rollback ---------------------------------------------------------------------------------------
    def target(self, checkpointer) -> Path:
        """The newest intact checkpoint of this run older than the first bad step; RollbackFailed when there is
        none, or when that step lies in a window rolled back before."""
        first = self.bad_steps[0]
        for earlier in self.metadata["rollbacks"]:
            if earlier["to_step"] < first <= earlier["from_step"]:
                raise RollbackFailed(
                    f"steps {compact_ranges(self.bad_steps, ', ')} went bad (spikes or non-finite) again after "
                    f"rolling back from step {earlier['from_step']} to {earlier['to_step']} and skipping samples "
                    f"{earlier['skipped_samples'][0]}-{earlier['skipped_samples'][1] - 1}: the data was not the "
                    f"cause. Lower optim.lr or raise optim.warmup_steps, then resume from {earlier['checkpoint']}")
        older = [d for d in step_dirs(checkpointer.root) if int(STEP_DIR.match(d.name).group(1)) < first]
        for path in older:
            problems = checkpointer.problems(path)
            if not problems:
                return path
            self.console(f"WARNING rollback: checkpoint {path} is unusable ({'; '.join(problems)}); trying an "
                         f"older one")
        raise RollbackFailed(f"{len(self.bad_steps)} bad steps ({compact_ranges(self.bad_steps, ', ')}) within "
                             f"run.spike_window={self.run.spike_window} call for a rollback, but "
                             f"{checkpointer.root} holds no intact checkpoint before step {first}; set "
                             f"checkpoint.interval (and checkpoint.keep) so that one exists, or run.rollback_after=0")

    def rolled_back(self, from_step: int, meta: dict, path: Path, consumed_samples: int) -> dict:
        """Book the rollback to checkpoint `path` (its metadata `meta`) made at step `from_step`, with the data
        at `consumed_samples`; returns the event for metrics.jsonl."""
        skipped = [meta["consumed_samples"], consumed_samples]
        event = {"from_step": from_step, "to_step": meta["step"], "first_bad_step": self.bad_steps[0],
                 "bad_steps": list(self.bad_steps), "checkpoint": str(path), "skipped_samples": skipped}
        self.metadata = {"skipped_samples": merge_ranges(self.metadata["skipped_samples"] + [skipped]),
                         "rollbacks": self.metadata["rollbacks"] + [event]}
        self.bad_steps = []
        self.window = deque(((s, loss) for s, loss in self.window if s <= meta["step"]), maxlen=self.window.maxlen)
        if self.is_reporter:
            self.console(f"ROLLBACK at step {from_step}: bad steps {compact_ranges(event['bad_steps'], ', ')}; "
                         f"reloaded {path} (step {meta['step']}) and skipped global samples {skipped[0]}-"
                         f"{skipped[1] - 1} ({skipped[1] - skipped[0]} samples)")
        return event
