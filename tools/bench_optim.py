"""Optimizer-step time of Muon against AdamW at DP 1, 2 and 4 on CPU, under DDP and ZeRO-1 (and TP with
--tensor), and each rank's share of the Newton–Schulz work, which should fall as 1/(TP·DP)
(engine/optim/muon_owners.py: one owner per matrix among the stage's ranks, the TP slices gathered to it).

For each (TP, ZeRO stage, DP) one world of TP × DP gloo ranks (one thread each) builds the same model twice, with
optim.name=adamw and optim.name=muon, takes one training step with each (gradients and state exist), then times
`optimizer.step` of the two alternately, round by round, so that background load hits both alike. Per rank it
records the step's wall time and the CPU seconds of its own Newton–Schulz calls (CPU time, not wall: on a shared
machine DP ranks may outnumber the cores). Prints per layout the median step of each and their ratio, and per
rank the Newton–Schulz ms per step and its share of the FLOPs.

    python tools/bench_optim.py [--hidden 256 --layers 4 --ffn 688 --dp 1 2 4 --zero 0 1 --tensor 1 --rounds 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config.schema import from_dict, validate  # noqa: E402
from engine.optim import muon  # noqa: E402
from engine.train import Trainer  # noqa: E402
from parallel.distributed import DistEnv  # noqa: E402
from tests.distributed import free_port  # noqa: E402


def config(args, name: str, zero: int, dp: int, tp: int, run_dir: str):
    return from_dict({
        "model": dict(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.heads,
                      ffn_hidden_size=args.ffn, vocab_size=args.vocab, seq_length=args.seq),
        "train": dict(micro_batch_size=1, global_batch_size=dp, steps=10**6, log_interval=10**6),
        "optim": dict(name=name, muon_lr=0.02, muon_ns_dtype=args.ns_dtype), "data": dict(mock=True),
        "parallel": dict(zero_stage=zero, tensor=tp), "run": dict(dir=run_dir)})


def rank_main(rank: int, world: int, port: int, args, zero: int, tp: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ns_cpu = [0.0]
    orthogonalise = muon.orthogonalise

    def timed(*a, **k):  # the owner exchange calls muon.orthogonalise: count this rank's CPU seconds in it
        start = time.thread_time()
        out = orthogonalise(*a, **k)
        ns_cpu[0] += time.thread_time() - start
        return out

    muon.orthogonalise = timed
    with tempfile.TemporaryDirectory() as run_dir:
        trainers = {}
        for name in ("adamw", "muon"):
            cfg = config(args, name, zero, world // tp, tp, run_dir)
            validate(cfg, world)
            trainers[name] = Trainer(cfg, DistEnv(rank, world, 0, torch.device("cpu"), "gloo"))
            trainers[name].train_step()
        times = {"adamw": [], "muon": []}
        ns_cpu[0] = 0.0
        for r in range(args.rounds):
            for name in (("adamw", "muon") if r % 2 == 0 else ("muon", "adamw")):
                opt = trainers[name].optimizer
                dist.barrier()
                start = time.perf_counter()
                opt.step(trainers[name].cfg.optim.lr)
                times[name].append(time.perf_counter() - start)
        exchange = trainers["muon"].optimizer.muon.exchange
        owned = sum(muon.ns_flops(exchange.matrices[n].full_shape, args.ns_steps) for n in exchange.owned())
        total = sum(muon.ns_flops(m.full_shape, args.ns_steps) for m in exchange.matrices.values())
        results.put((rank, {k: statistics.median(v) for k, v in times.items()}, ns_cpu[0] / args.rounds,
                     owned / total, exchange.buffer_bytes(2 if args.ns_dtype == "bf16" else 4)))
    dist.destroy_process_group()


def run_layout(args, zero: int, dp: int, tp: int) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, dp * tp, port, args, zero, tp, results)) for r in range(dp * tp)]
    for p in procs:
        p.start()
    out = sorted(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--tensor", type=int, nargs="+", default=[1], help="TP sizes (the world is TP × DP ranks)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ns-dtype", choices=("bf16", "fp32"), default="bf16")
    args = ap.parse_args(argv)
    args.ns_steps = 5
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = {}  # per ZeRO stage: (the first layout's name, its slowest rank's Newton–Schulz ms)
    for zero in args.zero:
        for tp in args.tensor:
            for dp in args.dp:
                rows = run_layout(args, zero, dp, tp)
                adamw = statistics.median(r[1]["adamw"] for r in rows) * 1e3
                step = statistics.median(r[1]["muon"] for r in rows) * 1e3
                ns = max(r[2] for r in rows) * 1e3
                name = f"zero {zero} dp {dp}" + (f" tp {tp}" if tp > 1 else "")
                first, first_ns = base.setdefault(zero, (name.split(" ", 2)[2], ns))
                print(f"{name}: AdamW step {adamw:.1f} ms, Muon step {step:.1f} ms (ratio {step / adamw:.2f}); "
                      f"Newton–Schulz per rank max {ns:.1f} ms CPU ({ns / first_ns:.2f} of {first}), "
                      f"all-to-all buffers {rows[0][4] / 2**20:.2f} MiB")
                for rank, _, ns_rank, share, _ in rows:
                    print(f"  rank {rank}: Newton–Schulz {ns_rank * 1e3:.1f} ms CPU/step, {share:.0%} of the FLOPs")


if __name__ == "__main__":
    main()
