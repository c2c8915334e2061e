"""Run a small pipeline locally, record its schedule, and print bubble fractions and activation peaks.

    python tools/pipeline_trace.py --pipeline 4 --micro-batches 8 --schedule 1f1b
    python tools/pipeline_trace.py --pipeline 4 --micro-batches 8 --schedule interleaved --virtual 2
    python tools/pipeline_trace.py --pipeline 2 --schedule gpipe model.hidden_size=128

Starts p gloo ranks on this machine (PP=p, TP=DP=1) from a config (default launch/configs/tiny.yaml plus
overrides), runs `--steps` training steps and traces the last one. For each stage it prints the measured
bubble — idle time over the span from the first slot on any stage to the last — next to the analytic
(p−1)/(m+p−1) (GPipe, 1F1B) or (p−1)/(v·m+p−1) (interleaved), and the peak number of micro-batch
activations held (1F1B: ≤ p; GPipe: m). Measured bubbles include transfer time and, when ranks share
fewer cores than there are stages, CPU contention: read them as a check of the schedule's shape.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.plan.bubble import analytic_bubble  # noqa: E402


def bubble_fractions(traces: list[list[tuple]]) -> list[float]:
    """traces[stage] = [(kind, micro_batch, chunk, start, end), ...] of one step, on one clock."""
    start = min(e[3] for t in traces for e in t)
    span = max(e[4] for t in traces for e in t) - start
    return [1.0 - sum(e[4] - e[3] for e in t) / span for t in traces]


def timeline(traces: list[list[tuple]], width: int = 96) -> list[str]:
    """One line per stage: F slots as the micro-batch digit, B slots as letters a, b, c ..., W slots (weight
    gradients computed after the input gradient was sent) as A, B, C ... (mod 10/26)."""
    start = min(e[3] for t in traces for e in t)
    span = max(e[4] for t in traces for e in t) - start
    lines = []
    for t in traces:
        row = [" "] * width
        for kind, mb, _, s, e in t:
            lo = int((s - start) / span * width)
            hi = max(int((e - start) / span * width), lo + 1)
            mark = str(mb % 10) if kind == "F" else chr(ord("a" if kind == "B" else "A") + mb % 26)
            for i in range(lo, min(hi, width)):
                row[i] = mark
        lines.append("".join(row))
    return lines


def _worker(rank: int, world: int, port: int, args, results) -> None:
    import torch
    import torch.distributed as dist

    from engine.config.schema import load_config
    from engine.train import Trainer
    from parallel.distributed import DistEnv
    from parallel.pipeline_schedules import ScheduleTrace
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = load_config(args.config, _overrides(args))
        trainer = Trainer(cfg, DistEnv(rank, world))
        for step in range(args.steps):
            if step == args.steps - 1:
                trainer.schedule_trace = ScheduleTrace(trainer.env.device)
            trainer.train_step()
        trace = trainer.schedule_trace
        results.put((trainer.topo.pp_rank, trace.events, trace.peak_live))
    finally:
        dist.destroy_process_group()


def _overrides(args) -> list[str]:
    mbs = args.micro_batch_size
    return [f"parallel.pipeline={args.pipeline}", f"parallel.schedule={args.schedule}",
            f"parallel.virtual_stages={args.virtual}", f"train.micro_batch_size={mbs}",
            f"train.global_batch_size={mbs * args.micro_batches}", f"train.steps={args.steps}",
            "train.device=cpu", *args.overrides]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", type=int, default=4, help="pipeline stages p (= processes started)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step m")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved"))
    parser.add_argument("--virtual", type=int, default=1, help="model chunks per rank v (interleaved)")
    parser.add_argument("--steps", type=int, default=3, help="steps to run; the last one is traced")
    parser.add_argument("--config", default=str(ROOT / "launch/configs/tiny.yaml"))
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. model.num_layers=8")
    args = parser.parse_args(argv)

    from engine.config.schema import ConfigError, load_config, validate
    try:
        validate(load_config(args.config, _overrides(args)), args.pipeline)
    except ConfigError as exc:
        print(f"pipeline_trace: configuration error: {exc}", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, args.pipeline, port, args, results)) for r in range(args.pipeline)]
    for proc in procs:
        proc.start()
    gathered = sorted(results.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    traces = [events for _, events, _ in gathered]
    p, m, v = args.pipeline, args.micro_batches, args.virtual
    expected = analytic_bubble(args.schedule, p, m, v)
    print(f"schedule {args.schedule}: p={p} m={m} v={v}; analytic bubble {expected:.3f}; digits = forward, "
          f"lower-case letters = backward, upper-case = its deferred weight gradients")
    for stage, (line, measured, (_, _, peak)) in enumerate(zip(timeline(traces), bubble_fractions(traces),
                                                                 gathered)):
        print(f"stage {stage}: bubble {measured:.3f} (analytic {expected:.3f})  peak live micro-batches {peak:>2}"
              f"  |{line}|")
    return 0


if __name__ == "__main__":
    sys.exit(main())
