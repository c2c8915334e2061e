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

A fault fires once per run.dir: the marker run.dir/logs/fault.fired (written before it fires) keeps the
restarted job from repeating it.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

from engine.config.schema import ConfigError

KINDS = ("kill", "hang", "kill_during_snapshot", "kill_during_transfer", "corrupt_snapshot", "lose_node")
SPEC = re.compile(r"^(\w+)@step=(\d+),rank=(\d+)$")


def parse(spec: str) -> tuple[str, int, int] | None:
    """(kind, step, rank) of run.inject_fault, None for ""; a malformed spec is a ConfigError naming it."""
    if not spec:
        return None
    match = SPEC.match(spec.strip())
    if not match or match.group(1) not in KINDS:
        raise ConfigError(f"run.inject_fault={spec!r} is not KIND@step=N,rank=R with KIND one of {', '.join(KINDS)} "
                          f"(e.g. kill@step=7,rank=1); set run.inject_fault=\"\" for none")
    return match.group(1), int(match.group(2)), int(match.group(3))


class FaultInjector:
    def __init__(self, spec: str, rank: int, run_dir: str):
        parsed = parse(spec)
        self.marker = Path(run_dir) / "logs" / "fault.fired"
        self.kind, self.step = (parsed[0], parsed[1]) if parsed and parsed[2] == rank else (None, -1)
        if self.kind and self.marker.exists():  # a restarted job: the fault has happened
            self.kind = None

    def _due(self, kinds: tuple, step: int) -> bool:
        return self.kind in kinds and step == self.step

    def _fire(self) -> None:
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(f"{self.kind}@step={self.step}\n")
        self.kind = None

    def step_ends(self, step: int, memory=None) -> None:
        """As step `step` ends, before its saves: kill and hang."""
        if self._due(("kill",), step):
            if memory is not None:
                memory.wait()
            self._fire()
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due(("hang",), step):
            self._fire()
            while True:
                time.sleep(3600)

    def mid_snapshot(self, step: int) -> None:
        """Inside the snapshot writer, between the state file and the manifest of the rank's own shard."""
        if self._due(("kill_during_snapshot",), step):
            self._fire()
            os.kill(os.getpid(), signal.SIGKILL)

    def mid_transfer(self, step: int) -> None:
        """Inside the partner copy of the snapshot of `step`, between the sizes and the bytes."""
        if self._due(("kill_during_transfer",), step):
            self._fire()
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
        self._fire()
        os.kill(os.getpid(), signal.SIGKILL)
