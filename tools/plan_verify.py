"""`tools/plan_layout.py --verify K`: run the K best layouts for a few steps through launch/run_pretrain.sh and
print predicted against measured step time and peak memory, with the error.

Each layout trains --verify-steps steps (default 4; the first is not timed) from the user's configuration with
the layout's overrides, checkpoints and evaluation off, synthetic data unless the configuration reads its own,
in a run directory of its own. Measured: rank 0's median step_time_s and its peak_memory_gb (CUDA: the
allocator's peak; CPU: the process's peak resident set) from metrics.jsonl; predicted: the time model's step
and the memory estimate's peak (held tensors and the loss's transients) of pipeline stage 0 (where rank 0
sits), plus the profile's memory_base_bytes (the process before the model, on CPU) and engine_memory_bytes
(what a rank holds beyond the estimate's tensors).
Only a world that fits this machine runs (--nodes 1); across nodes the tool prints each layout's launch line
to run under the cluster's launcher instead.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from engine.memory_estimate import estimate
from engine.plan.layouts import overrides

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4


def run_layout(config: str, lines: list, world: int, run_dir: Path, steps: int) -> dict:
    cmd = ["bash", str(ROOT / "launch/run_pretrain.sh"), "--nproc", str(world), "--config", config, *lines,
           f"train.steps={steps}", f"run.dir={run_dir}", "checkpoint.interval=0", "checkpoint.interval_minutes=0",
           "train.eval_interval=0", "train.log_interval=1", "train.batch_size_ramp=[]"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        return {"error": f"status {done.returncode}, log {run_dir.parent / (run_dir.name + '.log')}"}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "step_time_s" in r]
    return {"step_s": statistics.median(r["step_time_s"] for r in records[1:] or records),
            "peak_bytes": max(r["peak_memory_gb"] for r in records) * 2**30}


def verify(config: str, user_overrides: list, ranked: list, world: int, profile, nodes: int = 1,
           steps: int = STEPS) -> int:
    """Run each planned layout of `ranked` and print the comparison; 1 when a run failed."""
    if nodes > 1:
        print(f"--verify runs on this machine only; on the cluster launch each of these for {steps} steps:")
        for planned in ranked:
            print("  launch/run_pretrain.sh --config " + config + " " +
                  " ".join(user_overrides + overrides(planned.cfg, planned.layout, world)) + f" train.steps={steps}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="plan_verify_"))
    print(f"verify: {len(ranked)} layouts × {steps} steps on {world} local ranks (runs in {work})")
    print("| layout | predicted s | measured s | error | predicted GiB | measured GiB | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    for i, planned in enumerate(ranked):
        lines = user_overrides + overrides(planned.cfg, planned.layout, world)
        got = run_layout(config, lines, world, work / f"layout{i}", steps)
        name = planned.layout.name(world)
        if "error" in got:
            print(f"| {name} | run failed: {got['error']} | | | | | |")
            failed = True
            continue
        pt, mt = planned.prediction.total, got["step_s"]
        pm = estimate(planned.cfg, world)[0].peak + profile.memory_base_bytes + profile.engine_memory_bytes
        mm = got["peak_bytes"]
        print(f"| {name} | {pt:.3g} | {mt:.3g} | {100 * (pt - mt) / mt:+.0f}% | {pm / 2**30:.2f} | {mm / 2**30:.2f} | "
              f"{100 * (pm - mm) / mm:+.0f}% |", flush=True)
    return 1 if failed else 0
