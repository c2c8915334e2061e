"""The dry run over a matrix of large layouts: one PASS, REFUSED or FAIL line each, then a summary.

    python tools/dry_run_sweep.py --config launch/configs/llama_70b_1024gpu.yaml --jobs 2 --json sweep.json
    python tools/dry_run_sweep.py --config launch/configs/tiny.yaml --tp 1,2 --cp 1 --pp 1,2 --max-world 8

The matrix and the ranks simulated of each layout are engine/dry_run/sweep.py's: every TP × CP × PP of --tp,
--cp and --pp once, at a data-parallel size up to --max-dp within --max-world ranks, the rank orders, stage
balances, pipeline schedules, ZeRO stages, CP strategies and offload cycling over the layouts; rank 0's whole
pipeline and the last rank simulated; the verdict engine/dry_run/verdict.py's (schedule consistent and
deadlock-free, memory equal to the estimate, volumes to the planner). REFUSED: the configuration's validation
refuses the layout (its one line; not a finding). FAIL: a rank's program raised, hung (--timeout), or its
schedule, memory or volumes are off. Exit status 0 when no layout failed, 1 when one did, 2 for bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config.schema import ConfigError, load_config  # noqa: E402
from engine.dry_run.sweep import check, matrix  # noqa: E402


def sizes(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} {text}: give sizes as a comma-separated list such as 1,2,4,8") from None
    if min(values) < 1:
        raise ConfigError(f"{flag} {text}: every size must be at least 1")
    return values


def cpu_seconds() -> float:
    """User + system seconds of this process and its finished children (the simulated ranks)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML run configuration: the model every layout runs")
    parser.add_argument("--tp", default="1,2,4,8", help="tensor-parallel sizes (default 1,2,4,8)")
    parser.add_argument("--cp", default="1,2,4", help="context-parallel sizes (default 1,2,4)")
    parser.add_argument("--pp", default="1,2,4,8,16", help="pipeline sizes (default 1,2,4,8,16)")
    parser.add_argument("--max-dp", type=int, default=512, help="largest data-parallel size (default 512)")
    parser.add_argument("--max-world", type=int, default=4096, help="largest world size (default 4096)")
    parser.add_argument("--phase", type=int, default=0, help="shift every setting's cycle by this many layouts: "
                        "the same TP × CP × PP with other settings (default 0)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="ranks simulated at once")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a layout may run before it counts as hung")
    parser.add_argument("--json", type=Path, help="also write every layout's result and the summary here")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides of every layout")
    args = parser.parse_args(argv)
    try:
        tps, cps, pps = sizes("--tp", args.tp), sizes("--cp", args.cp), sizes("--pp", args.pp)
        load_config(args.config, args.overrides)
        if args.phase < 0:
            raise ConfigError(f"--phase {args.phase}: give 0 or more")
        for flag, value in (("--max-dp", args.max_dp), ("--max-world", args.max_world), ("--jobs", args.jobs),
                            ("--timeout", args.timeout)):
            if value < 1:
                raise ConfigError(f"{flag} {value}: give a number of at least 1")
    except ConfigError as exc:
        print(f"trilith: configuration error: {exc}", file=sys.stderr)
        return 2
    cases = matrix(tps, cps, pps, args.max_dp, args.max_world, args.phase)
    print(f"dry run sweep: {len(cases)} layouts of {args.config}, {args.jobs} ranks at a time", flush=True)
    start, cpu = time.perf_counter(), cpu_seconds()
    results = []
    with tempfile.TemporaryDirectory(prefix="dry_run_sweep_") as work:  # the Trainer's run directories, empty
        for i, case in enumerate(cases):
            began = time.perf_counter()
            result = check(args.config, args.overrides, case, f"{work}/case{i}", args.jobs, args.timeout)
            result["wall_s"] = round(time.perf_counter() - began, 1)
            results.append(result)
            print(f"{result['status']:<7} {case.name()} at {case.world} ranks ({len(result['ranks'])} simulated, "
                  f"{result['wall_s']} s): {result['line']}", flush=True)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "REFUSED", "FAIL")}
    summary = {"config": args.config, "overrides": args.overrides, "phase": args.phase, "layouts": len(results),
               **counts,
               "ranks_simulated": sum(len(r["ranks"]) for r in results),
               "wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(cpu_seconds() - cpu, 1)}
    print(f"dry run sweep: {summary['layouts']} layouts, {counts['PASS']} PASS, {counts['REFUSED']} refused as "
          f"invalid, {counts['FAIL']} FAIL; {summary['ranks_simulated']} ranks simulated in {summary['wall_s']} s "
          f"wall, {summary['cpu_s']} s CPU")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**summary, "results": results}, indent=1))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
