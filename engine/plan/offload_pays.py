"""When optimizer offload pays: the step ratio (offload on / off) the time model predicts for a run, and the
tokens per step per GPU from which it stays within RATIO_GOAL (docs/offload.md derives the bound).

The ratio is (T + X) / T with T the step time without offload and X what engine/plan/offload_cost.py adds; X does
not depend on the number of micro-batches, T grows with it, so the ratio falls as the tokens per step grow, and
the smallest number of micro-batches that meets the goal is found by doubling, then bisection. optim.offload_overlap
"auto" is predicted as on: the steady state once steps stop clipping (a clipping step pays what "false" pays).
"""
from __future__ import annotations

import dataclasses

from engine.config.schema import Config, data_parallel_size
from engine.plan.time_model import predict

RATIO_GOAL = 1.3
MOST_MICRO_BATCHES = 1 << 16


def tokens_per_gpu(cfg: Config, world_size: int) -> int:
    return cfg.train.global_batch_size * cfg.model.seq_length // world_size


def with_micro_batches(cfg: Config, world_size: int, micro_batches: int) -> Config:
    """`cfg` with as many micro-batches per step (the global batch changed, the micro-batch kept)."""
    batch = micro_batches * cfg.train.micro_batch_size * data_parallel_size(cfg, world_size)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=batch))


def step_ratio(cfg: Config, world_size: int, profile, gpus_per_node: int) -> float:
    """Predicted step time with cfg's optim.offload_fraction over the same run without offload."""
    off = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, offload_fraction=0.0))
    return predict(cfg, world_size, profile, gpus_per_node).total / predict(off, world_size, profile, gpus_per_node).total


def speculation_pays(cfg: Config, world_size: int, profile, gpus_per_node: int) -> bool:
    """Whether optim.offload_overlap's speculative host steps are predicted to shorten the step (what "auto"
    decides from, engine/data_parallel.py)."""
    def total(overlap: str) -> float:
        changed = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, offload_overlap=overlap))
        return predict(changed, world_size, profile, gpus_per_node).total
    return total("true") < total("false")


def tokens_to_meet(cfg: Config, world_size: int, profile, gpus_per_node: int, goal: float = RATIO_GOAL) -> int | None:
    """The fewest tokens per step per GPU (whole micro-batches) at which the predicted ratio is at most `goal`;
    None if not even MOST_MICRO_BATCHES micro-batches meet it."""
    def meets(m: int) -> bool:
        return step_ratio(with_micro_batches(cfg, world_size, m), world_size, profile, gpus_per_node) <= goal
    high = 1
    while not meets(high):
        if high >= MOST_MICRO_BATCHES:
            return None
        high *= 2
    low = high // 2  # fails (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if meets(mid) else (mid, high)
    return tokens_per_gpu(with_micro_batches(cfg, world_size, high), world_size)


def offload_warning(cfg: Config, world_size: int, profile, gpus_per_node: int) -> str | None:
    """One line when optim.offload_fraction is predicted to make the step more than RATIO_GOAL × slower, naming
    the tokens per step per GPU that would meet it; None otherwise."""
    if cfg.optim.offload_fraction <= 0:
        return None
    ratio = step_ratio(cfg, world_size, profile, gpus_per_node)
    if ratio <= RATIO_GOAL:
        return None
    need = tokens_to_meet(cfg, world_size, profile, gpus_per_node)
    assumed = "" if profile.host_measured and profile.measured else ", partly assumed"
    where = (f"at least {need} tokens per step per GPU would meet {RATIO_GOAL}× (train.global_batch_size="
             f"{need * world_size // cfg.model.seq_length})" if need else f"no batch size meets {RATIO_GOAL}×")
    return (f"optim.offload_fraction={cfg.optim.offload_fraction:g} is predicted to take {ratio:.2f}× the step time "
            f"of no offload at {tokens_per_gpu(cfg, world_size)} tokens per step per GPU (profile {profile.device}"
            f"{assumed}); {where}, or lower optim.offload_fraction")


def offload_report(cfg: Config, world_size: int, profile, gpus_per_node: int) -> str:
    """For tools/estimate_memory.py: the predicted ratio, the tokens per step per GPU that meet RATIO_GOAL, and
    the warning when the run's own do not."""
    ratio = step_ratio(cfg, world_size, profile, gpus_per_node)
    need = tokens_to_meet(cfg, world_size, profile, gpus_per_node)
    host = "measured" if profile.host_measured else "assumed"
    line = (f"  offload step time: {ratio:.2f}× no offload at {tokens_per_gpu(cfg, world_size)} tokens per step per "
            f"GPU, ≤ {RATIO_GOAL}× from {need if need else 'no'} tokens (profile {profile.device}, host side "
            f"{host}: PCIe {profile.pcie_bytes_per_s / 1e9:g} GB/s, host copies {profile.host_memory_bytes_per_s / 1e9:g}"
            f" GB/s and AdamW {profile.host_adamw_elements_per_s:.3g} elements/s per thread)")
    warning = offload_warning(cfg, world_size, profile, gpus_per_node)
    return line + (f"\n  WARNING {warning}" if warning else "")
