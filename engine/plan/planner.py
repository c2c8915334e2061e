"""Rank the layouts of a world size: enumerate (engine/plan/layouts.py), keep those that fit
(engine/plan/fit.py), predict each one's step time (engine/plan/time_model.py), fastest first; and the
pre-flight's warning when the configured layout is predicted far slower than the best that fits.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config.schema import Config, data_parallel_size
from engine.memory_estimate import StageMemory, gib
from engine.plan.fit import MARGIN, fullest_stage, usable_bytes
from engine.plan.layouts import Layout, Space, enumerate_layouts, overrides
from engine.plan.profile import DeviceProfile
from engine.plan.time_model import Prediction, predict

SLOWER_WARNING = 1.3  # the pre-flight warns when the chosen layout is predicted this much slower than the best


@dataclass
class Planned:
    layout: Layout
    cfg: Config
    memory: StageMemory  # the fullest stage's estimate
    prediction: Prediction

    @property
    def peak_bytes(self) -> int:
        return self.memory.peak


@dataclass
class Plan:
    ranked: list  # [Planned], fastest first
    enumerated: int
    fitting: int


def plan(cfg: Config, world_size: int, profile: DeviceProfile, device_memory: int, gpus_per_node: int,
         space: Space | None = None, margin: float = MARGIN) -> Plan:
    """Every valid layout that fits `device_memory` (0 = no limit) less `margin`, fastest predicted first."""
    space = space or Space(gpus_per_node=gpus_per_node)
    valid = enumerate_layouts(cfg, world_size, space)
    limit = usable_bytes(device_memory, margin) if device_memory else None
    ranked = []
    for layout, changed in valid:
        memory = fullest_stage(changed, world_size)
        if limit is None or memory.peak <= limit:
            ranked.append(Planned(layout, changed, memory, predict(changed, world_size, profile, gpus_per_node)))
    ranked.sort(key=lambda p: p.prediction.total)
    return Plan(ranked, len(valid), len(ranked))


def describe(planned: Planned, world_size: int, rank: int) -> str:
    tokens = planned.cfg.train.global_batch_size * planned.cfg.model.seq_length
    pred, mem = planned.prediction, planned.memory
    return (f"{rank}. {planned.layout.name(world_size)}: step {pred.total:.3g} s ({tokens / pred.total:,.0f} tok/s), "
            f"memory {gib(mem.peak)} per rank at its peak\n     time: {pred.summary()}\n"
            f"     memory (stage {mem.stage}): "
            f"parameters {gib(mem.parameters)}, gradients {gib(mem.gradients)}, optimizer {gib(mem.optimizer)}, "
            f"activations {gib(mem.activations)} ({mem.in_flight:g} in flight), comm buffers "
            f"{gib(mem.comm_buffers)}, loss transients {gib(mem.transient)}")


def warning(cfg: Config, world_size: int, profile: DeviceProfile, device_memory: int, gpus_per_node: int,
            space: Space | None = None) -> str | None:
    """A line when `cfg`'s own layout is predicted more than SLOWER_WARNING × slower than the fastest layout
    that fits, naming that layout's overrides; None otherwise (or when nothing else fits)."""
    mine = predict(cfg, world_size, profile, gpus_per_node).total
    result = plan(cfg, world_size, profile, device_memory, gpus_per_node, space)
    if not result.ranked:
        return None
    best = result.ranked[0]
    ratio = mine / best.prediction.total
    if ratio <= SLOWER_WARNING:
        return None
    p = cfg.parallel
    dp = data_parallel_size(cfg, world_size)
    return (f"layout TP{p.tensor} CP{p.context} PP{p.pipeline} DP{dp} ZeRO {p.zero_stage} recompute "
            f"{cfg.train.recompute} micro batch {cfg.train.micro_batch_size} is predicted {ratio:.2f}× slower "
            f"({mine:.3g} s/step) than {best.layout.name(world_size)} ({best.prediction.total:.3g} s/step, "
            f"profile {profile.device}{'' if profile.measured else ', assumed'}): "
            + " ".join(overrides(cfg, best.layout, world_size)))
