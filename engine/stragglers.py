"""Which rank holds the others back: every `run.timing_interval` steps, each rank's step time split four ways.

    data_wait_s   waiting for the loader            compute_s     the rest: forward, backward, checks
    comm_wait_s   inside collectives and pipeline   optimizer_s   the optimizer step, less its collectives
                  sends/receives (parallel/comm.py)

Every rank's split is gathered; rank 0 writes the per-rank table into that step's record (`rank_times`, one
list per column, index = global rank, with `host`) and, when a rank's busy time (its step less its
communication wait) exceeds `run.straggler_threshold` × the median over ranks, logs those ranks and their hosts,
slowest first (`stragglers` in the record). Busy time, not step time, tells a straggler apart: collectives make
every rank's step equally long, the others spending in communication the time the slow one computes.

On a timed step each collective is waited for where it is issued, and on CUDA the device is synchronised around
the phases, so the split is this rank's own; that step gives up its overlap of communication and compute, the
others run untouched.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from parallel import comm
from parallel.distributed import node_name, world_group

COLUMNS = ("data_wait_s", "compute_s", "comm_wait_s", "optimizer_s")


class StepTimer:
    def __init__(self, run_cfg, rank: int, world_size: int, device: torch.device, nodes: tuple, console):
        self.interval, self.threshold = run_cfg.timing_interval, run_cfg.straggler_threshold
        self.rank, self.world_size, self.device, self.console = rank, world_size, device, console
        self.hosts = list(nodes) or None  # gathered at the first timed step when the launcher did not
        self.timed, self.optimizer_s = False, 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_begins(self, step: int) -> None:
        self.timed = self.interval > 0 and self.world_size > 1 and step % self.interval == 0
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
        Every rank takes part (one all-gather of four numbers per rank)."""
        if not self.timed:
            return {}
        self.timed = comm.TIMER.active = False  # the gather below is not part of the step
        comm_wait = comm.TIMER.seconds
        compute = max(0.0, step_time - data_wait - comm_wait - self.optimizer_s)
        mine = torch.tensor([[data_wait, compute, comm_wait, self.optimizer_s]], dtype=torch.float64,
                            device=self.device)
        table = comm.all_gather(mine, world_group()).cpu().tolist()
        if self.hosts is None:
            self.hosts = [None] * self.world_size
            dist.all_gather_object(self.hosts, node_name(), group=world_group())
        out = {"rank_times": {**{c: [row[i] for row in table] for i, c in enumerate(COLUMNS)}, "host": self.hosts}}
        slow = self.stragglers(table)
        if slow:
            out["stragglers"] = slow
            if self.rank == 0:
                self.console(f"WARNING step {step}: straggler{'s' if len(slow) > 1 else ''} above "
                             f"run.straggler_threshold={self.threshold}× the median busy time "
                             f"{slow[0]['median_busy_s']:.3f} s: " + "; ".join(
                                 f"rank {s['rank']} on {s['host']} busy {s['busy_s']:.3f} s ({s['ratio']:.2f}×: "
                                 f"data wait {s['data_wait_s']:.3f}, compute {s['compute_s']:.3f}, optimizer "
                                 f"{s['optimizer_s']:.3f})" for s in slow))
        return out

    def stragglers(self, table: list[list[float]]) -> list[dict]:
        """The ranks whose busy time (data wait + compute + optimizer) is above threshold × the median, slowest
        first."""
        busy = [row[0] + row[1] + row[3] for row in table]
        median = statistics.median(busy)
        slow = sorted((r for r, b in enumerate(busy) if b > self.threshold * median), key=lambda r: -busy[r])
        return [{"rank": r, "host": self.hosts[r], "busy_s": busy[r], "ratio": busy[r] / median if median else
                 float("inf"), "median_busy_s": median, **dict(zip(COLUMNS, table[r]))} for r in slow]
