"""How far to trust the layout planner: every layout of a space on 8 CPU ranks (gloo), predicted against measured.

    python tools/bench_planner.py [--nproc 8] [--steps 2] [--profile fresh|cpu_fp32|FILE] [--budget 300]
    python tools/bench_planner.py --rescore DIR [--profile cpu_fp32]     (an earlier run's measurements, today's model)

At the peer benchmark's shape (the config defaults: hidden 256, 4 layers, 8 heads, FFN 688, vocabulary 8,192,
sequence 256; global batch 8, fp32, synthetic data) the planner enumerates the layouts of --nproc ranks in the
benchmark's space (TP 1-8, CP 1-2, PP 1-4 with one chunk per rank (1F1B, ZB-H1) or two (interleaved, ZBV), ZeRO 0/3,
no recomputation, micro batch 1: engine/plan/layouts.Space; ZeRO 3 refuses the zero-bubble schedules) and
predicts each one's step time and memory, from a profile calibrated first in the same run (--profile fresh, the
default: tools/plan_calibrate.py at the benchmark's shapes, ~40 s; the machine's load changes the numbers more
than anything the model leaves out) or a stored one. One torchrun job of --nproc ranks then trains each layout
in turn (one job, because starting 8 ranks costs ~50 s here). Peak memory is measured as the estimate counts it,
and as torch.cuda.max_memory_allocated would on a GPU: the most bytes of live tensors during the second step,
everything the layout allocated since its Trainer was built included (engine/observe/tensor_peak.py replays
torch.profiler's allocation events), the largest rank's, against the estimate's fullest stage at its peak
(engine/memory_estimate.py: held tensors and the loss's transients). Those two steps run under the profiler,
which slows them, so step time is rank 0's median of --steps further steps. Layouts run in a shuffled
order (fixed seed) until --budget seconds have passed, so that the whole benchmark stays within ~6 minutes; then
the first layout runs once more, and its change over the job is printed (the job's drift: the machine's load,
or state the job accumulates).
Printed: the table, the Spearman rank correlation of predicted and measured step times, the measured time of
the predicted best against the measured best, and the median absolute errors of step time and memory.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config.schema import Config, from_dict, to_dict  # noqa: E402
from engine.plan.fit import peak_bytes  # noqa: E402
from engine.plan.layouts import Space, apply, overrides  # noqa: E402
from engine.plan.planner import plan  # noqa: E402
from engine.plan.profile import load_profile  # noqa: E402
from engine.plan.time_model import predict  # noqa: E402

# 53 layouts of 8 ranks (8 ZB-H1, 5 ZBV, 10 interleaved); --budget cuts a shuffled sample of them
SPACE = Space(tensor=(1, 2, 4, 8), context=(1, 2), pipeline=(1, 2, 4), virtual_stages=(1, 2),
              stage_balance=("layers",), zero_stage=(0, 3), hsdp=False, recompute=("none",), micro_batch_size=(1,))


def base_config(run_dir: str) -> Config:
    cfg = Config()
    cfg.train.global_batch_size, cfg.train.precision, cfg.train.device = 8, "fp32", "cpu"
    cfg.train.log_interval, cfg.optim.warmup_steps, cfg.optim.schedule = 1, 0, "constant"
    cfg.data.mock, cfg.run.dir = True, run_dir
    return cfg


def spearman(xs: list, ys: list) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


# -- the job: every layout in turn on the same ranks --------------------------------------------------------
def measure(base: Config, lines: list, run_dir: str, env, steps: int) -> dict:
    """One layout on these ranks: its step time (rank 0's median of `steps`) and the largest rank's peak."""
    import torch

    from engine.observe.tensor_peak import TensorPeak
    from engine.train import Trainer, setup_run_dir
    from parallel import comm
    from parallel.distributed import world_group
    cfg = apply(base, lines + [f"run.dir={run_dir}"])
    groups = comm.registered_groups()
    gc.collect()
    setup_run_dir(cfg, env.rank)
    with TensorPeak() as peak:  # the first step creates the optimizer state: the second is the steady peak
        trainer = Trainer(cfg, env)
        trainer.train_step()
        with peak.measuring():
            trainer.train_step()
    try:
        times = [trainer.train_step()["step_time_s"] for _ in range(steps)]
    finally:
        trainer.loader.close()
    worst = torch.tensor([float(peak.bytes)], dtype=torch.float64)
    comm.all_reduce(worst, world_group(), op=torch.distributed.ReduceOp.MAX)
    del trainer
    comm.destroy_groups_since(groups)  # the layout's groups, whose threads and sockets would pile up
    return {"step_s": statistics.median(times), "peak_bytes": worst.item()}


def worker(plan_file: str, out_file: str, steps: int, budget: float) -> None:
    import torch

    from parallel import comm
    from parallel.distributed import init_distributed, shutdown, world_group
    job = json.loads(Path(plan_file).read_text())
    env = init_distributed("cpu", "gloo", 10.0)
    base = from_dict(job["base"])
    results = []
    start = time.perf_counter()
    for i, lines in enumerate(job["layouts"]):
        late = torch.tensor([float(time.perf_counter() - start > budget)])
        comm.all_reduce(late, world_group(), op=torch.distributed.ReduceOp.MAX)  # rank 0's clock decides alike
        if late.item():
            break
        results.append(measure(base, lines, f"{base.run.dir}/{i}", env, steps))
        if env.rank == 0:
            print(f"layout {i + 1}/{len(job['layouts'])}: {results[-1]}", flush=True)
    # the first layout again: a step time that changed over the job is drift of the job, not of the layouts
    again = measure(base, job["layouts"][0], f"{base.run.dir}/again", env, steps)
    if env.rank == 0:
        Path(out_file).write_text(json.dumps(results))
        Path(out_file).with_name("again.json").write_text(json.dumps(again))
    shutdown(True)


# -- the driver ---------------------------------------------------------------------------------------------
def report(jobs: list, measured: list, profile, nproc: int) -> None:
    """The table and the summary of (layout name, configuration) `jobs` against their measurements."""
    print("| layout | predicted s | measured s | error | predicted MiB | measured MiB | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    predicted, time_err, mem_err = [], [], []
    for (name, cfg), m in zip(jobs, measured):
        pt, mt = predict(cfg, nproc, profile, nproc).total, m["step_s"]
        pm, mm = peak_bytes(cfg, nproc), m["peak_bytes"]
        predicted.append(pt)
        time_err.append(abs(pt - mt) / mt)
        mem_err.append(abs(pm - mm) / mm)
        print(f"| {name} | {pt:.3f} | {mt:.3f} | {100 * (pt - mt) / mt:+.0f}% | {pm / 2**20:.1f} | {mm / 2**20:.1f} | "
              f"{100 * (pm - mm) / mm:+.0f}% |")
    times = [m["step_s"] for m in measured]
    best_predicted = times[predicted.index(min(predicted))]
    print(f"Spearman (predicted vs measured step time): {spearman(predicted, times):.2f}")
    print(f"predicted best measured {best_predicted:.3f} s vs measured best {min(times):.3f} s: "
          f"{100 * (best_predicted / min(times) - 1):.0f}% slower")
    print(f"median |step time error| {100 * statistics.median(time_err):.0f}%, median |memory error| "
          f"{100 * statistics.median(mem_err):.0f}%")


def rescore(work: Path, profile_name: str, nproc: int) -> int:
    """A finished run's measurements (plan.json, results.json in `work`) against today's model and `profile`."""
    job = json.loads((work / "plan.json").read_text())
    measured = json.loads((work / "results.json").read_text())
    base = from_dict(job["base"])
    jobs = [(" ".join(lines), apply(base, lines)) for lines in job["layouts"][:len(measured)]]
    jobs = [(f"{c.parallel.tensor}/{c.parallel.context}/{c.parallel.pipeline}/{c.parallel.virtual_stages} "
             f"{c.parallel.schedule}/Z{c.parallel.zero_stage}", c) for _, c in jobs]
    print(f"rescoring {len(measured)} measured layouts in {work} (TP/CP/PP/v schedule/ZeRO) with profile "
          f"{profile_name}")
    report(jobs, measured, load_profile(profile_name), nproc)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per layout (after two profiled for memory)")
    ap.add_argument("--profile", default="fresh", help="fresh (calibrate first, in this run), or a stored profile")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds of measuring after which no layout starts")
    ap.add_argument("--rescore", metavar="DIR", help="predict an earlier run's measurements (its directory) again, "
                    "with --profile (default cpu_fp32)")
    ap.add_argument("--worker", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.steps, args.budget)
        return 0
    if args.rescore:
        return rescore(Path(args.rescore), "cpu_fp32" if args.profile == "fresh" else args.profile, args.nproc)
    work = Path(tempfile.mkdtemp(prefix="bench_planner_"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    if args.profile == "fresh":
        args.profile = str(work / "profile.json")
        subprocess.run([sys.executable, str(ROOT / "tools/plan_layout.py"), "--calibrate", "--nproc", str(args.nproc),
                        "--micro-batches", "1", "--out", args.profile], cwd=ROOT, env=env, check=True)
    cfg = base_config(str(work / "runs"))
    profile = load_profile(args.profile)
    result = plan(cfg, args.nproc, profile, 0, args.nproc, SPACE)
    chosen = sorted(result.ranked, key=lambda p: p.layout.name(args.nproc))
    random.Random(0).shuffle(chosen)  # a cut by --budget leaves a sample of the space, not its first names
    plan_file, out_file = work / "plan.json", work / "results.json"
    plan_file.write_text(json.dumps({"base": to_dict(cfg),
                                     "layouts": [overrides(cfg, p.layout, args.nproc) for p in chosen]}))
    print(f"{len(chosen)} of {result.enumerated} valid layouts of {args.nproc} CPU ranks (gloo), profile "
          f"{profile.device}; 2 steps for memory + {args.steps} timed steps each, one job", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           str(Path(__file__).resolve()), "--steps", str(args.steps), "--budget", str(args.budget),
           "--worker", str(plan_file), str(out_file)]
    done = subprocess.run(cmd, cwd=ROOT, env=env)
    if done.returncode:
        print(f"bench_planner: the job failed with status {done.returncode}; run directories in {work}",
              file=sys.stderr)
        return 1
    measured = json.loads(out_file.read_text())
    print(f"measured {len(measured)} of {len(result.ranked)} layouts within --budget {args.budget:.0f} s "
          f"(kept in {work}: --rescore it after changing the model)")
    again = json.loads((work / "again.json").read_text())["step_s"]
    print(f"drift: the first layout ({chosen[0].layout.name(args.nproc)}) measured again after the last: {again:.3f} s "
          f"vs {measured[0]['step_s']:.3f} s at the start ({100 * (again / measured[0]['step_s'] - 1):+.0f}%)")
    report([(p.layout.name(args.nproc), p.cfg) for p in chosen], measured, profile, args.nproc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
