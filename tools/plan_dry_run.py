"""`tools/plan_layout.py --dry-run K`: the K best layouts at the tool's world size, each simulated by the dry run
(engine/dry_run) on one CPU before any device is used.

For each layout: its covering sample of ranks (every TP × CP × PP coordinate with the first and last DP rank)
built on the fake backend and the meta device and run for one training step; the recorded schedule checked
(engine/dry_run/schedule_check.py: consistent, cannot deadlock); each rank's parameter, gradient and optimizer
bytes against engine/memory_estimate.py (equal) and its bytes per (group kind, op) against the planner's
volumes (engine/plan/volumes.py) with engine/dry_run/report.py's tolerances (1e-4 relative plus 64 B; the
loss's and the gradient norm's scalars under 64 KiB within 25 % or 64 KiB). One line per layout, PASS or FAIL
with the largest differences.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from engine.dry_run import report, schedule_check
from engine.dry_run.__main__ import run
from engine.dry_run.rank_program import dry_config
from engine.dry_run.ranks import cover, layout_of

SHOWN = 3  # differences printed on a FAIL line


def relative(got: float, want: float) -> float:
    return abs(got - want) / want if want else float(got != 0)


def largest_differences(reports: list) -> list[str]:
    """The failing (rank, group, op) volumes, largest absolute difference first."""
    rows = []
    for r in reports:
        for line in r["volume_differences"]:
            key = line.split(":")[0]
            got, want = r["volumes"].get(key, 0), r["planned_volumes"].get(key, 0)
            rows.append((abs(got - want), f"rank {r['rank']} {line}"))
    return [text for _, text in sorted(rows, key=lambda row: -row[0])[:SHOWN]]


def check_layout(planned, world: int, run_dir: Path, jobs: int) -> tuple[bool, str]:
    """(passed, the line's text after the layout's name) for one planned layout."""
    cfg = dataclasses.replace(planned.cfg, run=dataclasses.replace(planned.cfg.run, dir=str(run_dir)))
    cfg = dry_config(cfg, world)
    ranks = cover(layout_of(cfg, world))
    try:
        results = run(cfg, world, ranks, jobs)
    except Exception as exc:  # a rank whose program does not build or step is the finding: report it, go on
        return False, f"FAIL (rank program raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    problem, _ = schedule_check.check({r["rank"]: r["events"] for r in results})
    reports = [report.rank_report(cfg, world, r) for r in results]
    ops = sum(r["collectives"] for r in reports)
    # X of "volumes within X": the largest relative difference of the volumes of 64 KiB or more the planner
    # counts; below that report.py bounds the difference absolutely (the loss's statistics)
    worst = max((relative(r["volumes"].get(k, 0), want) for r in reports for k, want in r["planned_volumes"].items()
                 if want >= report.SMALL), default=0.0)
    memory_off = [r for r in reports if not r["memory_equal"]]
    volumes_off = largest_differences(reports)
    if not (problem or memory_off or volumes_off):
        return True, (f"PASS ({len(ranks)} ranks, {ops} ops, schedule ok, memory equal, "
                      f"volumes within {100 * worst:.2g}%)")
    found = [f"schedule: {problem}"] if problem else []
    found += [f"memory on rank {r['rank']}: held {r['memory']}, estimated "
              f"{ {k: r['estimate'][k] for k in report.MEMORY} }" for r in memory_off[:1]]
    found += volumes_off
    return False, f"FAIL ({len(ranks)} ranks, {ops} ops): " + "; ".join(found)


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
