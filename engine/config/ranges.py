"""Bounds of the numeric configuration fields, by one rule over the dataclasses: a field listed in RANGES has
its own bounds, every other int or float field must be ≥ 0; floats are always finite and integers always fit
in 64 bits. A field added to a config dataclass is therefore checked without being named here.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Interval:
    """The values a numeric field accepts; an open end excludes its bound. Whatever the bounds, a float must be
    finite and an integer fit in 64 bits (every count ends up in a tensor, an array index or a seed)."""

    low: float
    high: float = math.inf
    open_low: bool = False
    open_high: bool = False

    def __contains__(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value) or isinstance(value, int) and abs(value) > INT64_MAX:
            return False
        return ((value > self.low if self.open_low else value >= self.low)
                and (value < self.high if self.open_high else value <= self.high))

    def __str__(self) -> str:
        if self.low == -math.inf and self.high == math.inf:
            return "finite"
        if self.high == math.inf:
            return f"{'>' if self.open_low else '≥'} {self.low}"
        return f"within {'(' if self.open_low else '['}{self.low}, {self.high}{')' if self.open_high else ']'}"


AT_LEAST_ONE, POSITIVE, FRACTION, BELOW_ONE = Interval(1), Interval(0, open_low=True), Interval(0, 1), \
    Interval(0, 1, open_high=True)

# Bounds that differ from the rule for every other numeric field, ≥ 0 (see field_range); a list[int] field's
# bound applies to each element.
RANGES = {
    **{("model", k): AT_LEAST_ONE for k in ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                                             "vocab_size", "seq_length")},
    ("model", "rope_theta"): POSITIVE, ("model", "norm_eps"): POSITIVE, ("model", "init_std"): POSITIVE,
    ("model", "attention_dropout"): BELOW_ONE, ("model", "hidden_dropout"): BELOW_ONE,
    **{("parallel", k): AT_LEAST_ONE for k in ("tensor", "context", "pipeline", "virtual_stages", "stage_layers")},
    ("parallel", "zero_stage"): Interval(0, 3),
    ("parallel", "timeout_minutes"): Interval(0, 10**6, open_low=True),  # ~2 years; far beyond, timedelta overflows
    ("parallel", "bucket_mb"): POSITIVE,
    ("parallel", "unit_group_count"): AT_LEAST_ONE,
    **{("train", k): AT_LEAST_ONE for k in ("micro_batch_size", "global_batch_size", "steps", "log_interval",
                                             "eval_iters")},
    ("train", "seed"): Interval(0, 2**32 - 1),
    ("train", "batch_size_ramp"): AT_LEAST_ONE,
    ("optim", "min_lr_ratio"): FRACTION, ("optim", "decay_fraction"): FRACTION,
    ("optim", "offload_fraction"): FRACTION,
    ("optim", "muon_ns_steps"): Interval(1, 99),  # torch.optim.Muon refuses 100 or more
    ("optim", "muon_ns_coefficients"): Interval(-math.inf),  # any finite number (b is negative)
    ("optim", "beta1"): BELOW_ONE, ("optim", "beta2"): BELOW_ONE, ("optim", "eps"): POSITIVE,
    ("data", "eod_token_id"): Interval(-1),  # -1 = the tokenizer's end-of-document token
    ("checkpoint", "keep"): AT_LEAST_ONE,
    ("checkpoint", "upload_part_mb"): AT_LEAST_ONE, ("checkpoint", "upload_threads"): AT_LEAST_ONE,
    ("run", "max_memory_fragmentation"): BELOW_ONE,
    ("run", "straggler_threshold"): Interval(1),  # a ratio to the median: below 1 the median rank itself is slow
    ("run", "spike_window"): Interval(2),  # a standard deviation needs two losses
}


def field_range(section: str, key: str) -> Interval:
    """A numeric field's bounds: RANGES, else ≥ 0, so a field added later is checked without being listed."""
    return RANGES.get((section, key), Interval(0))


@functools.cache
def type_hints(cls) -> dict:
    """A section's field types, resolved once (typing.get_type_hints is slow, and the planner validates
    thousands of candidate layouts)."""
    return typing.get_type_hints(cls)


def range_problem(cfg) -> str | None:
    """The first int or float field (or list element) of a Config outside its field_range, as one line
    naming the key, the value and the bounds; None when all are within. Checked before any other validation
    divides by, allocates or loops over one of them."""
    for section in dataclasses.fields(cfg):
        target = getattr(cfg, section.name)
        for name, key, listed, bounds in numeric_fields(section.name, type(target)):
            value = getattr(target, name)
            for where, v in [(f"{key}[{i}]", v) for i, v in enumerate(value)] if listed else [(key, value)]:
                if v not in bounds:
                    need = ("a finite number" + ("" if str(bounds) == "finite" else f" {bounds}") if isinstance(v, float) else
                            f"{bounds} and fit in 64 bits" if abs(v) > INT64_MAX else str(bounds))
                    shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
                    return f"{where}={shown} must be {need}"
    return None


@functools.cache
def numeric_fields(section: str, cls) -> tuple:
    """(field, section.field, whether a list, its field_range) of each int, float, list[int] or list[float] field of
    a section, in field order: resolved once, since the planner validates thousands of candidate layouts."""
    hints = type_hints(cls)
    return tuple((f.name, f"{section}.{f.name}", hints[f.name] in (list[int], list[float]), field_range(section, f.name))
                 for f in dataclasses.fields(cls) if hints[f.name] in (int, float, list[int], list[float]))
