"""data.local_cache_dir at start: local rank 0 of each node copies the shards (data/local_cache.py) while the
node's other ranks wait, then every rank reads the node-local copies.

The wait is one all-reduce of a failure flag over all ranks, so it must end within parallel.timeout_minutes;
a copy that fails stops every rank with one line (the copier's names the file) instead of leaving the others
waiting.
An s3:// prefix in data.paths is fetched the same way (data/s3_shards.py); its failures name the object.
"""
from __future__ import annotations

import dataclasses

import torch

from data.local_cache import fill_cache, local_prefix
from data.paths import parse_paths
from data.s3_client import S3Error
from data.stages import parse_stages
from engine.config.schema import Config, ConfigError
from parallel import comm
from parallel.distributed import DistEnv, world_group


def _prefixes(paths) -> list[str]:
    return [prefix for _, prefix in parse_paths(paths)]


def _local_paths(paths, cache_dir: str) -> list[str]:
    """`paths` with each prefix replaced by its local copy, weights kept."""
    out = []
    for weight, prefix in parse_paths(paths):
        out += [repr(weight), local_prefix(prefix, cache_dir)]
    return out


def localize_data(cfg: Config, env: DistEnv) -> tuple[Config, dict]:
    """(cfg reading the node-local copies, the copy report of this rank: {} unless it copied). Without
    data.local_cache_dir (or on synthetic data), cfg unchanged."""
    d = cfg.data
    if not d.local_cache_dir or d.mock:
        return cfg, {}
    stages = parse_stages(d.stages)
    prefixes = [p for paths in ([d.paths] if d.paths else []) + [paths for _, paths in stages]
                for p in _prefixes(paths)]
    report, failure = {}, None
    if env.local_rank == 0:
        try:
            report = fill_cache(prefixes, d.local_cache_dir, d.cache_dir or None)
        except S3Error as exc:  # its line starts with the key that named the object
            failure = str(exc)
        except (OSError, ValueError) as exc:
            failure = f"data.local_cache_dir: {exc}"
    failed = torch.tensor([failure is not None], dtype=torch.int32, device=env.device)
    comm.all_reduce(failed, world_group())  # the node's other ranks wait here for the copy
    if failure:
        raise ConfigError(failure)
    if failed.item():
        raise ConfigError("data.local_cache_dir: copying the shards failed on another rank (its message names the "
                          "file and the fix)")
    local = dataclasses.replace(
        d, paths=_local_paths(d.paths, d.local_cache_dir) if d.paths else [], cache_dir="",
        stages=[{"until_step": until, "paths": _local_paths(paths, d.local_cache_dir)} for until, paths in stages])
    return dataclasses.replace(cfg, data=local), report
