"""Liveness heartbeats through the job's rendezvous store, so that a failing rank can name the peer at fault.

A daemon thread per rank writes `trilith/heartbeat/<rank>` = "<unix time> <host> <step>" every INTERVAL_S
seconds into the store every launch already has (torchrun's agent, or rank 0's TCPStore under srun/mpirun).
A rank waiting in a collective keeps beating (the C++ wait releases the GIL); a rank that was killed,
stopped (SIGSTOP) or froze holding the GIL goes silent. When a collective fails, `peer_report` reads every
beat and says which peers are silent or, when all are alive, which ones are at a different step than the
rest. Silence is judged against this host's clock: the hosts' clocks must agree within a few seconds.

The thread also reports on its own deadline: NCCL's watchdog ends a rank whose collective timed out (async error
handling) before Python sees an error, so the report at the failure would never print on GPUs. When training
has made no progress (`set_step`) for `stall_after_s`, less than the collective timeout, the thread prints the
same report itself, once per stalled step, while the collective still waits.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

from torch.distributed import distributed_c10d

INTERVAL_S = 2.0
SILENT_AFTER_S = 3 * INTERVAL_S  # a live peer's beat is at most INTERVAL_S old, plus scheduling delays
READ_TIMEOUT_S = 3.0  # the store's host may be the rank that died or hung
MAX_NAMED = 8


def key(rank: int) -> str:
    return f"trilith/heartbeat/{rank}"


@dataclass(frozen=True)
class Beat:
    time: float
    host: str
    step: int

    def encode(self) -> str:
        return f"{self.time:.3f} {self.host} {self.step}"

    @classmethod
    def decode(cls, text: str) -> Beat:
        when, host, step = text.split()
        return cls(float(when), host, int(step))


class _Beater(threading.Thread):
    def __init__(self, store, rank: int, host: str, world_size: int, stall_after_s: float, note: str):
        super().__init__(name="trilith-heartbeat", daemon=True)
        self.store, self.rank, self.host = store, rank, host
        self.world_size, self.stall_after_s, self.note = world_size, stall_after_s, note
        self.step = 0  # training steps done; the Trainer sets it, this thread only reads it
        self.progress = time.monotonic()  # when the Trainer last set the step
        self.reported_step: int | None = None  # the stalled step already reported
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            with contextlib.suppress(RuntimeError):  # store unreachable: its host is gone, and the job with it
                self.store.set(key(self.rank), Beat(time.time(), self.host, self.step).encode())
            stalled = time.monotonic() - self.progress
            if self.stall_after_s and stalled > self.stall_after_s and self.reported_step != self.step:
                self.reported_step = self.step
                # on a thread of its own: reading the store may take READ_TIMEOUT_S, and the beats must go on
                threading.Thread(target=self.report_stall, args=(self.step, stalled), name="trilith-stall-report",
                                 daemon=True).start()
            self.stopped.wait(INTERVAL_S)

    def report_stall(self, step: int, stalled: float) -> None:
        print(f"trilith: rank {self.rank}: {stall_report(step, stalled, self.world_size, self.rank, self.note)}",
              file=sys.stderr, flush=True)


_beater: _Beater | None = None


def _default_store():
    # The store init_process_group made; torch offers no public accessor for it.
    return distributed_c10d._get_default_store()


def start(rank: int, host: str, world_size: int = 1, stall_after_s: float = 0.0, note: str = "") -> None:
    """Beat for this rank, running on `host`, until stop(); needs an initialized default process group. With
    `stall_after_s`, report who is silent when no step has ended for that long, adding `note`."""
    global _beater
    # Its own connection to the store, so a beat never waits behind the process group's store traffic.
    _beater = _Beater(_default_store().clone(), rank, host, world_size, stall_after_s, note)
    _beater.start()


def set_step(step: int) -> None:
    """Training has reached `step` (also after a resume or a rollback): progress, for the stall deadline."""
    if _beater is not None:
        _beater.step = step
        _beater.progress = time.monotonic()


def stop() -> None:
    """Stop beating; does not wait for a write stuck on a dead store host (the thread is a daemon)."""
    global _beater
    if _beater is not None:
        _beater.stopped.set()
        _beater = None


def read(store, world_size: int) -> dict[int, Beat | None]:
    """Every rank's last beat (None: never wrote one). May block for good when the store's host is stopped."""
    keys = [key(r) for r in range(world_size)]
    if store.check(keys):
        values = store.multi_get(keys)
    else:
        values = [store.get(k) if store.check([k]) else None for k in keys]
    return {r: Beat.decode(v.decode()) if v is not None else None for r, v in enumerate(values)}


def read_within(timeout_s: float, world_size: int) -> dict[int, Beat | None]:
    """read() on a fresh store connection, given up after timeout_s: a stopped store host never answers, and
    not every store request honours the store's timeout. The reader is a daemon thread left behind then."""
    outcome: dict = {}

    def reader() -> None:
        try:
            outcome["beats"] = read(_default_store().clone(), world_size)
        except Exception as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=reader, name="trilith-heartbeat-read", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "error" in outcome:
        raise outcome["error"]
    if "beats" not in outcome:
        raise TimeoutError(f"no answer within {timeout_s:.0f} s")
    return outcome["beats"]


def silent_peers(beats: dict[int, Beat | None], now: float, me: int) -> list[int]:
    return [r for r, b in beats.items() if r != me and (b is None or now - b.time > SILENT_AFTER_S)]


def _named(ranks: list[int], say) -> str:
    more = f"; and {len(ranks) - MAX_NAMED} more" if len(ranks) > MAX_NAMED else ""
    return "; ".join(say(r) for r in ranks[:MAX_NAMED]) + more


def describe(beats: dict[int, Beat | None], now: float, me: int) -> str:
    """The silent peers, or else that all are alive and which ranks are at a different step than most."""
    silent = silent_peers(beats, now, me)
    if silent:
        def say(r: int) -> str:
            b = beats[r]
            if b is None:
                return f"rank {r} never wrote a heartbeat"
            return f"rank {r} on host {b.host} silent for {now - b.time:.0f} s (last beat after step {b.step})"
        return "heartbeats: " + _named(silent, say)
    steps = Counter(b.step for b in beats.values() if b is not None)
    usual = steps.most_common(1)[0][0]
    odd = [r for r, b in beats.items() if b is not None and b.step != usual]
    text = f"heartbeats: all {len(beats)} ranks are alive (none died or froze)"
    if odd:
        text += f"; most are after step {usual}, but " + _named(
            odd, lambda r: f"rank {r} on host {beats[r].host} is after step {beats[r].step}")
    return text


def peer_report(world_size: int, me: int) -> str:
    """describe() of the store's beats, never raising: it runs while reporting another error. A peer that
    died a moment ago still has a fresh beat: when none is silent yet, look again once it would be."""
    try:
        beats = read_within(READ_TIMEOUT_S, world_size)
        if not silent_peers(beats, time.time(), me):
            time.sleep(SILENT_AFTER_S)
            beats = read_within(READ_TIMEOUT_S, world_size)
    except Exception as exc:
        return _unreadable(exc)
    return describe(beats, time.time(), me)


def _unreadable(exc: Exception) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return (f"heartbeats: the store could not be read ({type(exc).__name__}: {first_line}); its host "
            "(rank 0 under srun/mpirun) may be the rank that died or hung")


def stall_report(step: int, stalled: float, world_size: int, me: int, note: str = "") -> str:
    """The heartbeat thread's own report of a stall: how long, then who is silent (one read, no second look:
    a peer that stopped when this rank did has been silent for about as long)."""
    try:
        beats = describe(read_within(READ_TIMEOUT_S, world_size), time.time(), me)
    except Exception as exc:
        beats = _unreadable(exc)
    return (f"no training progress for {stalled:.0f} s (after step {step}); a collective may be waiting on a peer "
            f"(collectives time out after parallel.timeout_minutes). {beats}" + (f". {note}" if note else ""))
