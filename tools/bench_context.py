"""Context parallelism's attention, forward + backward of one layer, per strategy: allgather, ring through the
reference path (model.attention_backend=reference: fp32 scores, one (query chunk, key chunk) pair at a time) and
ring through the fused kernel (auto: aten's flash kernel per unmasked pair, on CPU its CPU kernel).

c gloo ranks on this machine (one thread each), causal attention over s = c · seq-per-rank tokens, bf16 by default.
Rounds interleave the variants (their order rotates per round); a variant's time is the median over rounds of the
slowest rank's time for `--iters` forward + backward passes, after one warm-up pass. Ratios are against the fused
ring in the same run.

    python tools/bench_context.py [--contexts 2,4] [--seq-per-rank 4096] [--heads 8 --kv-heads 2 --head-dim 64]
        [--rounds 3] [--iters 1] [--dtype bf16|fp32]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = (("allgather", "allgather", "auto"), ("ring (reference)", "ring", "reference"),
            ("ring (fused)", "ring", "auto"))


def _rank_main(rank: int, world: int, port: int, args, results) -> None:
    import torch.distributed as dist

    from parallel import comm
    from parallel.context import ContextParallel
    from parallel.topology import Layout, Topology
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    topo = Topology(Layout(cp=world), rank)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(rank)
    n = args.seq_per_rank
    q = torch.randn(1, args.heads, n, args.head_dim, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(1, args.kv_heads, n, args.head_dim, generator=gen).to(dtype).requires_grad_()
            for _ in range(2))
    grad = torch.randn(1, args.heads, n, args.head_dim, generator=gen).to(dtype)
    times: dict = {name: [] for name, _, _ in VARIANTS}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        order = VARIANTS[round_ % len(VARIANTS):] + VARIANTS[:round_ % len(VARIANTS)]
        for name, strategy, backend in order:
            cp = ContextParallel.from_topology(topo, strategy)
            comm.barrier(topo.cp_group)
            start = time.perf_counter()
            for _ in range(args.iters if round_ else 1):
                cp.attention(q, k, v, backend=backend).backward(grad)
            took = torch.tensor([time.perf_counter() - start])
            comm.all_reduce(took, topo.cp_group, op=dist.ReduceOp.MAX)
            if round_:
                times[name].append(took.item() / args.iters)
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def measure(world: int, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    times = results.get(timeout=3600)
    for p in procs:
        p.join()
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="2,4")
    parser.add_argument("--seq-per-rank", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args(argv)
    print("| CP | s per rank | heads (KV) × d | dtype | " + " | ".join(f"{n} s" for n, _, _ in VARIANTS)
          + " | reference ring / fused ring | fused ring / allgather |")
    print("| --- " * (len(VARIANTS) + 6) + "|")
    for world in (int(c) for c in args.contexts.split(",")):
        times = {name: statistics.median(t) for name, t in measure(world, args).items()}
        fused = times["ring (fused)"]
        print(f"| {world} | {args.seq_per_rank} | {args.heads} ({args.kv_heads}) × {args.head_dim} | {args.dtype} | "
              + " | ".join(f"{times[n]:.3f}" for n, _, _ in VARIANTS)
              + f" | {times['ring (reference)'] / fused:.2f}× | {fused / times['allgather']:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
