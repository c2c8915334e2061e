"""Goodput under injected failures: disk checkpoints only against disk checkpoints + memory snapshots.

    python tools/bench_goodput.py [--shape demo|tiny] [--nproc 2] [--steps 60] [--fail-every 7]
        [--checkpoint-interval 20] [--memory-interval 5] [--disk-cache cold|warm] [--rounds 1] [--json FILE]
        [section.key=value ...]

Each mode is one launch of launch/run_pretrain.sh --nproc P --max-restarts K on synthetic tokens, of fixed
length (train.steps), with rank R SIGKILLed as every multiple of --fail-every ends (run.inject_fault=
kill@every=N,rank=R, engine/fault_inject.py: before any save of that step); the launcher starts every rank again
and they resume from the best tier. The modes share checkpoint.interval; "memory" adds
checkpoint.memory_interval (snapshots in a new directory of /dev/shm unless --memory-dir says otherwise). From
rank 0's run.dir/logs/train.log (one banner per attempt, a timestamp per step, the engine's one-line recovery
account) it reports per mode: the wall time, goodput (train.steps / wall time,
and the share of the wall time spent on the surviving steps at the median step time), per failure the steps
lost (last step logged before the failure − the step resumed at), the tier, the restore time the recovery line
states (and the snapshot set-up it states, counted in for a second ratio), and the restart time (last step
logged before the failure → the recovery line: detection, teardown, process start, rendezvous, restore). It also
checks that both modes logged the same loss and gradient norm at every step (both resume exactly). The goals:
steps lost per failure ≤ memory_interval with snapshots, restore from memory ≥ 3× faster than from the disk
checkpoint.

The disk tier is read cold by default (--disk-cache cold), as a restarted job reads its checkpoint from shared
storage and not from the page cache of the node that just wrote it: while a mode runs, a thread of this tool evicts
every checkpoint directory from the page cache as soon as it is committed (fsync, then
posix_fadvise(POSIX_FADV_DONTNEED) on each file: no root needed; the engine is not involved). Memory snapshots are
in /dev/shm, which is memory and stays. --disk-cache warm leaves the cache alone (both tiers then read RAM).

--rounds N runs the modes N times, interleaved (disk, memory, disk, memory, ...), so that a load that changes
during the measurement falls on both; each run reports its CPU seconds (all its processes) and the load average
at its start and end, and with --fail-every 0 the summary gives each round's step-time ratio.

--shape demo is launch/configs/demo.yaml's model and batch; tiny is launch/configs/tiny.yaml's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = "launch/configs/tiny.yaml"
STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
STEP = re.compile(STAMP + r"step\s+(\d+) \|")
BANNER = re.compile(STAMP + r"Trilith: \d+ ranks")
RECOVERY = re.compile(STAMP + r"recovery: from (memory|the disk checkpoint|nothing)\b.* at step (\d+): "
                      r"(?:(\d+) steps? lost|steps lost unknown), ([\d.]+) s"
                      r"(?: \+ ([\d.]+) s snapshot set-up)?$")


def when(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def attempts(log: str) -> list[dict]:
    """rank 0's train.log cut at each start: per attempt its steps [(time, step)] and its recovery line."""
    out: list[dict] = []
    for line in log.splitlines():
        if m := BANNER.match(line):
            out.append({"start": when(m.group(1)), "steps": [], "recovery": None})
        elif out and (m := STEP.match(line)):
            out[-1]["steps"].append((when(m.group(1)), int(m.group(2))))
        elif out and (m := RECOVERY.match(line)):
            out[-1]["recovery"] = {"time": when(m.group(1)), "tier": {"the disk checkpoint": "disk"}.get(
                m.group(2), m.group(2)), "step": int(m.group(3)),
                "lost": int(m.group(4)) if m.group(4) else None, "seconds": float(m.group(5)),
                "setup": float(m.group(6) or 0)}
    return out


def failures(runs: list[dict]) -> list[dict]:
    """Per restart: the last step logged before it, the step resumed at, the steps lost, the tier, the restore
    seconds (the recovery line's) and the restart seconds (last step logged → the recovery line, else the first
    step of the new attempt)."""
    out = []
    for before, after in zip(runs, runs[1:]):
        last_time, last = before["steps"][-1] if before["steps"] else (before["start"], 0)
        rec = after["recovery"]
        resumed = rec["step"] if rec else 0
        back = rec["time"] if rec else (after["steps"][0][0] if after["steps"] else after["start"])
        out.append({"failed_after": last, "resumed_at": resumed, "lost": last - resumed,
                    "tier": rec["tier"] if rec and rec["tier"] != "nothing" else "fresh start",
                    "stated_lost": rec["lost"] if rec else None, "restore_s": rec["seconds"] if rec else 0.0,
                    "setup_s": rec["setup"] if rec else 0.0,
                    "restart_s": back - last_time})
    return out


def step_time(runs: list[dict]) -> float:
    """Median seconds between consecutive steps of one attempt (the first step of each attempt left out)."""
    gaps = [b[0] - a[0] for r in runs for a, b in zip(r["steps"][1:], r["steps"][2:]) if b[1] == a[1] + 1]
    return statistics.median(gaps) if gaps else 0.0


def curve(run_dir: Path) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad norm)} of metrics.jsonl, each step's last record (a redone step's second)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and "grad_norm" in r:
            out[r["step"]] = (r["loss"], r["grad_norm"])
    return out


def redone_equal(run_dir: Path) -> bool:
    """Every step trained twice (before a failure and after its restart) gave the same loss and gradient norm."""
    seen: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and "grad_norm" in r:
            seen.setdefault(r["step"], set()).add((r["loss"], r["grad_norm"]))
    return all(len(v) == 1 for v in seen.values())


def shape_overrides(shape: str) -> list[str]:
    if shape == "tiny":
        return []
    demo = yaml.safe_load((ROOT / "launch/configs/demo.yaml").read_text())
    return [f"model.{k}={v}" for k, v in demo["model"].items()] + [
        f"train.{k}={demo['train'][k]}" for k in ("micro_batch_size", "global_batch_size", "precision")]


def evict(directory: Path) -> int:
    """Drop a checkpoint directory's files from the page cache (written back first, so that the pages are clean
    and the kernel lets them go); returns the bytes evicted."""
    total = 0
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


class ColdDisk:
    """While a mode runs: every checkpoint directory committed under run_dir/checkpoints is evicted from the page
    cache once, as soon as it appears (polled every 50 ms), so that a restart reads it from the disk."""

    def __init__(self, run_dir: Path):
        self.root, self.seen, self.bytes = run_dir / "checkpoints", set(), 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.stop.wait(0.05):
            self.sweep()

    def sweep(self) -> None:
        for path in sorted(self.root.glob("step_*")) if self.root.is_dir() else []:
            if path.name not in self.seen and (path / "manifest.json").is_file():
                try:
                    self.bytes += evict(path)
                    self.seen.add(path.name)
                except FileNotFoundError:  # deleted by retention meanwhile
                    self.seen.add(path.name)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def cpu_seconds_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_mode(args, mode: str, work: Path, name: str) -> dict:
    run_dir = work / name
    restarts = args.steps // args.fail_every + 1 if args.fail_every else 0
    fault = f"kill@every={args.fail_every},rank={args.rank}" if args.fail_every else ""
    memory = args.memory_interval if mode == "memory" else 0
    cmd = ["bash", "launch/run_pretrain.sh", "--nproc", str(args.nproc), "--max-restarts", str(restarts),
           "--config", TINY, f"run.dir={run_dir}", f"train.steps={args.steps}", "train.log_interval=1",
           f"checkpoint.interval={args.checkpoint_interval}", f"checkpoint.memory_interval={memory}",
           f"checkpoint.memory_dir={args.memory_dir}", f"run.inject_fault={fault}",
           "run.grad_norm_alarm=0", *shape_overrides(args.shape), *args.overrides]
    env = {**os.environ, "TRILITH_PYTHON": os.environ.get("TRILITH_PYTHON", sys.executable)}  # this interpreter's
    load_before, cpu_before, start = os.getloadavg()[0], cpu_seconds_of_children(), time.perf_counter()
    with (ColdDisk(run_dir) if args.disk_cache == "cold" else contextlib.nullcontext()) as cold:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall, cpu = time.perf_counter() - start, cpu_seconds_of_children() - cpu_before
    if done.returncode != 0:
        raise SystemExit(f"bench_goodput: the {mode} run failed (exit {done.returncode}): "
                         f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}; its output is in {run_dir}")
    runs = attempts((run_dir / "logs" / "train.log").read_text())
    fails = failures(runs)
    marker = run_dir / "logs" / "fault.fired"
    fired = marker.read_text().split() if marker.exists() else []
    seconds = step_time(runs)
    return {"mode": mode, "round": int(name.rpartition("-")[2]) if "-" in name else 1, "memory_interval": memory,
            "wall_s": wall, "steps": args.steps,
            "goodput_steps_per_s": args.steps / wall, "useful_share": args.steps * seconds / wall,
            "step_s": seconds, "failures": fails, "faults_fired": len(fired), "redone_equal": redone_equal(run_dir),
            "reached": max(curve(run_dir)), "cpu_s": cpu, "load": [load_before, os.getloadavg()[0]],
            "disk_cache": args.disk_cache, "evicted_checkpoints": len(cold.seen) if cold else 0}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def summary(args, results: list[dict]) -> list[str]:
    failing = f"rank {args.rank} killed every {args.fail_every} steps" if args.fail_every else "no failures"
    lines = [f"goodput: {args.shape} shape, {args.nproc} ranks, {args.steps} steps, {failing}, "
             f"checkpoint.interval={args.checkpoint_interval}, disk cache {args.disk_cache}",
             f"{'mode':<7} {'round':>5} {'mem int':>7} {'wall s':>7} {'cpu s':>7} {'load':>9} {'steps/s':>7} "
             f"{'useful':>6} {'step s':>6} {'fails':>5} {'lost/failure':<24} {'restore s by tier':<28} "
             f"{'restart s':>9}"]
    for r in results:
        fails = r["failures"]
        tiers = {}
        for f in fails:
            tiers.setdefault(f["tier"], []).append(f["restore_s"])
        restore = ", ".join(f"{t} {mean(v):.2f}" for t, v in sorted(tiers.items()))
        lost = " ".join(str(f["lost"]) for f in fails) + f" (mean {mean(f['lost'] for f in fails):.1f})"
        load = f"{r['load'][0]:.1f}-{r['load'][1]:.1f}"
        lines.append(f"{r['mode']:<7} {r['round']:>5} {r['memory_interval']:>7} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} "
                     f"{load:>9} {r['goodput_steps_per_s']:>7.3f} {r['useful_share']:>6.0%} {r['step_s']:>6.2f} "
                     f"{len(fails):>5} {lost:<24} {restore:<28} {mean(f['restart_s'] for f in fails):>9.1f}")
    by_tier: dict = {}
    with_setup: dict = {}  # + the snapshot set-up of that start (0 without snapshots): what the tier costs a start
    for r in results:
        for f in r["failures"]:
            by_tier.setdefault(f["tier"], []).append(f["restore_s"])
            with_setup.setdefault(f["tier"], []).append(f["restore_s"] + f.get("setup_s", 0.0))
    memory = [r for r in results if r["mode"] == "memory"]
    if memory and args.fail_every:
        worst = max((f["lost"] for f in memory[0]["failures"]), default=0)
        lines.append(f"steps lost per failure with snapshots: at most {worst} (goal ≤ memory_interval="
                     f"{args.memory_interval}: {'met' if worst <= args.memory_interval else 'MISSED'})")
    if by_tier.get("memory") and by_tier.get("disk"):
        # medians: one restart whose rank sat without a core for a while would decide a mean
        memory_s, disk_s = statistics.median(by_tier["memory"]), statistics.median(by_tier["disk"])
        ratio = disk_s / max(memory_s, 0.005)
        lines.append(f"restore from memory {memory_s:.3f} s, from the disk checkpoint {disk_s:.3f} s "
                     f"(medians of {len(by_tier['memory'])} and {len(by_tier['disk'])}): {ratio:.1f}× (goal ≥ 3×: "
                     f"{'met' if ratio >= 3 else 'MISSED'})")
        memory_s, disk_s = statistics.median(with_setup["memory"]), statistics.median(with_setup["disk"])
        lines.append(f"with each start's snapshot set-up counted in: {memory_s:.3f} s and {disk_s:.3f} s: "
                     f"{disk_s / max(memory_s, 0.005):.1f}×")
    rounds = {}
    for r in results:
        rounds.setdefault(r["round"], {})[r["mode"]] = r
    pairs = [(n, m["memory"]["step_s"], m["disk"]["step_s"]) for n, m in sorted(rounds.items())
             if len(m) == 2 and m["disk"]["step_s"]]
    if pairs:
        each = ", ".join(f"round {n}: {w:.3f} s against {wo:.3f} s ({w / wo - 1:+.1%})" for n, w, wo in pairs)
        lines.append(f"median step time with snapshots every {args.memory_interval} and without: {each}"
                     + (f"; median of the rounds {statistics.median(w / wo for _, w, wo in pairs) - 1:+.1%}"
                        if len(pairs) > 1 else ""))
    if len({r["mode"] for r in results}) == 2:
        lines.append(f"same loss and gradient norm at every step in both modes: "
                     f"{'yes' if all(r['curve'] == results[0]['curve'] for r in results) else 'NO'}")
    lines.append("steps trained twice gave the same values both times: "
                 + ("yes" if all(r["redone_equal"] for r in results) else "NO"))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("demo", "tiny"), default="demo")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60, help="train.steps of each mode's run")
    parser.add_argument("--fail-every", type=int, default=7,
                        help="kill a rank as every multiple of this step ends (0: no failures, to compare step times)")
    parser.add_argument("--rank", type=int, default=-1, help="the rank killed (default: the last)")
    parser.add_argument("--checkpoint-interval", type=int, default=20, help="checkpoint.interval of both modes")
    parser.add_argument("--memory-interval", type=int, default=5, help="checkpoint.memory_interval of 'memory'")
    parser.add_argument("--modes", default="disk,memory", help="comma-separated: disk, memory")
    parser.add_argument("--dir", default="", help="work directory (default: a temporary one, removed after)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per mode")
    parser.add_argument("--memory-dir", default="", help="checkpoint.memory_dir (default: a new directory in "
                        "/dev/shm, removed after)")
    parser.add_argument("--disk-cache", choices=("cold", "warm"), default="cold",
                        help="cold: evict each committed checkpoint from the page cache, so restores read the disk")
    parser.add_argument("--rounds", type=int, default=1, help="run the modes this many times, interleaved")
    parser.add_argument("--json", default="", help="also write the results to this file")
    parser.add_argument("overrides", nargs="*", help="more section.key=value for both modes")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= {"disk", "memory"} or args.fail_every < 0 or args.nproc < 1 or args.rounds < 1:
        parser.error("--modes takes disk and/or memory; --fail-every must be ≥ 0, --nproc and --rounds ≥ 1")
    args.rank = args.rank if args.rank >= 0 else args.nproc - 1
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_goodput."))
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    made = not args.memory_dir
    args.memory_dir = args.memory_dir or tempfile.mkdtemp(prefix="bench_goodput.", dir=shm)
    try:
        results = []
        for n in range(1, args.rounds + 1):
            for mode in modes:
                name = mode if n == 1 else f"{mode}-{n}"
                shutil.rmtree(work / name, ignore_errors=True)
                result = run_mode(args, mode, work, name)
                result["curve"] = curve(work / name)
                results.append(result)
                if made:  # this run's snapshots: /dev/shm is memory
                    for path in Path(args.memory_dir).iterdir():
                        shutil.rmtree(path, ignore_errors=True)
        print("\n".join(summary(args, results)))
        print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        if args.json:
            Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "curve"} for r in results],
                                                  indent=1))
    finally:
        if made:
            shutil.rmtree(args.memory_dir, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
