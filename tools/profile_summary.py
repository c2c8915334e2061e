"""Per rank, where the profiled steps went: `python tools/profile_summary.py RUN_DIR [--top N]`.

Reads the traces that `run.profile_steps` wrote (RUN_DIR/profile/rank_K/trace.json) and prints, for each rank,
the time in each of Trilith's phases (data wait, forward, backward, optimizer, and every collective as
`comm:<op>[<group>]`, which run inside the others) and the top ops: CUDA kernels when the trace has them,
else CPU operators by self time (without the operators they call).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.observe.profiling import PHASES, TRACE  # noqa: E402


def load_trace(path: Path) -> dict:
    try:
        trace = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable trace ({exc}); profile the steps again") from exc
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: no traceEvents list, not a torch.profiler Chrome trace")
    return trace


def _spans(trace: dict, category: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
            and e.get("cat") == category and isinstance(e.get("dur"), (int, float))]


def phase_times(trace: dict) -> dict[str, tuple[float, int]]:
    """{phase: (milliseconds, ranges)}: the named ranges, phases first, then collectives by time."""
    totals: dict = defaultdict(lambda: [0.0, 0])
    for e in _spans(trace, "user_annotation"):
        if e["name"] in PHASES or e["name"].startswith("comm:"):
            totals[e["name"]][0] += e["dur"] / 1000
            totals[e["name"]][1] += 1
    phases = [p for p in PHASES if p in totals]
    comms = sorted((n for n in totals if n.startswith("comm:")), key=lambda n: -totals[n][0])
    return {n: tuple(totals[n]) for n in phases + comms}


def self_times(events: list[dict]) -> list[dict]:
    """Each event with "self": its duration less that of the events nested directly inside it (same thread)."""
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append({**e, "self": e["dur"]})
    out = []
    for spans in by_thread.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in spans:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1]["self"] -= e["dur"]
            stack.append(e)
        out += spans
    return out


def top_ops(trace: dict, top: int) -> tuple[str, list[tuple[str, float, int]]]:
    """("CUDA kernels" | "CPU ops (self time)", [(name, milliseconds, calls)]) of the `top` largest."""
    kernels = _spans(trace, "kernel")
    kind, events = ("CUDA kernels", [{**e, "self": e["dur"]} for e in kernels]) if kernels else \
        ("CPU ops (self time)", self_times(_spans(trace, "cpu_op")))
    totals: dict = defaultdict(lambda: [0.0, 0])
    for e in events:
        totals[e["name"]][0] += e["self"] / 1000
        totals[e["name"]][1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return kind, [(name, ms, calls) for name, (ms, calls) in ranked]


def rank_traces(run_dir: Path) -> list[tuple[int, Path]]:
    root = run_dir / "profile"
    found = sorted((int(m.group(1)), d / TRACE) for d in root.glob("rank_*")
                   if (m := re.fullmatch(r"rank_(\d+)", d.name)) and (d / TRACE).is_file())
    if not found:
        raise ValueError(f"{root}: no rank_K/trace.json; train with run.profile_steps=[a, b] first")
    return found


def summary(run_dir: Path, top: int = 10) -> str:
    lines = []
    for rank, path in rank_traces(run_dir):
        trace = load_trace(path)
        lines.append(f"rank {rank} ({path})")
        phases = phase_times(trace)
        if not phases:
            lines.append("  no Trilith phase ranges in this trace")
        for name, (ms, count) in phases.items():
            lines.append(f"  {name:<40} {ms:>10.2f} ms  {count:>6} ranges")
        kind, ops = top_ops(trace, top)
        lines.append(f"  top {kind}:")
        for name, ms, calls in ops:
            lines.append(f"    {name[:60]:<60} {ms:>10.2f} ms  {calls:>6} calls")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="time by phase and top ops of each rank's profiled steps")
    parser.add_argument("run_dir", type=Path, help="the run directory (run.dir) of a run with run.profile_steps")
    parser.add_argument("--top", type=int, default=10, help="ops to list per rank (default 10)")
    args = parser.parse_args(argv)
    try:
        print(summary(args.run_dir, args.top))
    except ValueError as exc:
        print(f"profile_summary: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
