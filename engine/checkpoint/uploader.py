"""Background copies of committed checkpoints to every checkpoint.mirrors location, on rank 0.

One thread per location, so that a slow or dead store holds back no other location and never a training
step: a save only queues its step. An object store's copies run in a child process (copy_process.py), the
thread only waiting on it, so that boto3's Python work does not take the step's interpreter lock. A failed
copy is a warning, retried after a back-off that doubles (checkpoint.upload_retries times); after the last
try the next save tries again. A step still waiting when a newer one is queued is dropped for that location
(never a multiple of checkpoint.keep_every). What each location holds is in `status()` (metrics.jsonl's
`checkpoint_copies`); `finish(wait_s)` gives pending copies a bounded wait before the process exits, names
what did not finish and stops it (no retry starts after that).
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from engine.checkpoint.copy_process import CopyProcess
from engine.checkpoint.files import STEP_DIR, CheckpointError

log = logging.getLogger("trilith")


class _Worker:
    def __init__(self, location, source: Path, retries: int, backoff_s: float, keep_every: int):
        self.location, self.source = location, source
        self.retries, self.backoff_s, self.keep_every = retries, backoff_s, keep_every
        self.queue: list[tuple[str, dict]] = []
        self.busy: str | None = None  # the step being copied now
        self.saved: list[str] = []  # steps copied this run, oldest first: the order its retention prunes by
        self.last_complete: str | None = None
        self.failures, self.last_error = 0, ""
        self.cond = threading.Condition()
        self.closed = False
        self.child = CopyProcess(location) if location.copies_in_child else None
        self.thread = threading.Thread(target=self._run, name=f"checkpoint-upload-{location.name}", daemon=True)
        self.thread.start()

    def submit(self, name: str, files: dict) -> None:
        with self.cond:
            for waiting, _ in self.queue:
                if not self._kept_forever(waiting):
                    log.info(f"checkpoint: {waiting} is not copied to {self.location.name}: {name} supersedes it "
                             f"before its copy started")
            self.queue = [(n, f) for n, f in self.queue if self._kept_forever(n)] + [(name, files)]
            self.cond.notify_all()

    def _kept_forever(self, name: str) -> bool:
        return self.keep_every > 0 and int(STEP_DIR.match(name).group(1)) % self.keep_every == 0

    def pending(self) -> list[str]:
        with self.cond:
            return ([self.busy] if self.busy else []) + [n for n, _ in self.queue]

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if not self.queue:
                    return
                name, files = self.queue.pop(0)
                self.busy = name
            self._copy(name, files)
            with self.cond:
                self.busy = None
                self.cond.notify_all()

    def _copy(self, name: str, files: dict) -> None:
        where = self.location.describe(name)
        for attempt in range(1, self.retries + 2):
            try:
                self._call("put", self.source / name, name, files)
            except Exception as exc:  # any store failure: training goes on, the copy is retried
                if self.closed:
                    return  # finish() stopped this copy (its child killed) and names it as not finished
                error = str(exc) if isinstance(exc, (CheckpointError, OSError)) else f"{type(exc).__name__}: {exc}"
                with self.cond:
                    self.failures += 1
                    self.last_error = " ".join(error.splitlines())[:300]
                if attempt > self.retries:
                    log.warning(f"checkpoint: WARNING copying {name} to {where} failed after {attempt} attempts "
                                f"({self.last_error}); the next save tries again")
                    return
                delay = self.backoff_s * 2 ** (attempt - 1)
                log.warning(f"checkpoint: WARNING copying {name} to {where} failed (attempt {attempt} of "
                            f"{self.retries + 1}: {self.last_error}); retrying in {delay:g} s")
                with self.cond:
                    if self.cond.wait_for(lambda: self.closed, timeout=delay):
                        return  # finish() gave up on this copy and named it; a retry would start a new child
                continue
            with self.cond:
                self.saved = [n for n in self.saved if n != name] + [name]
                self.last_complete = name
            log.info(f"checkpoint: copied {name} to {where} ({len(files) + 1} files, SHA-256 verified)")
            try:
                self._call("prune", self.saved)
            except Exception as exc:  # the copy is complete: a failed deletion only leaves more behind
                log.warning(f"checkpoint: WARNING retention in {self.location.name} failed: {exc}")
            return

    def _call(self, method: str, *args):
        return self.child.call(method, *args) if self.child else getattr(self.location, method)(*args)

    def wait(self, deadline: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self.queue and self.busy is None,
                                      timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.queue.clear()
            self.cond.notify_all()
        if self.child:
            self.child.close()  # a copy still in flight stops here, its location never naming it


class Uploader:
    """Copies each committed step in `source` (run.dir/checkpoints) to every location."""

    def __init__(self, locations: list, source: Path, retries: int, backoff_s: float, keep_every: int):
        self.workers = [_Worker(loc, source, retries, backoff_s, keep_every) for loc in locations]
        self._reported = self.status()  # nothing copied, nothing pending: no record until that changes

    def submit(self, name: str, files: dict) -> None:
        for worker in self.workers:
            worker.submit(name, files)

    def pending(self) -> set[str]:
        """Steps some location still has to copy: local retention keeps them."""
        return {n for w in self.workers for n in w.pending()}

    def status(self) -> dict:
        """{location: {last_complete, failures, pending, last_error}} (metrics.jsonl's checkpoint_copies)."""
        out = {}
        for w in self.workers:
            with w.cond:
                out[w.location.name] = {"last_complete": w.last_complete, "failures": w.failures,
                                        "pending": ([w.busy] if w.busy else []) + [n for n, _ in w.queue],
                                        **({"last_error": w.last_error} if w.last_error else {})}
        return out

    def changed_status(self) -> dict | None:
        """status() when it differs from the last one returned here (so metrics.jsonl records each change)."""
        now = self.status()
        if now == self._reported:
            return None
        self._reported = now
        return now

    def finish(self, wait_s: float) -> dict[str, list[str]]:
        """Wait up to `wait_s` seconds for every pending copy; {location: steps not copied} for the rest,
        whose threads are then stopped."""
        deadline = time.monotonic() + wait_s
        for w in self.workers:
            w.wait(deadline)
        left = {w.location.name: w.pending() for w in self.workers if w.pending()}
        for w in self.workers:
            w.close()
        return left
