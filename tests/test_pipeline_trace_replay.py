"""engine/plan/trace_replay.py: a recorded step replayed with its slots' typical durations and free transfers
gives the schedule's own bubble, whatever waits and slow slots the cores added to the recording."""
from __future__ import annotations

import random

import pytest

from engine.plan.bubble import analytic_bubble
from engine.plan.trace_replay import replay, replayed_idle, slot_costs
from parallel.zero_bubble_plan import critical_order, plan
from tools.pipeline_trace import describe_costs


def stretched(slots_by_rank: list[list[tuple]], cost: dict, seed: int = 0) -> list[list[tuple]]:
    """Traces of (kind, mb, chunk) slots run back to back on each rank, `cost[kind]` seconds each, with
    random waits between them and one slot in ten taking longer: what a rank taken off its core records."""
    rng = random.Random(seed)
    traces = []
    for slots in slots_by_rank:
        now, trace = rng.uniform(0, 5), []
        for i, (kind, mb, chunk) in enumerate(slots):
            now += rng.choice([0.0, 0.0, rng.uniform(0, 7)])
            took = cost[kind] * (1 + rng.uniform(0, 5) if i % 10 == 3 else 1)
            trace.append((kind, mb, chunk, now, now + took))
            now += took
        traces.append(trace)
    return traces


def measured_idle(traces):
    start, end = min(e[3] for t in traces for e in t), max(e[4] for t in traces for e in t)
    return [1 - sum(e[4] - e[3] for e in t) / (end - start) for t in traces]


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (3, 5)])
def test_the_replay_of_a_contended_trace_gives_the_analytic_bubble(p, m):
    # 1F1B: its order (warm-up forwards, pairs, cool-down backwards), B twice an F's cost (it holds W)
    ones = [[(k, mb, c) for k, c, mb in critical_order("zb-h1", p, m, r)] for r in range(p)]
    traces = stretched(ones, {"F": 1.0, "B": 2.0})
    assert min(measured_idle(traces)) > analytic_bubble("1f1b", p, m) + 0.05  # the waits look like bubble
    assert replayed_idle(traces, "1f1b") == pytest.approx([analytic_bubble("1f1b", p, m)] * p)
    # the zero-bubble plans, F = B = W one unit: the plan's own idle fraction on every rank
    for schedule in ("zb-h1", "zbv"):
        slots = [[(k, mb, c) for _, k, c, mb in r.slots] for r in plan(schedule, p, m)]
        traces = stretched(slots, {"F": 1.0, "B": 1.0, "W": 1.0}, seed=p * m)
        assert replayed_idle(traces, schedule) == pytest.approx([analytic_bubble(schedule, p, m)] * p)


def test_a_slot_waits_for_its_input_from_the_neighbour_and_keeps_its_rank_order():
    # PP 2, one micro-batch: F0 on rank 0 (1 s), F1 on rank 1 (1 s), B1 (2 s), B0 (3 s); recorded late.
    # The replay's clock starts at 0.
    traces = [[("F", 0, 0, 10, 11), ("B", 0, 0, 30, 33)], [("F", 0, 0, 20, 21), ("B", 0, 0, 21, 23)]]
    assert replay(traces, "1f1b") == [[(0, 1), (4, 7)], [(1, 2), (2, 4)]]
    assert replayed_idle(traces, "1f1b") == pytest.approx([1 - 4 / 7, 1 - 3 / 7])
    # the interleaved placement: rank 0's chunk 1 is model chunk 2 and waits for rank 1's chunk 0
    traces = [[("F", 0, 0, 0, 1), ("F", 0, 1, 5, 6)], [("F", 0, 0, 2, 3), ("F", 0, 1, 9, 10)]]
    assert [r[-1] for r in replay(traces, "interleaved")] == [(2, 3), (3, 4)]
    with pytest.raises(ValueError, match="in a circle"):
        replay([[("B", 0, 0, 0, 1), ("F", 0, 0, 1, 2)], [("F", 0, 0, 0, 1), ("B", 0, 0, 1, 2)]], "1f1b")


def test_a_rank_slowed_for_most_of_its_slots_is_charged_its_fastest_ones():
    """Contention only lengthens a slot: with 7 slots in 10 of rank 1 slowed (a median would charge the slow
    cost and read the imbalance as bubble), the replay still gives the plan's own idle fraction."""
    p, m = 4, 8
    slots = [[(k, mb, c) for _, k, c, mb in r.slots] for r in plan("zb-h1", p, m)]
    traces = stretched(slots, {"F": 1.0, "B": 1.0, "W": 1.0})
    traces[1] = [(k, mb, c, s, s + (e - s) * (3 if i % 10 < 7 else 1)) for i, (k, mb, c, s, e) in enumerate(traces[1])]
    assert replayed_idle(traces, "zb-h1") == pytest.approx([analytic_bubble("zb-h1", p, m)] * p)


def test_a_split_backward_costs_what_split_ones_cost():
    # PP 2, 1F1B: the last stage's first backward holds its weight gradients (3 s), its last one is split
    # (1 s, then its W slot, 2 s), as 1F1B with deferred weight gradients runs its cool-down
    traces = [[("F", 0, 0, 0, 1), ("F", 1, 0, 1, 2), ("B", 0, 0, 9, 10), ("B", 1, 0, 12, 13)],
              [("F", 0, 0, 1, 2), ("B", 0, 0, 2, 5), ("F", 1, 0, 5, 6), ("B", 1, 0, 6, 7), ("W", 1, 0, 7, 9)]]
    assert replay(traces, "1f1b") == [[(0, 1), (1, 2), (5, 6), (7, 8)], [(1, 2), (2, 5), (5, 6), (6, 7), (7, 9)]]
    # what tools/pipeline_trace.py prints of them: "BW" the backward with its weight gradients, "B" the split one
    assert slot_costs(traces[1]) == {("F", 0, False): 1, ("B", 0, False): 3, ("B", 0, True): 1, ("W", 0, False): 2}
    assert describe_costs(slot_costs(traces[1])) == "F0 1000.0  BW0 3000.0  B0 1000.0  W0 2000.0"


def back_to_back(slots: list[tuple], cost) -> list[tuple]:
    """A trace of (kind, mb, chunk) slots run one after another, each `cost(kind, mb)` long."""
    now, trace = 0.0, []
    for kind, mb, chunk in slots:
        trace.append((kind, mb, chunk, now, now + cost(kind, mb)))
        now += cost(kind, mb)
    return trace


@pytest.mark.parametrize("m", [8, 16])
def test_zb_h1_idles_less_than_1f1b_at_unequal_slot_costs(m):
    """ZB-H1's plan, made with equal slots, against 1F1B as Trilith runs it (its cool-down's and last steady
    backwards split from their W on every stage after the first) at PP 4: below it whatever a W costs against
    a B and with a last stage half again as slow, by less the cheaper the W (the tiny config's W is about a
    seventh of a B, which leaves ZB-H1 a point below 1F1B at m = 16, under the replay's run-to-run spread)."""
    p = 4
    for w, last in ((1.0, 1.0), (0.5, 1.0), (0.15, 1.0), (0.5, 1.5), (0.15, 1.5)):
        ones, zero_bubble = [], []
        for rank in range(p):
            f = last if rank == p - 1 else 1.0
            split = set(range(m - min(p - rank - 1, m) - 1, m)) if rank else set()
            slots = []
            for kind, chunk, mb in critical_order("zb-h1", p, m, rank):
                slots += [(kind, mb, chunk)] + ([("W", mb, chunk)] if kind == "B" and mb in split else [])
            ones.append(back_to_back(slots, lambda k, mb: {"F": f, "W": w, "B": 1.0 + w * (mb not in split)}[k]))
            planned = [(k, mb, c) for _, k, c, mb in plan("zb-h1", p, m)[rank].slots]
            zero_bubble.append(back_to_back(planned, lambda k, mb: {"F": f, "B": 1.0, "W": w}[k]))
        assert sum(replayed_idle(zero_bubble, "zb-h1")) < sum(replayed_idle(ones, "1f1b")) - 0.005 * p, (w, last)
