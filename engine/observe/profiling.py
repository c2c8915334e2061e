"""torch.profiler traces of chosen training steps: `run.profile_steps=[a, b]`.

Each rank records steps a to b (inclusive) and writes `run.dir/profile/rank_K/trace.json` (Chrome / Perfetto
JSON: open it in https://ui.perfetto.dev or chrome://tracing). Trilith's phases are named ranges in it: "data
wait", "forward", "backward", "optimizer", and every collective as `comm:<op>[<group>]` (parallel/comm.py).
On CUDA the allocator's history over the same steps goes to `memory_snapshot.pickle` beside it (drop it on
https://pytorch.org/memory_viz). `tools/profile_summary.py RUN_DIR` prints the time by phase and the top ops.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

TRACE, MEMORY_SNAPSHOT = "trace.json", "memory_snapshot.pickle"
PHASES = ("data wait", "forward", "backward", "optimizer")  # the ranges engine/train.py and parallel/ name
MEMORY_EVENTS = 100_000  # allocator events kept for the snapshot (the newest, when there are more)


def profile_dir(run_dir, rank: int) -> Path:
    return Path(run_dir) / "profile" / f"rank_{rank}"


class StepProfiler:
    """Starts torch.profiler before step `a` and writes the trace after step `b` (run.profile_steps)."""

    def __init__(self, run_cfg, rank: int, device: torch.device, console):
        self.first, self.last = run_cfg.profile_steps or (0, 0)
        self.dir, self.cuda, self.console = profile_dir(run_cfg.dir, rank), device.type == "cuda", console
        self.profiler = None

    def step_begins(self, step: int) -> None:
        if step != self.first:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
        self.profiler = profile(activities=activities, record_shapes=True)
        self.profiler.start()

    def step_ends(self, step: int) -> None:
        if self.profiler is None or step != self.last:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.profiler.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.dir / TRACE))
        self.profiler = None
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.dir / MEMORY_SNAPSHOT))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.console(f"profile of steps {self.first}-{self.last} written to {self.dir.parent}/rank_*/{TRACE} "
                     f"(summary: python tools/profile_summary.py {self.dir.parent.parent})")
