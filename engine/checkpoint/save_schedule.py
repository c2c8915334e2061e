"""When a run saves: every checkpoint.interval steps, every checkpoint.interval_minutes (rank 0's clock decides
for all), at the last step and at checkpoint.exit_after; light snapshots in between. Each full save also
queues the generation diary's entries for that checkpoint."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from engine.config.schema import CheckpointConfig
from parallel import comm
from parallel.distributed import world_group


class SaveSchedule:
    def __init__(self, cfg: CheckpointConfig, train_steps: int, checkpointer, light_snapshots, diary,
                 device: torch.device):
        self.cfg, self.train_steps, self.device = cfg, train_steps, device
        self.checkpointer, self.light_snapshots, self.diary = checkpointer, light_snapshots, diary
        self.last_save_time = time.monotonic()  # checkpoint.interval_minutes counts from the start or last save

    def save(self, step: int, consumed_samples: int) -> Path:
        """The full training state now (blocks only for the snapshot under checkpoint.async_save)."""
        self.last_save_time = time.monotonic()
        path = self.checkpointer.save(step, consumed_samples)
        self.diary.write(step, path, wait=self.checkpointer.wait)
        return path

    def after_step(self, step: int, consumed_samples: int) -> bool:
        """Periodic (by step or wall time), final and scheduled-stop saves; True when checkpoint.exit_after
        says to stop now."""
        stop = self.cfg.exit_after > 0 and step >= self.cfg.exit_after
        by_step = self.cfg.interval > 0 and (step % self.cfg.interval == 0 or step == self.train_steps)
        if stop or by_step or self._due_by_time():
            self.save(step, consumed_samples)
        elif self.light_snapshots.due(step):
            self.light_snapshots.save(step, consumed_samples)
        return stop

    def _due_by_time(self) -> bool:
        """checkpoint.interval_minutes: rank 0's clock decides for every rank (one broadcast of a flag)."""
        if self.cfg.interval_minutes <= 0:
            return False
        due = torch.tensor([time.monotonic() - self.last_save_time >= 60 * self.cfg.interval_minutes],
                           dtype=torch.int32, device=self.device)
        comm.broadcast(due, src=0, group=world_group())
        return bool(due.item())
