"""python -m engine.dry_run --config FILE --world-size N [--ranks all|cover|LIST] [--jobs J] [overrides]

Simulates the chosen ranks (engine/dry_run/rank_program.py), each in a forked process of its own (the fake
process group is per process; forking keeps the imports), `--jobs` at a time; checks their schedules
(schedule_check.py) and writes the report (report.py) to run.dir/dry_run/report.json. Exit status 0 when the
schedule is consistent and cannot deadlock and memory and volumes equal the estimate and the plan, 1 when not
(the first violation in one line), 2 for bad input (one line naming the key and the fix, before any rank runs).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

from engine.config.schema import ConfigError, load_config
from engine.dry_run import report, schedule_check
from engine.dry_run.rank_program import dry_config, simulate, warm_up
from engine.dry_run.ranks import chosen_ranks, layout_of

_JOB: tuple = ()  # (cfg, world size), inherited by the forked workers


def _one(rank: int) -> dict:
    cfg, world = _JOB
    import torch
    torch.set_num_threads(1)
    return simulate(cfg, world, rank)


def run(cfg, world: int, ranks: list[int], jobs: int, progress: bool = False) -> list[dict]:
    global _JOB
    _JOB = (cfg, world)
    warm_up()
    results = []
    with multiprocessing.get_context("fork").Pool(jobs, maxtasksperchild=1) as pool:
        for result in pool.imap(_one, ranks, chunksize=1):
            results.append(result)
            if progress and (len(results) % max(1, len(ranks) // 10) == 0 or len(results) == len(ranks)):
                print(f"dry run: {len(results)} of {len(ranks)} ranks simulated", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.dry_run", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML run configuration")
    parser.add_argument("--world-size", type=int, required=True, help="ranks of the job being simulated")
    parser.add_argument("--ranks", default="cover", help="all | cover (every TP × CP × PP coordinate with the "
                        "first and last DP rank) | a list such as 0,5,8-11")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="ranks simulated at once")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    try:
        if args.world_size < 1:
            raise ConfigError(f"--world-size {args.world_size}: give the job's number of ranks (at least 1)")
        base = load_config(args.config, args.overrides)
        layout = layout_of(base, args.world_size)
        ranks = chosen_ranks(args.ranks, layout)
        cfg = dry_config(base, args.world_size)
    except ConfigError as exc:
        print(f"trilith: configuration error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = run(cfg, args.world_size, ranks, max(1, args.jobs), progress=True)
    simulated = time.perf_counter() - start
    schedule = {r["rank"]: r["events"] for r in results}
    problem, unchecked = schedule_check.check(schedule)
    checked = time.perf_counter() - start - simulated
    reports = [report.rank_report(cfg, args.world_size, r) for r in results]
    memory_off = [r["rank"] for r in reports if not r["memory_equal"]]
    volumes_off = [r for r in reports if r["volume_differences"]]
    summary = {"config": args.config, "world_size": args.world_size, "layout": {
        "tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp, "order": "-".join(layout.dims)},
        "ranks_simulated": len(ranks), "schedule_problem": problem, "unchecked_transfers": unchecked,
        "memory_differs_on": memory_off, "simulate_s": round(simulated, 2), "check_s": round(checked, 2)}
    path = Path(cfg.run.dir) / "report.json"
    report.write_json(path, summary, reports)
    print(report.table(reports))
    print(f"dry run: {len(ranks)} of {args.world_size} ranks (TP {layout.tp} × CP {layout.cp} × PP {layout.pp} × "
          f"DP {layout.dp}) simulated in {simulated:.1f} s, schedule checked in {checked:.1f} s; report {path}")
    if problem:
        print(f"dry run: schedule: {problem}")
    if memory_off:
        r = next(r for r in reports if not r["memory_equal"])
        print(f"dry run: memory differs from engine/memory_estimate.py on ranks {memory_off[:8]}: rank {r['rank']} "
              f"holds {r['memory']}, estimated {r['estimate']}")
    if volumes_off:
        print(f"dry run: volumes differ from engine/plan/volumes.py on {len(volumes_off)} ranks: rank "
              f"{volumes_off[0]['rank']}: {'; '.join(volumes_off[0]['volume_differences'])}")
    ok = not (problem or memory_off or volumes_off)
    print(f"dry run: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
