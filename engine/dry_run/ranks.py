"""Which ranks a dry run simulates, and the checks of --world-size and --ranks before any rank runs."""
from __future__ import annotations

from engine.config.schema import Config, ConfigError
from parallel.topology import Layout, LayoutError


def layout_of(cfg: Config, world_size: int) -> Layout:
    p = cfg.parallel
    try:
        return Layout.for_world(world_size, p.tensor, p.pipeline, p.rank_order, p.context)
    except LayoutError as exc:
        raise ConfigError(f"--world-size {world_size}: {exc}; give a multiple of parallel.tensor × parallel.context "
                          f"× parallel.pipeline = {p.tensor * p.context * p.pipeline}") from None


def cover(layout: Layout) -> list[int]:
    """Every distinct TP × CP × PP coordinate, each with the first and the last data-parallel rank: every
    tensor-, context- and pipeline-parallel group of those two replicas whole, and both ends of every
    data-parallel group."""
    ranks = set()
    for tp in range(layout.tp):
        for cp in range(layout.cp):
            for pp in range(layout.pp):
                for dp in {0, layout.dp - 1}:
                    ranks.add(layout.rank_of(tp=tp, cp=cp, pp=pp, dp=dp))
    return sorted(ranks)


def chosen_ranks(spec: str, layout: Layout) -> list[int]:
    """--ranks: "all", "cover" or a list "0,5,8-11"; a rank outside the world is refused with the fix."""
    world = layout.world_size
    if spec == "all":
        return list(range(world))
    if spec == "cover":
        return cover(layout)
    ranks = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"--ranks {spec!r}: {part!r} is not a rank or a range; give all, cover or a list "
                              f"such as 0,5,8-11") from None
        for rank in (first, last):
            if not 0 <= rank < world:
                raise ConfigError(f"--ranks {spec!r}: rank {rank} is outside the world of --world-size {world}; "
                                  f"give ranks 0-{world - 1}")
        ranks.update(range(first, last + 1))
    return sorted(ranks)
