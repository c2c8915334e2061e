"""The bubble of a recorded pipeline step with the machine's contention taken out: the step's slots replayed.

A measured idle fraction (time no slot of a stage ran) counts as bubble every moment a rank was ready but not
on a core: with 4 ranks on 2 shared cores that is most of the step, and it ranks nothing. The replay keeps what
the trace knows for sure: each rank's order of slots (ScheduleTrace: kind, micro-batch, chunk, start, end) and
what a slot costs there: the shortest duration of that rank's slots of the same work, the same kind and chunk
and, for a B, whether its weight gradients ran in a W slot of their own (1F1B splits only its cool-down's
backwards; its other B slots hold the W's work too). Contention only ever lengthens a slot, so the shortest is
the closest to its cost on a core of its own. The median was not: with 4 ranks on 2 busy cores most of a rank's
slots lose the core a while, and the median charged one rank several times another's cost for the same work
(4 December 2026, load average 20, ZB-H1 at PP 4, m = 16, hidden 256: W 51 ms on rank 0, 9 ms on rank 3), and
that imbalance read as bubble. It starts
every slot as soon as its rank's previous slot and its inputs from the other ranks are done, with transfers
free (as the analytic bubble, engine/plan/bubble.py):
    F of model chunk c, micro-batch i   after F(c − 1, i)
    B of model chunk c, micro-batch i   after B(c + 1, i) (the last chunk: after its own F)
    W                                   after its own B, on its rank (the rank's order has it)
A stage's replayed idle is what is left idle by the schedule's shape and its slots' real, unequal costs (the
loss layer's, the embedding's, a B's against its W), not by the cores. tools/pipeline_trace.py prints both,
and on the CPU replays slots as long as their thread's CPU time (ScheduleTrace.compute_events): at a load
of 7–13 on 2 cores the shortest wall-clock F was still 2.5 times its CPU time (hidden 512: 27–32 ms against
11–12 ms, 6 December).
"""
from __future__ import annotations

from parallel.stage_layers import model_chunk


def replay(traces: list[list[tuple]], schedule: str) -> list[list[tuple[float, float]]]:
    """traces[rank] = [(kind, micro-batch, chunk on the rank, start, end), ...]; returns each rank's slots as
    (start, end) replayed from time 0, in that rank's recorded order."""
    p = len(traces)
    v_shape = schedule == "zbv"
    chunks = max(e[2] for t in traces for e in t) + 1 if schedule in ("interleaved", "zbv") else 1
    last = p * chunks - 1
    ordered = [sorted(t, key=lambda e: e[3]) for t in traces]
    costs = [slot_costs(trace) for trace in ordered]
    done: dict = {}  # (kind, model chunk, micro-batch) -> replayed end
    out: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    position, free = [0] * p, [0.0] * p
    while any(position[r] < len(ordered[r]) for r in range(p)):
        progressed = False
        for rank in range(p):
            while position[rank] < len(ordered[rank]):
                kind, mb, chunk, *_ = ordered[rank][position[rank]]
                stage = model_chunk(rank, p, chunk, v_shape)
                need = {"F": [("F", stage - 1, mb)] if stage > 0 else [],
                        "B": [("B", stage + 1, mb)] if stage < last else [("F", stage, mb)]}.get(kind, [])
                if any(key not in done for key in need):
                    break
                begin = max([free[rank]] + [done[key] for key in need])
                free[rank] = begin + costs[rank][_work(ordered[rank], ordered[rank][position[rank]])]
                done[kind, stage, mb] = free[rank]
                out[rank].append((begin, free[rank]))
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError("the traces' slots wait on each other in a circle: not one step of one schedule")
    return out


def slot_costs(trace: list[tuple]) -> dict:
    """One rank's {(kind, chunk, B with its own W slot): shortest duration}: what the replay charges a slot."""
    costs: dict = {}
    for event in trace:
        work = _work(trace, event)
        costs[work] = min(costs.get(work, event[4] - event[3]), event[4] - event[3])
    return costs


def _work(trace: list[tuple], event: tuple) -> tuple:
    """(kind, chunk, whether this B's weight gradients run in a W slot of their own on the rank)."""
    kind, mb, chunk = event[:3]
    return kind, chunk, kind == "B" and any(e[0] == "W" and e[1] == mb and e[2] == chunk for e in trace)


def replayed_idle(traces: list[list[tuple]], schedule: str) -> list[float]:
    """Each rank's idle fraction of the replayed step (from its first slot on any rank to the last)."""
    slots = replay(traces, schedule)
    span = max(e for s in slots for _, e in s) - min(b for s in slots for b, _ in s)
    return [1.0 - sum(e - b for b, e in s) / span for s in slots]
