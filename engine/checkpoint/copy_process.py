"""A child process that makes one location's copies, so that they never hold the training process's GIL.

An upload to an object store is Python work (boto3's transfer threads, request signing, the SHA-256
read-back): in a thread of the training process it took the interpreter lock from the step, and a step with a
copy in flight ran at 2.4× its time (docs/benchmarks.md). The uploader's thread for an S3 location (uploader.py)
sends each call here instead and waits on a pipe, which holds no lock. The child is started (spawn, so no
state of the parent is forked) at the first copy and kept for the run, at a lower CPU priority (`NICE`) so
that where cores are short the step wins; its memory is an interpreter with the parent's main module (and
so torch) imported, about 270 MiB, and the upload's parts in flight × part size.
A child that dies is a failed copy, retried by the uploader like any other, in a new child.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os

from engine.checkpoint.files import CheckpointError

NICE = 10  # added to the child's niceness: the copy yields the CPU to the training step


def _serve(location, conn) -> None:
    with contextlib.suppress(OSError):  # not permitted here: the copy still leaves the parent's GIL alone
        os.nice(NICE)
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the parent closed the pipe or exited
            return
        try:
            conn.send((True, getattr(location, method)(*args)))
        except Exception as exc:  # sent back as one line; the uploader warns and retries
            line = str(exc) if isinstance(exc, (CheckpointError, OSError)) else f"{type(exc).__name__}: {exc}"
            conn.send((False, line))


class CopyProcess:
    """Calls `location`'s methods (put, prune) in a child process; the location must pickle."""

    def __init__(self, location):
        self.location, self.name = location, location.name
        self.process = self.conn = None

    def call(self, method: str, *args):
        if self.process is None or not self.process.is_alive():
            self._start()
        process, conn = self.process, self.conn  # close() may run meanwhile, from the thread that ends the run
        try:
            if conn is None:
                raise EOFError
            conn.send((method, args))
            ok, value = conn.recv()
        except (EOFError, OSError):
            code = process.exitcode if process is not None else None
            self.close()
            raise CheckpointError(f"the copy process for {self.name} ended (exit code {code}) before the copy "
                                  f"finished") from None
        if not ok:
            raise CheckpointError(value)
        return value

    def _start(self) -> None:
        self.close()
        context = multiprocessing.get_context("spawn")
        conn, child = context.Pipe()
        process = context.Process(target=_serve, args=(self.location, child), daemon=True,
                                  name=f"checkpoint-copy-{self.name}")
        try:
            process.start()  # refused in a daemonic process, which may have no children
        except (AssertionError, OSError) as exc:
            conn.close()
            raise CheckpointError(f"cannot start the copy process for {self.name} ({exc})") from None
        finally:
            child.close()
        self.process, self.conn = process, conn

    def close(self) -> None:
        """Stop the child now, a copy in flight included (a location never names a partial copy)."""
        process, conn = self.process, self.conn
        self.process = self.conn = None
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join()
            conn.close()
