"""Which rank holds the others back: every `run.timing_interval` steps, each rank's step time split four ways.

    data_wait_s   waiting for the loader            compute_s     the rest: forward, backward, checks
    comm_wait_s   inside collectives and pipeline   optimizer_s   the optimizer step, less its collectives
                  sends/receives (parallel/comm.py)

Every rank's split is gathered; rank 0 writes the per-rank table into that step's record (`rank_times`, one
list per column, index = global rank, with `host` and `work`). A rank's busy time is its step less its
communication wait: collectives make every rank's step equally long, the others spending in communication the
time the slow one computes. Busy time is judged like with like, twice:

- against the median of the other ranks that do the same work (`work_of`: the same layers, and the embedding or
  the output layer or neither, chunk by chunk), so a pipeline stage that is heavier by design is no alarm;
- against the rank's own median over its last `HISTORY` timed steps, scaled up by as much as the median rank
  slowed down since (a batch ramp slows every rank), so a rank that slows down is named even when no other rank
  does its work.

A rank is behind when its busy time is above `run.straggler_threshold` × a reference and at least
`MIN_EXCESS_S` above it. The step after a rank is first seen behind is timed too, and only a rank behind on both
is a straggler: a rank slow for one step lost its core to another process for a moment, a slow part stays slow.
Rank 0 logs the stragglers with their hosts, the one furthest behind first (`stragglers` in the record). On a
timed step each collective is waited for where it is issued, and on CUDA the device is
synchronised around the phases, so the split is this rank's own; that step gives up its overlap of
communication and compute, the others run untouched.
"""
from __future__ import annotations

import collections
import contextlib
import statistics
import time

import torch

from parallel import comm
from parallel.distributed import node_name, world_group

COLUMNS = ("data_wait_s", "compute_s", "comm_wait_s", "optimizer_s")
HISTORY, MIN_HISTORY = 5, 3  # a rank's own reference: the median of its last 5 timed steps, once it has 3
# A lag under this is taken for the host's scheduling noise, not a slow part: ranks that share a host's cores
# take tens of milliseconds of a step from one another (tiny models on 8 ranks and 2 cores: 40 ms on a healthy
# step). It decides only for steps under 0.5 s, where 20% is less.
MIN_EXCESS_S = 0.1
REFERENCES = {"group": "the median of the ranks doing the same work", "history": "its own recent median"}


def work_of(chunks) -> str:
    """What a rank computes each step, one part per pipeline chunk, e.g. "embedding + 2 layers | 2 layers":
    ranks with the same description (tensor and data parallel peers, middle pipeline stages of equal depth)
    take the same time when healthy."""
    return " | ".join(("embedding + " if c.pre_process else "") + f"{len(c.model.layers)} layers" +
                      (" + output layer" if c.post_process else "") for c in chunks)


class StepTimer:
    def __init__(self, run_cfg, rank: int, world_size: int, device: torch.device, nodes: tuple, console,
                 work: str = ""):
        self.interval, self.threshold = run_cfg.timing_interval, run_cfg.straggler_threshold
        self.rank, self.world_size, self.device, self.console = rank, world_size, device, console
        self.work = work
        self.hosts = list(nodes) or None  # gathered at the first timed step when the launcher did not
        self.works: list | None = None  # every rank's `work`, gathered at the first timed step
        self.history = [collections.deque(maxlen=HISTORY) for _ in range(world_size)]  # busy s per timed step
        self.suspects: set[int] = set()  # ranks behind on the last timed step, to be confirmed on the next
        self.timed, self.optimizer_s = False, 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_begins(self, step: int) -> None:
        self.timed = self.interval > 0 and self.world_size > 1 and (step % self.interval == 0 or bool(self.suspects))
        comm.TIMER.active, comm.TIMER.cuda, comm.TIMER.seconds = self.timed, self.device.type == "cuda", 0.0
        self.optimizer_s = 0.0
        if self.timed:
            self._sync()

    @contextlib.contextmanager
    def optimizer(self):
        """The optimizer step: a profiler range, and on a timed step its time less the collectives inside."""
        with comm.named_range("optimizer"):
            if not self.timed:
                yield
                return
            self._sync()
            start, comm_before = time.perf_counter(), comm.TIMER.seconds
            yield
            self._sync()
            self.optimizer_s = time.perf_counter() - start - (comm.TIMER.seconds - comm_before)

    def step_ends(self, step: int, step_time: float, data_wait: float) -> dict:
        """{} on untimed steps; else `rank_times` (and `stragglers` when there are any) for the step's record.
        Every rank takes part (one all-gather of four numbers per rank) and reaches the same verdict."""
        if not self.timed:
            return {}
        self.timed = comm.TIMER.active = False  # the gather below is not part of the step
        comm_wait = comm.TIMER.seconds
        compute = max(0.0, step_time - data_wait - comm_wait - self.optimizer_s)
        mine = torch.tensor([[data_wait, compute, comm_wait, self.optimizer_s]], dtype=torch.float64,
                            device=self.device)
        table = comm.all_gather(mine, world_group()).cpu().tolist()
        if self.works is None:
            gathered = [None] * self.world_size
            comm.all_gather_object(gathered, (node_name(), self.work), world_group())
            self.hosts = self.hosts or [host for host, _ in gathered]
            self.works = [work for _, work in gathered]
        out = {"rank_times": {**{c: [row[i] for row in table] for i, c in enumerate(COLUMNS)}, "host": self.hosts,
                              "work": self.works}}
        slow = self.confirmed(self.behind(table))
        if slow:
            out["stragglers"] = slow
            if self.rank == 0:
                self.console(f"WARNING step {step}: straggler{'s' if len(slow) > 1 else ''}, busy above "
                             f"run.straggler_threshold={self.threshold}× a like-for-like reference: " + "; ".join(
                                 f"rank {s['rank']} on {s['host']} ({s['work']}) busy {s['busy_s']:.3f} s, "
                                 f"{s['ratio']:.2f}× {REFERENCES[s['against']]} {s['reference_s']:.3f} s (data "
                                 f"wait {s['data_wait_s']:.3f}, compute {s['compute_s']:.3f}, optimizer "
                                 f"{s['optimizer_s']:.3f})" for s in slow))
        return out

    def behind(self, table: list[list[float]]) -> list[dict]:
        """The ranks whose busy time (data wait + compute + optimizer) is past the threshold of their group's
        or their own history's reference, furthest behind first; this step then joins each rank's history."""
        busy = [row[0] + row[1] + row[3] for row in table]
        works = self.works or [self.work] * len(busy)
        references = {r: [] for r in range(len(busy))}  # rank: [(reference seconds, "group" | "history")]
        for r, work in enumerate(works):
            peers = [busy[q] for q, other in enumerate(works) if other == work and q != r]
            if peers:
                references[r].append((statistics.median(peers), "group"))
        if len(self.history[0]) >= MIN_HISTORY:
            own = [statistics.median(h) for h in self.history]
            # every rank slower (a batch ramp): the history is scaled up; every rank faster: a rank that kept its
            # pace holds no one back more than before, so the history is not scaled down
            drift = max(1.0, statistics.median([b / o for b, o in zip(busy, own) if o > 0] or [1.0]))
            for r, o in enumerate(own):
                references[r].append((o * drift, "history"))
        for h, b in zip(self.history, busy):
            h.append(b)
        slow = []
        for r, refs in references.items():
            behind = [(busy[r] - ref, ref, against) for ref, against in refs
                      if busy[r] > self.threshold * ref and busy[r] - ref >= MIN_EXCESS_S]
            if behind:
                excess, ref, against = max(behind)
                slow.append({"rank": r, "host": self.hosts[r], "work": works[r], "busy_s": busy[r], "excess_s": excess,
                             "reference_s": ref, "against": against, "ratio": busy[r] / ref if ref else float("inf"),
                             **dict(zip(COLUMNS, table[r]))})
        return sorted(slow, key=lambda s: -s["excess_s"])

    def confirmed(self, behind: list[dict]) -> list[dict]:
        """Those of `behind` that were behind on the last timed step too; the others are suspects, and the next
        step is timed to see whether they still are."""
        named = [s for s in behind if s["rank"] in self.suspects]
        self.suspects = {s["rank"] for s in behind} - {s["rank"] for s in named}
        return named
