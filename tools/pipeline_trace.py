"""Run a small pipeline locally, record its schedule, and print bubble fractions and activation peaks.

    python tools/pipeline_trace.py --pipeline 4 --micro-batches 8 --schedule 1f1b
    python tools/pipeline_trace.py --pipeline 4 --micro-batches 8 --schedule interleaved --virtual 2
    python tools/pipeline_trace.py --pipeline 2 --schedule gpipe model.hidden_size=128
    python tools/pipeline_trace.py --pipeline 4 --micro-batches 8 --schedule zbv model.num_layers=8
    python tools/pipeline_trace.py --pipeline 4 --micro-batches 8 --compare model.num_layers=8

Starts p gloo ranks on this machine (PP=p, TP=DP=1) from a config (default launch/configs/tiny.yaml plus
overrides), runs `--steps` training steps and traces the last one. For each stage it prints the measured
bubble — idle time over the span from the first slot on any stage to the last — next to the analytic
(p−1)/(m+p−1) (GPipe, 1F1B), (p−1)/(v·m+p−1) (interleaved) or the zero-bubble plan's (engine/plan/bubble.py),
and the peak number of chunk activations held (1F1B: ≤ p; GPipe: m; ZB-H1 and ZBV hold one from its F to its
W: p stages' worth at most). Two idle fractions are read from the trace's slots: measured, the time no slot of
the stage ran, which includes transfers and, when ranks share fewer cores than there are stages, CPU
contention; and replayed (engine/plan/trace_replay.py), the step's slots rerun in each rank's recorded order,
each at the shortest duration of its rank's slots of the same work and as soon as its inputs are done,
transfers free: the schedule's bubble at the slots' real costs, without the cores' waits. A slot's duration
there is the CPU time its rank's thread spent in it (ScheduleTrace.compute_events; GPU time on CUDA), not
the wall-clock time, which on shared cores includes the waits for one; each stage's line of slot costs
gives the F:B:W ratio the replay used. `--compare` traces
1F1B, interleaved (v = --virtual), ZB-H1 and ZBV in turn and prints a table.
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
from engine.plan.trace_replay import replayed_idle, slot_costs  # noqa: E402


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
    from parallel import comm
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
        trace, trainer.schedule_trace = trainer.schedule_trace, None  # the traced step's slots only
        with comm.RECORD.capture() as record:  # one more step, to count its messages
            trainer.train_step()
        sends = sum(1 for e in record if e.op == "send" and e.group == "pp")
        results.put((trainer.topo.pp_rank, trace.events, trace.compute_events, trace.peak_live, sends))
    finally:
        dist.destroy_process_group()


def _overrides(args) -> list[str]:
    mbs = args.micro_batch_size
    return [f"parallel.pipeline={args.pipeline}", f"parallel.schedule={args.schedule}",
            f"parallel.virtual_stages={virtual_of(args)}", f"train.micro_batch_size={mbs}",
            f"train.global_batch_size={mbs * args.micro_batches}", f"train.steps={args.steps}",
            "train.device=cpu", *args.overrides]


def virtual_of(args) -> int:
    """Model chunks per rank: --virtual for interleaved, 2 for zbv, else 1."""
    return {"interleaved": args.virtual, "zbv": 2}.get(args.schedule, 1)


def run_traced(args) -> list:
    """[(pp rank, events, peak live)] of the traced step, one entry per stage."""
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
    return gathered


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", type=int, default=4, help="pipeline stages p (= processes started)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step m")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved", "zb-h1", "zbv"))
    parser.add_argument("--virtual", type=int, default=2, help="model chunks per rank v (interleaved; zbv has 2)")
    parser.add_argument("--steps", type=int, default=3, help="steps to run; the last one is traced")
    parser.add_argument("--compare", action="store_true",
                        help="trace 1f1b, interleaved, zb-h1 and zbv in turn and print one table row each")
    parser.add_argument("--config", default=str(ROOT / "launch/configs/tiny.yaml"))
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. model.num_layers=8")
    args = parser.parse_args(argv)

    from engine.config.schema import ConfigError, load_config, validate
    schedules = ("1f1b", "interleaved", "zb-h1", "zbv") if args.compare else (args.schedule,)
    for schedule in schedules:
        try:
            validate(load_config(args.config, _overrides(argparse.Namespace(**{**vars(args), "schedule": schedule}))),
                     args.pipeline)
        except ConfigError as exc:
            print(f"pipeline_trace: configuration error ({schedule}): {exc}", file=sys.stderr)
            return 2
    if args.compare:
        print("schedule     v  analytic  replayed idle (mean, max)  measured idle (mean, max)  "
              "peak live (max, in stages)  sends/step")
    for schedule in schedules:
        args.schedule = schedule
        report(args, run_traced(args), table=args.compare)
    return 0


def report(args, gathered: list, table: bool) -> None:
    """Per stage: measured idle fraction, the analytic one, peak live activations (in chunks) and the timeline;
    with `table`, one row for the schedule."""
    traces = [events for _, events, _, _, _ in gathered]
    computed = [events for _, _, events, _, _ in gathered]  # each slot as long as its thread computed
    p, m, v = args.pipeline, args.micro_batches, virtual_of(args)
    expected = analytic_bubble(args.schedule, p, m, v)
    measured = bubble_fractions(traces)
    replayed = replayed_idle(computed, args.schedule)
    peaks = [peak for _, _, _, peak, _ in gathered]
    if table:
        print(f"{args.schedule:<12}{v:>2}  {expected:8.3f}  {sum(replayed) / p:14.3f} {max(replayed):8.3f}"
              f"{sum(measured) / p:18.3f} {max(measured):8.3f}"
              f"{max(peaks) / v:>20.2f} ({max(peaks)} of 1/{v}){sum(s for *_, s in gathered):>12}")
        return
    print(f"schedule {args.schedule}: p={p} m={m} v={v}; analytic bubble {expected:.3f}; digits = forward, "
          f"lower-case letters = backward (input gradient), upper-case = its weight gradients")
    for stage, (line, idle, again, peak) in enumerate(zip(timeline(traces), measured, replayed, peaks)):
        print(f"stage {stage}: replayed bubble {again:.3f}, measured {idle:.3f} (analytic {expected:.3f})  "
              f"peak live micro-batches {peak:>2}  |{line}|")
    for stage, trace in enumerate(computed):
        print(f"stage {stage}: slot costs (shortest, ms) {describe_costs(slot_costs(trace))}")


def describe_costs(costs: dict) -> str:
    """F, B and W per chunk as the replay charges them; "BW" is a B that computed its weight gradients too,
    a B is only the input gradient (its W ran in a slot of its own)."""
    names = {(kind, split): "B" if kind == "B" and split else "BW" if kind == "B" else kind
             for kind, _, split in costs}
    return "  ".join(f"{names[kind, split]}{chunk} {cost * 1e3:.1f}"
                     for (kind, chunk, split), cost in sorted(costs.items(), key=lambda kv: (kv[0][1], "FBW".index(
                         kv[0][0]), kv[0][2])))


if __name__ == "__main__":
    sys.exit(main())
