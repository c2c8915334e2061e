"""The order of the zero-bubble schedules: for each pipeline rank, which slot runs at each tick, and at which
tick each activation and gradient crosses to its neighbour.

Qi et al., 2023 ("Zero Bubble Pipeline Parallelism") split a backward into B (the input gradient, which
the previous stage waits for) and W (the weight gradients, which nobody waits for), and fill the bubble
with W. Both schedules here are built by one list scheduler that runs every rank in unit-time ticks
(F = B = W = one tick, transfers free) and, on each rank and tick, runs the first of:
    B  of the oldest micro-batch whose output gradient has arrived (the later model chunk on a tie),
    F  of the next micro-batch whose input has arrived, while fewer than `limit` of this rank's chunk
       activations are held (an activation is held from its F until its W),
    W  of the oldest micro-batch whose B is done,
or idles. Each chunk's F, B and W run in micro-batch order, so every `.grad` sums its micro-batches in
1F1B's order: gradients are bit-identical to 1F1B's.

    zb-h1  one chunk per rank (stage = rank); limit p micro-batches on every rank, 1F1B's peak (rank 0's):
           1F1B's order with W moved into the cool-down. Bubble (p−1)/(3m+p−1) at equal slot costs,
           against 1F1B's (p−1)/(m+p−1).
    zbv    two chunks per rank placed as a V: model chunk c on rank c for c < p, on rank 2p−1−c after,
           so rank 0 holds the first and the last chunk and rank p−1 passes chunk p−1's output to chunk p
           itself. Limit 2p half-stage chunks, 1F1B's peak again; with m ≥ 2p the bubble is close to zero.

Any m ≥ 1 completes: the scheduler always has a W or a B to run while a rank is at its limit. The plan is a
pure function of (schedule, p, m), computed identically on every rank, so both ends of every message agree
on the tick of its exchange (the tick it is produced): the exchanges of a tick form one batch on each rank,
and every rank posts its batches in tick order, the rule that keeps NCCL from deadlocking.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

ZERO_BUBBLE = ("zb-h1", "zbv")


def chunks_per_rank(schedule: str) -> int:
    return 2 if schedule == "zbv" else 1


def stage_of(schedule: str, p: int, rank: int, chunk: int) -> int:
    """The model chunk (0 … chunks·p − 1) that `chunk` of pipeline rank `rank` holds."""
    return rank if chunk == 0 else 2 * p - 1 - rank


def place(schedule: str, p: int, stage: int) -> tuple[int, int]:
    """(rank, chunk) holding model chunk `stage`."""
    return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)


@dataclass
class Exchange:
    """One tick's batch on one rank: what it sends to rank ± 1 and which messages it receives from there.
    A message is (kind "act" | "grad", chunk on the receiver, micro-batch)."""
    send_next: tuple | None = None  # (chunk, micro-batch) of this rank's slot whose result goes to rank + 1
    send_prev: tuple | None = None
    recv_prev: tuple | None = None  # the message arriving from rank − 1
    recv_next: tuple | None = None


@dataclass
class RankPlan:
    slots: list = field(default_factory=list)  # (tick, kind "F" | "B" | "W", chunk, micro-batch)
    exchanges: dict = field(default_factory=dict)  # tick -> Exchange, after that tick's slot


def critical_order(schedule: str, p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The (kind "F" | "B", chunk, micro-batch) slots of `rank` in the order they run; W slots float."""
    if schedule == "zb-h1":  # 1F1B's: p − rank − 1 warm-up forwards, pairs, cool-down backwards
        warmup = min(p - rank - 1, m)
        order = [("F", 0, mb) for mb in range(warmup)]
        for mb in range(m - warmup):
            order += [("F", 0, mb + warmup), ("B", 0, mb)]
        return order + [("B", 0, mb) for mb in range(m - warmup, m)]
    # zbv: torch.distributed.pipelining's ScheduleZBVZeroBubble order (its W slots dropped), over
    # max(2p − 1, m) micro-batches, keeping those below m
    n = max(2 * p - 1, m)
    f, b = [0, 0], [0, 0]
    order = []

    def add(kind, chunk):
        counter = f if kind == "F" else b
        order.append((kind, chunk, counter[chunk]))
        counter[chunk] += 1
    for _ in range(2 * (p - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1)
        add("F", 0)
    for _ in range(p - rank):
        add("F", 1)
        add("B", 1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            add("F", 0)
        add("B", 0)
        add("F", 1)
        add("B", 1)
    for _ in range(rank):
        add("B", 0)
        add("B", 1)
    for _ in range(p - rank):
        add("B", 0)
    return [slot for slot in order if slot[2] < m]


@functools.lru_cache(maxsize=256)
def plan(schedule: str, p: int, m: int) -> tuple[RankPlan, ...]:
    """Every rank's plan of one step; raises if the scheduler ever stalls (a bug, never a hang later)."""
    v = chunks_per_rank(schedule)
    stages, limit = v * p, v * p
    done = {}  # (kind, stage, mb) -> tick it ran
    orders = [critical_order(schedule, p, m, rank) for rank in range(p)]
    position = [0] * p
    waiting_w = [[] for _ in range(p)]  # (chunk, mb) whose B ran, in order
    held = [0] * p
    plans = tuple(RankPlan() for _ in range(p))
    left, tick = 3 * stages * m, 0
    while left:
        for rank in range(p):
            slot = _choose(schedule, p, stages, limit, rank, tick, orders[rank], position[rank], done,
                           waiting_w[rank], held[rank])
            if slot is None:
                continue
            kind, chunk, mb = slot
            done[kind, stage_of(schedule, p, rank, chunk), mb] = tick
            if kind == "W":
                waiting_w[rank].pop(0)
                held[rank] -= 1
            else:
                position[rank] += 1
                held[rank] += kind == "F"
                if kind == "B":
                    waiting_w[rank].append((chunk, mb))
            plans[rank].slots.append((tick, kind, chunk, mb))
            _add_messages(schedule, p, stages, plans, rank, tick, kind, chunk, mb)
            left -= 1
        if tick > 6 * stages * m + 4 * p:
            raise RuntimeError(f"the {schedule} plan stalled at tick {tick} (p={p}, m={m})")
        tick += 1
    return plans


def _choose(schedule, p, stages, limit, rank, tick, order, position, done, waiting_w, held):
    """The next critical slot if its input has arrived (an F also needs room under `limit`), else the oldest W."""
    if position < len(order):
        kind, chunk, mb = order[position]
        stage = stage_of(schedule, p, rank, chunk)
        if kind == "F":
            need = [] if stage == 0 else [("F", stage - 1, mb)]
        else:
            need = [("F", stage, mb)] + ([] if stage == stages - 1 else [("B", stage + 1, mb)])
        if all(done.get(key, tick) < tick for key in need) and (kind == "B" or held < limit or not waiting_w):
            return kind, chunk, mb
    if waiting_w:
        return ("W", *waiting_w[0])
    return None


def _add_messages(schedule, p, stages, plans, rank, tick, kind, chunk, mb) -> None:
    """The activation an F sends on and the input gradient a B sends back, exchanged at the end of `tick`;
    rank p − 1's pass between its two V chunks stays on the rank."""
    stage = stage_of(schedule, p, rank, chunk)
    if kind == "F" and stage < stages - 1:
        target, message = stage + 1, "act"
    elif kind == "B" and stage > 0:
        target, message = stage - 1, "grad"
    else:
        return
    to_rank, to_chunk = place(schedule, p, target)
    if to_rank == rank:
        return
    mine = plans[rank].exchanges.setdefault(tick, Exchange())
    theirs = plans[to_rank].exchanges.setdefault(tick, Exchange())
    if to_rank == rank + 1:
        mine.send_next, theirs.recv_prev = (chunk, mb), (message, to_chunk, mb)
    else:
        mine.send_prev, theirs.recv_next = (chunk, mb), (message, to_chunk, mb)


def idle_fraction(schedule: str, p: int, m: int) -> float:
    """The plan's idle fraction per rank with unit slots and free transfers (the same on every rank). From
    m = 2p on, both plans idle p − 1 ticks of a step whatever m (tests/test_zero_bubble.py checks it up to
    5p): (p−1)/(3m+p−1) for ZB-H1, (p−1)/(6m+p−1) for ZBV, whose ticks are half-stage chunks; beyond 4p that
    closed form is used, as the planner asks for m in the hundreds."""
    busy = 3 * chunks_per_rank(schedule) * m
    if m > 4 * p:
        return (p - 1) / (busy + p - 1)
    plans = plan(schedule, p, m)
    return 1 - busy / (max(t for r in plans for t, *_ in r.slots) + 1)


@functools.lru_cache(maxsize=4096)  # the planner asks it for every stage of thousands of layouts
def peaks(schedule: str, p: int, m: int, rank: int) -> tuple[int, int]:
    """(most chunk activations held at once, from F to W; most chunk backwards between their B and W at once)
    on `rank`: what engine/memory_estimate.py counts."""
    held = waiting = peak_held = peak_waiting = 0
    for _, kind, _, _ in plan(schedule, p, min(m, 4 * p))[rank].slots:  # the same from m = 2p on
        held += {"F": 1, "W": -1}.get(kind, 0)
        waiting += {"B": 1, "W": -1}.get(kind, 0)
        peak_held, peak_waiting = max(peak_held, held), max(peak_waiting, waiting)
    return peak_held, peak_waiting
