"""Injected faults for recovery tests and the goodput benchmark (run.inject_fault, test-only).

    KIND@step=N,rank=R      KIND one of:
    kill                    rank R is SIGKILLed as step N ends, before any save of step N (after its
                            in-flight memory snapshot, so the test knows which generation survives)
    hang                    rank R stops making progress as step N ends; its peers' collectives time out
                            (parallel.timeout_minutes) and the launcher restarts the job
    kill_during_snapshot    rank R is SIGKILLed while writing its memory snapshot of step N (state file
                            written, manifest not): the previous generation must serve
    kill_during_transfer    rank R is SIGKILLed in the middle of the partner copy of its memory snapshot of step
                            N (its own shard written, the sizes exchanged with its partner, the bytes not):
                            the partner holds no copy of step N, and R's node still holds R's own
    corrupt_snapshot        after its memory snapshot of step N, rank R flips a byte in every snapshot of its
                            own shard on its node, then is SIGKILLed: recovery names them and uses the partner's
                            copy, else the disk checkpoint
    lose_node               after its memory snapshot of step N, rank R deletes its node's snapshot directory
                            (the node is gone) and is SIGKILLed; on two nodes, kill every rank of the node

    KIND@every=N,rank=R     the same at every step that is a multiple of N (the goodput benchmark's failure
                            every N steps, tools/bench_goodput.py)
    KIND@random=N,rank=R    the same at one step drawn uniformly from 1..N at the first start (kept in
                            run.dir/logs/fault.random, so that the restarts agree on it)

A fault fires once per step and run.dir: the marker run.dir/logs/fault.fired (a line KIND@step=N written before it
fires) keeps the restarted job from repeating it when it trains that step again.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

from engine.config.schema import ConfigError

KINDS = ("kill", "hang", "kill_during_snapshot", "kill_during_transfer", "corrupt_snapshot", "lose_node")
SPEC = re.compile(r"^(\w+)@(step|every|random)=(\d+),rank=(\d+)$")


def parse(spec: str) -> tuple[str, int, int, str] | None:
    """(kind, N, rank, "step", "every" or "random") of run.inject_fault, None for ""; a malformed spec is a
    ConfigError naming it."""
    if not spec:
        return None
    match = SPEC.match(spec.strip())
    if not match or match.group(1) not in KINDS or (match.group(2) != "step" and int(match.group(3)) < 1):
        raise ConfigError(f"run.inject_fault={spec!r} is not KIND@step=N,rank=R, KIND@every=N,rank=R or "
                          f"KIND@random=N,rank=R (N ≥ 1) with KIND one of {', '.join(KINDS)} (e.g. "
                          f"kill@step=7,rank=1); set run.inject_fault=\"\" for none")
    return match.group(1), int(match.group(3)), int(match.group(4)), match.group(2)


class FaultInjector:
    def __init__(self, spec: str, rank: int, run_dir: str):
        parsed = parse(spec)
        self.marker = Path(run_dir) / "logs" / "fault.fired"
        mine = parsed is not None and parsed[2] == rank
        self.kind, self.step, mode = (parsed[0], parsed[1], parsed[3]) if mine else (None, -1, "step")
        self.every = mode == "every"
        if mode == "random":
            self.step = self._drawn(parsed[1])
        # a restarted job: the faults that have fired, each at its step
        self.fired = set(self.marker.read_text().split()) if self.kind and self.marker.exists() else set()

    def _drawn(self, last: int) -> int:
        """The step of KIND@random=N: drawn from 1..N at the first start, the same after every restart."""
        path = self.marker.parent / "fault.random"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(random.SystemRandom().randint(1, last)))
        return int(path.read_text())

    def _due(self, kinds: tuple, step: int) -> bool:
        at = step % self.step == 0 if self.every else step == self.step
        return self.kind in kinds and at and f"{self.kind}@step={step}" not in self.fired

    def _fire(self, step: int) -> None:
        self.fired.add(f"{self.kind}@step={step}")
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.write_text("".join(f"{line}\n" for line in sorted(self.fired)))

    def step_ends(self, step: int, memory=None) -> None:
        """As step `step` ends, before its saves: kill and hang."""
        if self._due(("kill",), step):
            if memory is not None:
                memory.wait()
            self._fire(step)
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due(("hang",), step):
            self._fire(step)
            while True:
                time.sleep(3600)

    def mid_snapshot(self, step: int) -> None:
        """Inside the snapshot writer, between the state file and the manifest of the rank's own shard."""
        if self._due(("kill_during_snapshot",), step):
            self._fire(step)
            os.kill(os.getpid(), signal.SIGKILL)

    def mid_transfer(self, step: int) -> None:
        """Inside the partner copy of the snapshot of `step`, between the sizes and the bytes."""
        if self._due(("kill_during_transfer",), step):
            self._fire(step)
            os.kill(os.getpid(), signal.SIGKILL)

    def after_snapshot(self, step: int, memory) -> None:
        """After the rank's memory snapshot of `step` is complete (own copy and partner copy)."""
        if not self._due(("corrupt_snapshot", "lose_node"), step):
            return
        memory.wait()
        store = memory.store
        if self.kind == "lose_node":
            shutil.rmtree(store.dir.parent, ignore_errors=True)  # every run of this node
        else:
            for state in store.owner_dir(memory.rank).glob("step_*/state.safetensors"):
                data = bytearray(state.read_bytes())
                data[len(data) // 2] ^= 0xFF
                state.write_bytes(bytes(data))
        self._fire(step)
        os.kill(os.getpid(), signal.SIGKILL)
