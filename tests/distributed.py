"""Persistent pools of CPU ranks (gloo) for multi-process tests: started once per module, reused per test.

    pool = WorkerPool(4)
    results = pool.run(some_module_level_function, arg)   # fn(rank, world_size, arg) on every rank

A failure on any rank raises here with that rank's traceback; a rank that hangs raises after `timeout`.
The ranks run collectives under NCCL's semantics (parallel/nccl_semantics.py: one handle per p2p batch,
async outputs poisoned until waited for, inputs checked untouched), so that gloo's leniency hides nothing.
"""
from __future__ import annotations

import contextlib
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, tasks, results):
    os.environ.setdefault("TRILITH_COMM_SEMANTICS", "nccl")  # read when parallel/ is first imported, below
    import torch
    import torch.distributed as dist

    from parallel import nccl_semantics
    torch.set_num_threads(1)
    os.environ.setdefault("TRILITH_TEST_WORKER", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    nccl_semantics.bind_device(torch.device("cpu"))  # as the launcher's pick_device does
    while True:
        job = tasks.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # report everything: the test decides
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_worker_main, args=(r, world_size, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 300, **kwargs) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out: dict = {}
        errors = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:  # the ranks that failed first are usually why the others wait: show them
                self.close(force=True)
                raise TimeoutError(f"ranks {sorted(set(range(self.world_size)) - set(out))} did not finish "
                                   f"{fn.__name__} within {timeout}s" + "".join(f"; before that:\n{e}" for e in errors))
            out[rank] = value
            if not ok:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise RuntimeError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return [out[r] for r in range(self.world_size)]

    def close(self, force: bool = False):
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive() and not force:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 20)
            if p.is_alive():
                p.kill()


@contextlib.contextmanager
def gloo_semantics():
    """Inside a task: gloo's own semantics, for a test of what this project does on gloo alone (the early
    pipeline receives). Objects built inside read the switch when they are built."""
    from parallel import nccl_semantics
    saved, nccl_semantics.ENABLED = nccl_semantics.ENABLED, False
    try:
        yield
    finally:
        nccl_semantics.ENABLED = saved


@contextlib.contextmanager
def worker_pools(*sizes: int):
    """{size: WorkerPool(size)} for a module's tests, all closed afterwards."""
    made = {n: WorkerPool(n) for n in sizes}
    try:
        yield made
    finally:
        for pool in made.values():
            pool.close()
