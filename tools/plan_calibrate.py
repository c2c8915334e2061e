"""Record a device profile for the layout planner: compute, optimizer and link speeds measured here.

    python tools/plan_layout.py --calibrate --nproc 8 --out engine/plan/profiles/cpu_fp32.json
    python tools/plan_layout.py --calibrate --device cuda --precision bf16 --nproc 8 \
        --config launch/configs/llama_7b_64gpu.yaml --out engine/plan/profiles/gpu_bf16.json

Starts --nproc ranks on this machine (gloo on CPU, NCCL on CUDA, one GPU each) that measure at the same time
(engine/plan/calibrate.py): one transformer layer and the output layer at the --config model's widths divided
by each TP size in --tensor and each micro batch in --micro-batches; the same two as each TP × CP layout of
--tensor × --context runs them on its own groups (sequence parallel under TP, as the planner lays out), with
their collectives; one AdamW step; the host side of optimizer offload (casts, AdamW per thread, on a GPU the
pinned PCIe copies: engine/plan/calibrate.measure_host); and all-reduce /
all-gather / reduce-scatter over groups of 2 ... --nproc ranks, fit as latency + seconds per byte (the
"intra" link). Across nodes ("inter") nothing is measured: the profile keeps --inter-from's link, and says so.
Compute rows are the median over ranks. On a GPU node run it once per device type and precision; the planner
picks engine/plan/profiles/gpu_<precision>.json up by itself.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import tempfile
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LINK_SIZES = (1 << 16, 1 << 20, 1 << 23)  # bytes per collective buffer: latency- to bandwidth-bound
CALIBRATION_REPEATS = 5  # timed calls per compute shape (the median): ranks sharing cores measure in bursts


def shapes(args):
    """(tensor, micro batch) pairs the model's head count allows."""
    from engine.config.schema import load_config
    cfg = load_config(args.config) if args.config else None
    heads = cfg.model.num_attention_heads if cfg else 8
    return [(t, b) for t in args.tensor if heads % t == 0 for b in args.micro_batches]


def parallel_shapes(args) -> list:
    """(tensor, context, micro batch) of the TP × CP layouts measured on their groups: every pair but (1, 1)
    that fits in --nproc ranks and divides the heads and the sequence."""
    from engine.config.schema import load_config
    cfg = load_config(args.config) if args.config else None
    heads = cfg.model.num_attention_heads if cfg else 8
    seq = cfg.model.seq_length if cfg else 256
    return [(t, c, b) for t in args.tensor for c in args.context if t * c > 1 and t * c <= args.nproc
            and heads % t == 0 and seq % (2 * c * t) == 0 for b in args.micro_batches]


def worker(rank: int, args, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from engine.config.schema import load_config
    from engine.plan import calibrate
    from engine.plan.profile import parallel_key
    from engine.preflight import memory_mb  # imports engine.train: a training rank's modules, in the base below
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    try:
        base = int(memory_mb(device) * 2**20) if device.type == "cpu" else 0
        layer, head = [], []
        for t, b in shapes(args):
            cfg = load_config(args.config, [f"parallel.tensor={t}", f"train.micro_batch_size={b}",
                                            f"train.precision={args.precision}"])
            dist.barrier()
            row_layer, row_head = calibrate.measure_compute(cfg, device, CALIBRATION_REPEATS)
            layer.append(row_layer)
            head.append(row_head)
        parallel: dict = {}
        for t, c, b in parallel_shapes(args):
            cfg = load_config(args.config, [f"parallel.tensor={t}", f"parallel.context={c}",
                                            f"parallel.sequence_parallel={str(t > 1).lower()}",
                                            f"train.micro_batch_size={b}", f"train.precision={args.precision}"])
            groups = calibrate.parallel_groups(cfg, args.nproc, rank)
            dist.barrier()
            if groups:
                tables = parallel.setdefault(parallel_key(cfg), {"layer": [], "head": []})
                row_layer, row_head = calibrate.measure_calls(cfg, cfg.model, *groups, device,
                                                              CALIBRATION_REPEATS)
                tables["layer"].append(row_layer)
                tables["head"].append(row_head)
        dist.barrier()
        optimizer = calibrate.measure_optimizer(device)
        links = calibrate.measure_links(args.nproc, rank, device, LINK_SIZES)
        overhead = calibrate.measure_overhead(rank, args.nproc, device, tempfile.gettempdir() + "/trilith-calibrate")
        results.put((rank, layer, head, optimizer, links, base, overhead, parallel))
    finally:
        dist.destroy_process_group()


def median_rows(per_rank: list) -> list:
    return [[rows[0][0], statistics.median(r[1] for r in rows), statistics.median(r[2] for r in rows)]
            for rows in zip(*per_rank)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], prog="tools/plan_layout.py --calibrate")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    ap.add_argument("--nproc", type=int, default=8, help="ranks measured at once (one per GPU on CUDA)")
    ap.add_argument("--config", default="", help="the model whose shapes are measured (default: the config "
                    "defaults, the peer benchmark's shape)")
    ap.add_argument("--tensor", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8],
                    help="TP sizes whose local widths are measured (comma-separated)")
    ap.add_argument("--context", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                    help="CP sizes whose layouts are measured on their groups with each --tensor size "
                         "(comma-separated)")
    ap.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                    help="micro batch sizes measured (comma-separated)")
    ap.add_argument("--inter-from", default="h200_bf16_assumed", help="profile whose across-node link is kept")
    ap.add_argument("--out", required=True, help="the profile JSON to write")
    args = ap.parse_args(argv)
    if args.nproc < 2 or not shapes(args):
        ap.error("--nproc must be ≥ 2 and --tensor must hold a size dividing the head count")
    import torch.multiprocessing as mp

    import torch

    from engine.plan import calibrate
    from engine.plan.calibrate import engine_overhead, fit_link
    from engine.plan.profile import DeviceProfile, load_profile
    cores = os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // args.nproc) if args.device == "cpu" else 8))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(args.nproc)]
    for proc in procs:
        proc.start()
    gathered = sorted(results.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    inter = load_profile(args.inter_from).links["inter"]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    name = f"{args.device} {args.precision}, {args.nproc} ranks at once"
    profile = DeviceProfile(
        device=name, measured=True, precision=args.precision,
        source=f"measured by tools/plan_layout.py --calibrate on {platform.node() or 'this machine'} ({cores} cores) "
               f"{when}; the across-node link is {args.inter_from}'s, not measured",
        layer=median_rows([g[1] for g in gathered]), head=median_rows([g[2] for g in gathered]),
        optimizer_s_per_element=statistics.median(g[3] for g in gathered),
        links={"intra": fit_link([p for g in gathered for p in g[4]]), "inter": vars(inter)},
        ranks=args.nproc, shared_cores=cores if args.device == "cpu" else 0,
        memory_base_bytes=int(statistics.median(g[5] for g in gathered)),
        engine_memory_bytes=int(statistics.median(g[6][1] for g in gathered)),
        parallel={key: {kind: median_rows([g[7][key][kind] for g in gathered if key in g[7]]) for kind in tables}
                  for key, tables in gathered[0][7].items()})
    # the host side of optimizer offload, measured here once the ranks are done (the machine otherwise idle)
    for key, value in calibrate.measure_host(torch.device(args.device)).items():
        setattr(profile, key, value)
    times = [statistics.median(step) for step in zip(*(g[6][0] for g in gathered))]
    profile.step_overhead_s, profile.micro_batch_overhead_s = engine_overhead(profile, times, args.nproc, args.device)
    profile.save(args.out)
    print(f"wrote {args.out}: {len(profile.layer)} compute shapes, {len(profile.parallel)} TP × CP layouts on "
          f"their groups ({', '.join(profile.parallel)}), link intra {profile.links['intra']}, "
          f"AdamW {profile.optimizer_s_per_element * 1e9:.2f} ns/element, engine overhead "
          f"{profile.step_overhead_s * 1e3:.1f} ms per step + {profile.micro_batch_overhead_s * 1e3:.1f} ms per "
          f"micro-batch, engine memory {profile.engine_memory_bytes / 2**20:.0f} MiB; offload's host side: casts "
          f"{profile.host_memory_bytes_per_s / 1e9:.2f} GB/s and AdamW {profile.host_adamw_elements_per_s:.3g} "
          f"elements/s per thread, PCIe {profile.pcie_bytes_per_s / 1e9:.1f} GB/s"
          f"{'' if args.device == 'cuda' else ' (assumed)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
