"""A matrix of large layouts, each simulated by the dry run on a sample of its ranks (tools/dry_run_sweep.py).

The matrix: every TP × CP × PP of the given sizes, each once, at a data-parallel size that cycles through the
largest the world bound allows (at most `max_dp`), 16, 2 and 1; the other settings each cycle over the layouts
at their own pace (the rank order by a stride of 7 through its 30, so that neighbours differ): every rank order
(the 24 of tp-cp-dp-pp and the 6 of tp-dp-pp), both stage balances, the pipeline schedules (1F1B, interleaved
with 2 and 4 chunks a rank, zero-bubble H1 and V, GPipe), ZeRO 0-3, CP's three attention strategies and host
offload off or at half. Layouts the configuration refuses are counted apart, with the refusal's line.

The sample of each layout: the whole pipeline of the first replica's first TP and CP rank (rank 0 and one rank
of every stage: each stage's memory and its transfers checked with both peers simulated) and the world's last
rank (the last TP, CP and DP coordinate: another shard of ZeRO, another TP rank's shapes). Collective groups are
checked between the simulated members only (engine/dry_run/schedule_check.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import signal

from engine.config.schema import ConfigError, load_config
from engine.dry_run.rank_program import dry_config
from engine.dry_run.ranks import layout_of
from engine.dry_run.verdict import judge

ORDERS = ["-".join(o) for o in itertools.permutations(("tp", "cp", "dp", "pp"))] + \
    ["-".join(o) for o in itertools.permutations(("tp", "dp", "pp"))]
SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("gpipe", 1), ("interleaved", 4)]
BALANCES = ["layers", "compute"]
ZERO = [1, 0, 2, 3]
ATTENTION = ["allgather", "ring", "alltoall"]
OFFLOAD = [0.0, 0.0, 0.5]


@dataclasses.dataclass(frozen=True)
class Case:
    tp: int
    cp: int
    pp: int
    dp: int
    order: str
    balance: str
    schedule: str
    virtual: int
    zero: int
    attention: str
    offload: float

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def name(self) -> str:
        pipe = f"PP{self.pp}" + (f" {self.schedule}" + (f" v{self.virtual}" if self.virtual > 1 else "")
                                 if self.pp > 1 else "")
        cp = f"CP{self.cp} {self.attention}" if self.cp > 1 else "CP1"
        return (f"TP{self.tp} {cp} {pipe} DP{self.dp} Z{self.zero} {self.order} {self.balance}"
                + (f" offload {self.offload:g}" if self.offload else ""))

    def overrides(self) -> list[str]:
        """The settings of this case; one micro-batch a sequence, as many a rank as stages (at least 2), so
        that every schedule has a steady state and the interleaved one a multiple of the stages."""
        micro = max(2, self.pp)
        return [f"parallel.tensor={self.tp}", f"parallel.context={self.cp}", f"parallel.pipeline={self.pp}",
                f"parallel.rank_order={self.order}", f"parallel.stage_balance={self.balance}",
                f"parallel.schedule={self.schedule if self.pp > 1 else '1f1b'}",
                f"parallel.virtual_stages={self.virtual if self.pp > 1 else 1}", f"parallel.zero_stage={self.zero}",
                f"parallel.context_attention={self.attention}", f"parallel.sequence_parallel={str(self.tp > 1).lower()}",
                f"optim.offload_fraction={self.offload:g}",
                "train.micro_batch_size=1", f"train.global_batch_size={micro * self.dp}"]


def matrix(tps: list[int], cps: list[int], pps: list[int], max_dp: int, max_world: int,
           phase: int = 0) -> list[Case]:
    """The cases (module docstring); a TP × CP × PP above `max_world` is left out. `phase` shifts every cycle,
    pairing each TP × CP × PP with other settings."""
    cases = []
    for tp, cp, pp in itertools.product(tps, cps, pps):
        fixed = tp * cp * pp
        if fixed > max_world:
            continue
        i = len(cases) + phase
        largest = min(max_dp, max_world // fixed)
        dp = min(largest, (largest, 16, 2, 1)[i % 4])
        schedule, virtual = SCHEDULES[i % len(SCHEDULES)]
        cases.append(Case(tp, cp, pp, dp, ORDERS[(7 * i) % len(ORDERS)], BALANCES[(i // 3) % 2], schedule,
                          virtual, ZERO[(i // 5) % 4], ATTENTION[i % 3] if cp > 1 else "allgather",
                          OFFLOAD[(i // 7) % 3]))
    return cases


def sample(layout) -> list[int]:
    """Rank 0's pipeline (one rank of every stage) and the world's last rank (module docstring)."""
    ranks = {layout.rank_of(tp=0, cp=0, pp=s, dp=0) for s in range(layout.pp)}
    return sorted(ranks | {layout.world_size - 1})


class Hung(BaseException):
    """A case past its time (a BaseException: verdict.judge reports a rank's own exceptions, not this)."""


def _alarm(signum, frame):
    raise Hung()


def check(config: str, base: list[str], case: Case, run_dir: str, jobs: int, timeout: int) -> dict:
    """{case, world, ranks, status: PASS | REFUSED | FAIL, line} of one case; a case still running after
    `timeout` seconds is a FAIL (hang)."""
    out = {"case": case.name(), "settings": dataclasses.asdict(case), "world": case.world, "ranks": []}
    try:
        cfg = load_config(config, [*base, *case.overrides(), f"run.dir={run_dir}"])
        layout = layout_of(cfg, case.world)
        cfg = dry_config(cfg, case.world)
    except ConfigError as exc:
        return {**out, "status": "REFUSED", "line": str(exc).splitlines()[0]}
    ranks = sample(layout)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        passed, line = judge(cfg, case.world, ranks, jobs)
    except Hung:
        passed, line = False, f"FAIL (hang: not done after {timeout} s)"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return {**out, "ranks": ranks, "status": "PASS" if passed else "FAIL", "line": line}
