"""The fit filter: a layout fits when the memory estimate's fullest rank at its peak (engine/memory_estimate.py:
the tensors held, counted tensor by tensor as the engine allocates, and the loss's transients) stays below the
device's memory less a margin.

The margin (MARGIN, 10% by default) covers what the estimate does not count: the CUDA context and the
libraries' workspaces (cuBLAS, NCCL: several hundred MiB), the caching allocator's fragmentation, and the
temporaries of other kernels that live only inside them.
"""
from __future__ import annotations

from engine.config.schema import Config
from engine.memory_estimate import StageMemory, estimate

MARGIN = 0.10


def fullest_stage(cfg: Config, world_size: int) -> StageMemory:
    """The memory estimate of the pipeline stage whose ranks reach the highest peak."""
    return max(estimate(cfg, world_size), key=lambda stage: stage.peak)


def peak_bytes(cfg: Config, world_size: int) -> int:
    """Most live tensor bytes on the fullest rank (the largest pipeline stage peak)."""
    return fullest_stage(cfg, world_size).peak


def usable_bytes(device_memory: int, margin: float = MARGIN) -> int:
    return int(device_memory * (1 - margin))


def fits(cfg: Config, world_size: int, device_memory: int, margin: float = MARGIN) -> bool:
    return peak_bytes(cfg, world_size) <= usable_bytes(device_memory, margin)
