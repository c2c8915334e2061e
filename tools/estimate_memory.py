"""Will this configuration fit? Bytes per rank before any process starts (engine/memory_estimate.py).

    python tools/estimate_memory.py --config launch/configs/llama_7b_64gpu.yaml --world-size 64 --device-memory 80GB
    python tools/estimate_memory.py --config FILE --world-size 8 parallel.zero_stage=3 train.recompute=full
    python tools/estimate_memory.py --config launch/configs/llama_7b_64gpu_long.yaml --world-size 64 parallel.context=8
    python tools/estimate_memory.py --config launch/configs/llama_7b_64gpu.yaml --world-size 64 --device-memory 80GB \
        --host-memory 1TB --ranks-per-node 8 optim.offload_fraction=1

Prints, for each pipeline stage (every rank of a stage holds the same), the parameters, gradients, optimizer
state, activations (micro-batches the schedule holds at once × one micro-batch's) and communication buffers,
their total against --device-memory, and, when it does not fit, the single setting that saves the most. Under
context parallelism (parallel.context=c) a rank's activations are those of s/c tokens, and ZeRO shards over
DP × CP. With optim.offload_fraction the optimizer state kept in host memory is shown apart, per rank and per
node of --ranks-per-node ranks, against --host-memory, and the step time offload is predicted to cost against
none (engine/plan/offload_pays.py, from --profile: by default the recorded GPU profile of the precision, else the
assumed H200 one), with the tokens per step per GPU from which it stays within 1.3×. The pre-flight
(engine/preflight.py) prints the same estimate, refuses a fraction whose host state does not fit the node and warns
when the predicted ratio exceeds 1.3.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.checkpoint.hf_weights import fill_model_from_hf  # noqa: E402
from engine.config.schema import ConfigError, load_config, validate  # noqa: E402
from engine.memory_estimate import parse_bytes, report  # noqa: E402
from engine.plan.offload_pays import offload_report  # noqa: E402
from engine.plan.profile import default_profile, load_profile  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], prog="tools/estimate_memory.py")
    parser.add_argument("--config", required=True, help="the run's YAML configuration")
    parser.add_argument("--world-size", type=int, default=0,
                        help="ranks of the run (default: parallel.tensor × parallel.context × parallel.pipeline, "
                             "one data-parallel rank)")
    parser.add_argument("--device-memory", default="", help="memory of one device, e.g. 80GB (GB = GiB = 2**30)")
    parser.add_argument("--host-memory", default="", help="memory of one node, e.g. 1TB (judged with offload)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks sharing a node's host memory (8)")
    parser.add_argument("--profile", default="", help="device profile for offload's step time (a name under "
                        "engine/plan/profiles/ or a file; default: the GPU one of train.precision)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, as for training")
    args = parser.parse_args(argv)
    try:
        device_memory = parse_bytes(args.device_memory) if args.device_memory else 0
        host_memory = parse_bytes(args.host_memory) if args.host_memory else 0
        if args.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node {args.ranks_per_node}: give the ranks on one node (≥ 1)")
        if args.world_size < 0:
            raise ValueError(f"--world-size {args.world_size}: give the number of ranks (≥ 1), or leave it out")
        cfg = load_config(args.config, args.overrides)
        fill_model_from_hf(cfg)
        world = args.world_size or cfg.parallel.tensor * cfg.parallel.context * cfg.parallel.pipeline
        validate(cfg, world)
        profile = load_profile(args.profile or default_profile("cuda", cfg.train.precision)) \
            if cfg.optim.offload_fraction > 0 else None
    except (ConfigError, ValueError) as exc:
        print(f"estimate_memory: {exc}", file=sys.stderr)
        return 2
    print(report(cfg, world, device_memory, host_memory, min(args.ranks_per_node, world)))
    if profile is not None:
        print(offload_report(cfg, world, profile, min(args.ranks_per_node, world)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
