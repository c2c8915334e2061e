"""What launch/run_pretrain.sh checks before it starts any rank: the configuration loads and validates for
the world size (--preflight: the pre-flight's scaled-down one, engine/preflight.py), CUDA is usable if GPUs
were asked for (parallel/device.py), every checkpoint.mirrors location can be written (a test object is
written and deleted), every s3:// dataset of data.paths is listed with its .idx and .bin (data/s3_shards.py;
their bytes are checked when the node-local cache fetches them), and (--lock) no live training holds run.dir. A failure is one line and
exit status 2 (1 for an unreadable Hugging Face checkpoint.load), as from a rank, without torchrun's report
of a failed child.

    python launch/check.py --world-size 8 [--lock | --preflight [--steps N]] --config FILE [section.key=value ...]
"""
from __future__ import annotations

import argparse
import sys

from engine.config.schema import ConfigError, load_config, validate
from engine.run_lock import check_free
from parallel.device import DeviceUnavailable, check_requested_device


def fill_model_from_checkpoint(cfg) -> bool:
    """model.* from a Hugging Face checkpoint.load directory, as the ranks take it before they validate
    (engine/train.py); False, after its one line, when the directory is unreadable."""
    from engine.checkpoint.files import CheckpointError  # these import torch: only for a run that loads
    from engine.checkpoint.hf_weights import fill_model_from_hf
    try:
        fill_model_from_hf(cfg)
    except CheckpointError as exc:
        print(f"trilith: checkpoint error: {exc}", file=sys.stderr)
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="launch/check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, required=True, help="ranks the launch will start")
    parser.add_argument("--lock", action="store_true", help="also refuse a run.dir that a live training holds")
    parser.add_argument("--config", required=True, help="YAML run configuration")
    parser.add_argument("--preflight", action="store_true", help="check the pre-flight's configuration")
    parser.add_argument("--steps", type=int, help="the pre-flight's steps (engine.preflight's option)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.checkpoint.load and not fill_model_from_checkpoint(cfg):
            return 1
        if args.preflight:
            from engine.preflight import STEPS, preflight_config  # imports torch: only for a pre-flight
            preflight_config(cfg, args.world_size, args.steps or STEPS)
        else:
            validate(cfg, args.world_size)
        check_requested_device(cfg.train.device)
        if args.lock:
            check_free(cfg.run.dir)
    except (ConfigError, DeviceUnavailable) as exc:
        print(f"trilith: configuration error: {exc}", file=sys.stderr)
        return 2
    return 2 if location_problems(cfg) | remote_data_problems(cfg) else 0


def location_problems(cfg) -> bool:
    """Every checkpoint.mirrors location can be written now (engine/checkpoint/locations.py): one line for
    each that cannot, naming it and what to set."""
    if not (cfg.checkpoint.mirrors or cfg.checkpoint.mirror_dir):
        return False
    from engine.checkpoint.locations import check_locations  # imports torch and boto3: only for mirrors
    problems = check_locations(cfg.checkpoint)
    for problem in problems:
        print(f"trilith: checkpoint location error: {problem}", file=sys.stderr)
    return bool(problems)


def remote_data_problems(cfg) -> bool:
    """Every s3:// prefix of data.paths (and of the stages) is there, and the store accepts the credentials:
    one line for each that is not."""
    from data.paths import parse_paths
    from data.s3_client import S3Error
    from data.s3_shards import S3Shards, is_s3
    d = cfg.data
    lists = ([d.paths] if d.paths else []) + [stage["paths"] for stage in d.stages]
    urls = dict.fromkeys(p for paths in lists for _, p in parse_paths(paths) if is_s3(p))
    problems = []
    for url in urls if not d.mock else []:
        try:
            S3Shards(url).list()
        except S3Error as exc:
            problems.append(str(exc))
    for problem in problems:
        print(f"trilith: configuration error: {problem}", file=sys.stderr)
    return bool(problems)


if __name__ == "__main__":
    sys.exit(main())
