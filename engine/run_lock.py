"""One training per run directory: the first rank 0 to start holds an OS file lock on `run.dir/run.lock`.

The lock is `fcntl.flock` on an open file, so the kernel releases it when the holder's process ends, however
it ends (a crash, kill -9, the OOM killer): a later launch simply takes it over, with no clean-up step. The
file also says who holds it (host, PID, start time) for the one-line error a second launch prints. Across
hosts this needs a filesystem whose flock is shared between clients (NFSv4, Lustre mounted with `flock`,
GPFS); a lost node's lock is released when the filesystem's lease on it expires.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from engine.config.schema import ConfigError

LOCK_NAME = "run.lock"
# A launcher's check (check_free) holds the lock for an instant: rank 0 tries for this long before refusing.
ACQUIRE_SECONDS = 1.0


class RunDirLock:
    """Held while open; `release()` (or leaving the `with` block) lets the next launch in."""

    def __init__(self, fd: int | None = None):
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor releases the flock
            self.fd = None

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"PID {info['pid']} on {info['host']} since {info['started']}"
    except (ValueError, KeyError, TypeError):  # the holder is between taking the lock and writing its name
        return "a process that has not written its name yet"


def _try_lock(run_dir: Path, wait: float) -> int:
    """An open descriptor of run.dir/run.lock holding the exclusive lock; ConfigError naming the holder."""
    path = run_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"run.dir={run_dir}: cannot open {path} ({exc.strerror}); choose a writable run.dir") \
            from None
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(f"run.dir={run_dir} is in use by another training: {holder} (lock {path}); wait for "
                              f"it to end, stop it, or choose another run.dir") from None
        except OSError as exc:  # ENOLCK: a filesystem without locks
            os.close(fd)
            raise ConfigError(f"run.dir={run_dir}: cannot lock {path} ({exc.strerror}); put run.dir on a "
                              f"filesystem with file locks (flock)") from None


def acquire(run_dir: str | Path) -> RunDirLock:
    """Take run.dir's lock for this process (creating the directory) and write the holder's name in it."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run.dir={run_dir}: cannot create it ({exc.strerror})") from None
    fd = _try_lock(run_dir, ACQUIRE_SECONDS)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    info = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, info + b"\n", 0)
    return RunDirLock(fd)


def check_free(run_dir: str | Path) -> None:
    """ConfigError naming the holder when a live process holds run.dir's lock; changes nothing otherwise."""
    run_dir = Path(run_dir)
    if (run_dir / LOCK_NAME).exists():
        os.close(_try_lock(run_dir, 0.0))


def hold_run_dir(run_dir: str | Path, env) -> RunDirLock:
    """Rank 0 takes the lock; every rank (of `env`, a parallel.distributed.DistEnv) raises the same
    ConfigError if it could not, so that a refused launch stops everywhere at once (one broadcast of a flag)."""
    import torch  # here, not above: launch/check.py uses this module before any rank, without torch

    from parallel import comm
    from parallel.distributed import world_group

    lock, error = RunDirLock(), None
    if env.rank == 0:
        try:
            lock = acquire(run_dir)
        except ConfigError as exc:
            error = exc
    refused = torch.tensor([int(error is not None)], dtype=torch.int32, device=env.device)
    comm.broadcast(refused, src=0, group=world_group())
    if refused.item() and error is None:
        error = ConfigError(f"run.dir={run_dir} is in use by another training (rank 0's message names it)")
    if error is not None:
        raise error
    return lock
