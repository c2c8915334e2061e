"""The candidate layouts of a world size: every combination of the parallel sizes and per-rank settings that
engine/config/schema.validate accepts, so nothing the engine would refuse is ever proposed.

A `Layout` is written to a configuration as `section.key=value` overrides, the form launch/run_pretrain.sh and
engine.config.schema.load_config take. Sequence parallelism is on whenever TP > 1 (it saves activation memory
for the same communication volume); v = 1 uses 1F1B (GPipe holds every micro-batch for the same bubble) or
ZB-H1, v ≥ 2 the interleaved schedule, v = 2 also ZBV (ZeRO-2/3 refuse the zero-bubble schedules); pipeline chunks split by even layer counts or even compute (parallel.stage_balance).
A layout plans one recompute mode and micro batch for the whole run, so it turns a configured mid-run switch
(train.recompute_switch_step) off; settings the layout makes invalid (hierarchical_node_size beside HSDP or CP,
or not dividing the data-parallel size) are turned off with it.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass

from engine.config.schema import Config, ConfigError, apply_overrides, from_dict, to_dict, validate
from parallel.zero_bubble_plan import ZERO_BUBBLE, chunks_per_rank

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    context: int = 1
    pipeline: int = 1
    virtual_stages: int = 1
    zero_stage: int = 0
    hsdp_group_size: int = 0
    recompute: str = "none"
    micro_batch_size: int = 1
    stage_balance: str = "layers"  # parallel.stage_balance: even layer counts, or even compute
    schedule: str = ""  # parallel.schedule; empty: 1f1b, or interleaved with virtual stages

    @property
    def pipeline_schedule(self) -> str:
        return self.schedule or ("interleaved" if self.virtual_stages > 1 else "1f1b")

    def data_parallel(self, world_size: int) -> int:
        return world_size // (self.tensor * self.context * self.pipeline)

    def name(self, world_size: int) -> str:
        parts = [f"TP{self.tensor}"] + ([f"CP{self.context}"] if self.context > 1 else [])
        parts.append(f"PP{self.pipeline}" + (f"v{self.virtual_stages}" if self.virtual_stages > 1 else "")
                     + ("(compute-balanced)" if self.stage_balance == "compute" else "")
                     + (f" {self.schedule}" if self.schedule in ZERO_BUBBLE else ""))
        parts.append(f"DP{self.data_parallel(world_size)}")
        zero = f"Z{self.zero_stage}" + (f"/HSDP{self.hsdp_group_size}" if self.hsdp_group_size else "")
        return " ".join(parts) + f" {zero} rc={self.recompute} mb={self.micro_batch_size}"


@dataclass
class Space:
    """The values tried for each setting; the default is the whole space the engine supports, a benchmark
    narrows it."""

    tensor: tuple = (1, 2, 4, 8)
    context: tuple = (1, 2, 4, 8)
    pipeline: tuple = (1, 2, 4, 8, 16)
    virtual_stages: tuple = (1, 2, 4)
    stage_balance: tuple = ("layers", "compute")  # with PP > 1
    zero_bubble: tuple = ZERO_BUBBLE  # also tried with PP > 1: zb-h1 with one chunk per rank, zbv with two
    zero_stage: tuple = (0, 1, 2, 3)
    hsdp: bool = True  # also HSDP groups of one node's worth of data-parallel ranks
    recompute: tuple = RECOMPUTE
    micro_batch_size: tuple = (1, 2, 4, 8)
    gpus_per_node: int = 8


def settings(cfg: Config, layout: Layout, world_size: int) -> dict[tuple[str, str], object]:
    """{(section, key): value} that turn `cfg` into `layout` on `world_size` ranks."""
    p, t = cfg.parallel, cfg.train
    out = {("parallel", "tensor"): layout.tensor, ("parallel", "context"): layout.context,
           ("parallel", "pipeline"): layout.pipeline, ("parallel", "virtual_stages"): layout.virtual_stages,
           ("parallel", "schedule"): layout.pipeline_schedule,
           ("parallel", "sequence_parallel"): layout.tensor > 1, ("parallel", "zero_stage"): layout.zero_stage,
           ("parallel", "hsdp_group_size"): layout.hsdp_group_size, ("train", "recompute"): layout.recompute,
           ("train", "micro_batch_size"): layout.micro_batch_size, ("parallel", "stage_balance"): layout.stage_balance}
    node = p.hierarchical_node_size
    if node and (layout.hsdp_group_size or layout.context > 1 or layout.data_parallel(world_size) % node):
        out["parallel", "hierarchical_node_size"] = 0
    if p.stage_layers:  # the user's split was for their pipeline; the planner splits by parallel.stage_balance
        out["parallel", "stage_layers"] = []
    if t.recompute_switch_step or t.micro_batch_size_after_switch:
        out["train", "recompute_switch_step"] = 0
        out["train", "micro_batch_size_after_switch"] = 0
    return out


def overrides(cfg: Config, layout: Layout, world_size: int) -> list[str]:
    """`section.key=value` lines that turn `cfg` into `layout` on `world_size` ranks."""
    def text(value) -> str:
        return ("true" if value else "false") if isinstance(value, bool) else "[]" if value == [] else str(value)
    return [f"{section}.{key}={text(value)}" for (section, key), value in settings(cfg, layout, world_size).items()]


def configure(cfg: Config, layout: Layout, world_size: int) -> Config:
    """`cfg` set to `layout` (what applying `overrides` gives, without parsing text): new parallel and train
    sections, the others shared with `cfg` (read, never changed)."""
    changes: dict = {}
    for (section, key), value in settings(cfg, layout, world_size).items():
        changes.setdefault(section, {})[key] = value
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)
                                       for section, fields in changes.items()})


def apply(cfg: Config, lines: list[str]) -> Config:
    """`cfg` with the override lines applied, through the same parser as the command line's."""
    return from_dict(apply_overrides(copy.deepcopy(to_dict(cfg)), lines))


def candidates(cfg: Config, world_size: int, space: Space):
    """Every combination of `space` whose sizes multiply into `world_size` (not yet validated)."""
    batch = cfg.train.global_batch_size
    for t, c, pp in itertools.product(space.tensor, space.context, space.pipeline):
        if world_size % (t * c * pp):
            continue
        dp = world_size // (t * c * pp)
        pipelined = [(v, balance, schedule) for v, balance in itertools.product(space.virtual_stages,
                                                                              space.stage_balance)
                     for schedule in ("",) + tuple(z for z in space.zero_bubble if chunks_per_rank(z) == v)]
        for v, balance, schedule in pipelined if pp > 1 else [(1, "layers", "")]:
            for zero in space.zero_stage:
                groups = [0]
                node_dp = space.gpus_per_node // (t * c)  # data-parallel ranks on one node
                if space.hsdp and zero > 0 and c == 1 and 1 < node_dp < dp and dp % node_dp == 0:
                    groups.append(node_dp)
                for hsdp, rc, mb in itertools.product(groups, space.recompute, space.micro_batch_size):
                    if batch % (mb * dp) == 0:
                        yield Layout(t, c, pp, v, zero, hsdp, rc, mb, balance, schedule)


def enumerate_layouts(cfg: Config, world_size: int, space: Space | None = None) -> list[tuple[Layout, Config]]:
    """(layout, its configuration) for every candidate the configuration validator accepts."""
    space = space or Space()
    out = []
    for layout in candidates(cfg, world_size, space):
        try:
            changed = configure(cfg, layout, world_size)
            validate(changed, world_size)
        except ConfigError:
            continue
        out.append((layout, changed))
    return out
