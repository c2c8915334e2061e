"""The pipeline bubble of a schedule: the idle fraction of a stage when every slot costs the same and transfers
are free. GPipe and 1F1B: (p−1)/(m+p−1); interleaved with v chunks per rank: (p−1)/(v·m+p−1); the zero-bubble
schedules (F, B and W one slot each): their plan's own idle fraction (parallel/zero_bubble_plan.py), which for
ZB-H1 with m ≥ p is (p−1)/(3m+p−1) and for ZBV with m ≥ 2p smaller still. tools/pipeline_trace.py measures it
on a real run's timeline."""
from __future__ import annotations

from parallel.zero_bubble_plan import ZERO_BUBBLE, idle_fraction


def analytic_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a stage with equal-cost slots and free transfers."""
    if schedule in ZERO_BUBBLE:
        return idle_fraction(schedule, p, m)
    chunks = v * m if schedule == "interleaved" else m
    return (p - 1) / (chunks + p - 1)


def bubble_time(schedule: str, p: int, m: int, v: int, busy: float) -> float:
    """Seconds a stage idles in a step whose slots keep it busy for `busy` seconds."""
    fraction = analytic_bubble(schedule, p, m, v)
    return busy * fraction / (1 - fraction)
