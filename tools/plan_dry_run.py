"""`tools/plan_layout.py --dry-run K`: the K best layouts at the tool's world size, each simulated by the dry run
(engine/dry_run) on one CPU before any device is used.

For each layout: its covering sample of ranks (every TP × CP × PP coordinate with the first and last DP rank)
built on the fake backend and the meta device and run for one training step; the recorded schedule checked
(engine/dry_run/schedule_check.py: consistent, cannot deadlock); each rank's memory against
engine/memory_estimate.py (equal) and its bytes per (group kind, op) against the planner's volumes
(engine/plan/volumes.py), judged by engine/dry_run/verdict.py. One line per layout, PASS or FAIL with the largest
differences.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from engine.dry_run.rank_program import dry_config
from engine.dry_run.ranks import cover, layout_of
from engine.dry_run.verdict import judge


def check_layout(planned, world: int, run_dir: Path, jobs: int) -> tuple[bool, str]:
    """(passed, the line's text after the layout's name) for one planned layout: its covering sample judged."""
    cfg = dataclasses.replace(planned.cfg, run=dataclasses.replace(planned.cfg.run, dir=str(run_dir)))
    cfg = dry_config(cfg, world)
    return judge(cfg, world, cover(layout_of(cfg, world)), jobs)


def dry_run(ranked: list, world: int, jobs: int = 0) -> int:
    """Check each planned layout of `ranked`, one line each; 1 when any failed."""
    jobs = jobs or os.cpu_count() or 1
    print(f"dry run: {len(ranked)} layouts at {world} ranks, a covering sample of each, {jobs} ranks at a time",
          flush=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="plan_dry_run_") as work:  # the Trainer's run directories, empty
        for i, planned in enumerate(ranked):
            passed, text = check_layout(planned, world, Path(work) / f"layout{i}", jobs)
            failed |= not passed
            print(f"dry run {planned.layout.name(world)}: {text}", flush=True)
    return 1 if failed else 0
