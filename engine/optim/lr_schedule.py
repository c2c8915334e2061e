"""Learning-rate schedules: linear warmup, then cosine / linear / constant / warmup-stable-decay / two-phase.

two_phase: cosine for the first (1 - decay_fraction) of the post-warmup steps, then a straight line to
min_lr_ratio × peak (e.g. 0.8 / 0.2 and 15% of peak).
"""
import math

from engine.config.schema import OptimConfig


def lr_at(step: float, total_steps: float, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`. Under a batch-size ramp both are
    fractional, counted in samples (engine/batch_ramp.lr_position); warm-up then never overshoots the peak."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * min(step + 1, cfg.warmup_steps) / cfg.warmup_steps
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "linear":
        return peak - (peak - floor) * progress
    if cfg.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    knee = 1.0 - cfg.decay_fraction
    if cfg.schedule == "wsd":
        if progress <= knee:
            return peak
        return peak - (peak - floor) * (progress - knee) / cfg.decay_fraction
    if cfg.schedule == "two_phase":
        cosine = lambda p: floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731
        if progress <= knee:
            return cosine(progress)
        at_knee = cosine(knee)
        return at_knee - (at_knee - floor) * (progress - knee) / cfg.decay_fraction
    raise ValueError(f"unknown optim.schedule {cfg.schedule!r}")
