"""One line on one simulated layout: its chosen ranks run (engine/dry_run/__main__.run), their schedule checked
(schedule_check.py: consistent, cannot deadlock), each rank's memory against engine/memory_estimate.py (equal)
and its bytes per (group kind, op) against the planner's volumes (engine/plan/volumes.py) with report.py's
tolerances (1e-4 relative plus 64 B; the loss's and the gradient norm's scalars under 64 KiB within 25 % or
64 KiB). PASS, or FAIL with the first schedule problem, the first rank whose memory differs and the largest
volume differences. tools/plan_dry_run.py and tools/dry_run_sweep.py print it."""
from __future__ import annotations

from engine.dry_run import report, schedule_check
from engine.dry_run.__main__ import run

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


def judge(cfg, world: int, ranks: list[int], jobs: int) -> tuple[bool, str]:
    """(passed, the line's text) for `ranks` of a dry_config `cfg` at `world` ranks."""
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
