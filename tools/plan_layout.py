"""The fastest layout that fits: TP × CP × PP (virtual stages) × DP × ZeRO (HSDP) × recompute × micro batch.

    python tools/plan_layout.py --config launch/configs/llama_7b_64gpu.yaml --nodes 8 --gpus-per-node 8 --gpu-memory 80
    python tools/plan_layout.py --config FILE --nodes 1 --gpus-per-node 8 --gpu-memory 141 --global-batch 256
    python tools/plan_layout.py --calibrate --device cuda --nproc 8 --out engine/plan/profiles/gpu_bf16.json
    python tools/plan_layout.py --config FILE --nodes 1 --gpus-per-node 8 --verify 3
    python tools/plan_layout.py --config FILE --nodes 128 --gpus-per-node 8 --dry-run 3

Enumerates the layouts engine/config/schema.validate accepts (engine/plan/layouts.py), drops those whose fullest
rank's memory estimate exceeds --gpu-memory less --margin, predicts each one's step time from a device profile
(engine/plan/profiles/; --profile) and prints the five fastest with their memory and time breakdowns, then the
winner as section.key=value overrides for launch/run_pretrain.sh. --calibrate records a profile on this
machine's devices (tools/plan_calibrate.py); --verify K runs the K best for a few steps through
launch/run_pretrain.sh and prints predicted against measured step time and peak memory (tools/plan_verify.py);
across nodes it prints their launch lines and dry-runs them here (as --dry-run K, unless that is given);
--dry-run K simulates a covering sample of the K best's ranks on one CPU and checks their schedule, memory and
volumes against the estimate and the plan (tools/plan_dry_run.py).
docs/planner.md explains the model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.checkpoint.hf_weights import fill_model_from_hf  # noqa: E402
from engine.config.schema import ConfigError, load_config  # noqa: E402
from engine.memory_estimate import gib, parse_bytes  # noqa: E402
from engine.plan.fit import MARGIN  # noqa: E402
from engine.plan.layouts import overrides  # noqa: E402
from engine.plan.planner import describe, plan  # noqa: E402
from engine.plan.profile import default_profile, load_profile  # noqa: E402


def memory_arg(text: str) -> int:
    """'80' (GB), '80GB', '141GiB' -> bytes."""
    return parse_bytes(text + "GB" if text.replace(".", "", 1).isdigit() else text)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], prog="tools/plan_layout.py")
    ap.add_argument("--config", help="the run's YAML configuration")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8, help="devices (ranks) per node")
    ap.add_argument("--gpu-memory", default="", help="memory of one device: 80 (GB), 80GB, 141GiB; empty = no limit")
    ap.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: the config's)")
    ap.add_argument("--margin", type=float, default=MARGIN, help=f"share of device memory kept free (default "
                    f"{MARGIN:g}: CUDA context, library workspaces, fragmentation)")
    ap.add_argument("--profile", default="", help="device profile: a JSON file or a name under engine/plan/profiles "
                    "(default: cpu_fp32 for train.device=cpu, else a recorded gpu_<precision>, else h200_bf16_assumed)")
    ap.add_argument("--top", type=int, default=5, help="layouts printed")
    ap.add_argument("--verify", type=int, default=0, metavar="K", help="run the K best for a few steps and compare")
    ap.add_argument("--dry-run", type=int, default=0, metavar="K", help="simulate the K best on this CPU (fake "
                    "backend, meta device) and check schedule, memory and volumes")
    ap.add_argument("--calibrate", action="store_true", help="record a device profile here instead (its options: "
                    "tools/plan_layout.py --calibrate --help)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, as for training")
    args = ap.parse_args(argv)
    if not args.config:
        ap.error("--config is required (or --calibrate)")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--calibrate" in argv:
        from tools.plan_calibrate import main as calibrate
        return calibrate([a for a in argv if a != "--calibrate"])
    args = parse_args(argv)
    try:
        if min(args.nodes, args.gpus_per_node) < 1 or args.global_batch < 0 or args.top < 1 or args.verify < 0 \
                or args.dry_run < 0:
            raise ValueError("--nodes, --gpus-per-node and --top must be ≥ 1, --global-batch, --verify and "
                             "--dry-run ≥ 0")
        if not 0 <= args.margin < 1:
            raise ValueError(f"--margin {args.margin} must be a fraction in [0, 1)")
        device_memory = memory_arg(args.gpu_memory) if args.gpu_memory else 0
        cfg = load_config(args.config, args.overrides)
        fill_model_from_hf(cfg)
        if args.global_batch:
            cfg.train.global_batch_size = args.global_batch
        device = "cpu" if cfg.train.device == "cpu" else "cuda"
        profile = load_profile(args.profile or default_profile(device, cfg.train.precision))
    except (ConfigError, ValueError) as exc:
        print(f"plan_layout: {exc}", file=sys.stderr)
        return 2
    world = args.nodes * args.gpus_per_node
    result = plan(cfg, world, profile, device_memory, args.gpus_per_node, margin=args.margin)
    # --verify across nodes cannot run here: what this machine can check of those layouts is their dry run
    flag, dry = ("--dry-run", args.dry_run) if args.dry_run or args.nodes == 1 else ("--verify", args.verify)
    if result.ranked and dry > len(result.ranked):
        print(f"plan_layout: {flag} {dry}: only {len(result.ranked)} layouts fit; give at most "
              f"{len(result.ranked)}", file=sys.stderr)
        return 2
    m = cfg.model
    limit = f"{gib(device_memory)} per device less {args.margin:.0%} margin" if device_memory else "no memory limit"
    print(f"{world} ranks ({args.nodes} × {args.gpus_per_node}), {limit}; "
          f"model {m.num_layers}×{m.hidden_size}, seq {m.seq_length}, global batch {cfg.train.global_batch_size}, "
          f"{cfg.train.precision}")
    print(f"profile: {profile.device} — {'measured' if profile.measured else 'ASSUMED (not measured)'}: "
          f"{profile.source}")
    print(f"{result.enumerated} valid layouts, {result.fitting} fit")
    if not result.ranked:
        print("no layout fits: add devices or memory, or lower the global batch", file=sys.stderr)
        return 1
    for i, planned in enumerate(result.ranked[:args.top], 1):
        print(describe(planned, world, i))
    best = result.ranked[0]
    print("the fastest as overrides for launch/run_pretrain.sh:")
    print("  " + " ".join(overrides(cfg, best.layout, world)))
    status = 0
    if dry:
        from tools.plan_dry_run import dry_run
        status = dry_run(result.ranked[:dry], world)
    if args.verify:
        from tools.plan_verify import verify
        status = max(status, verify(args.config, args.overrides, result.ranked[:args.verify], world, profile,
                                    args.nodes))
    return status


if __name__ == "__main__":
    sys.exit(main())
