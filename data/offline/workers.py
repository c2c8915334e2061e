"""Streaming, order-preserving parallel map for the offline corpus tools."""
import collections
import concurrent.futures
import multiprocessing
from concurrent.futures.process import BrokenProcessPool


class WorkerDied(RuntimeError):
    """A worker process ended without finishing its task (the kernel's OOM killer, a signal)."""


def batched(items, size, max_weight=None, weight=None):
    """Lists of `size` consecutive items (the last may be shorter); with `max_weight`, a list also ends once its
    items' `weight(item)` add up to that much."""
    batch, total = [], 0
    for item in items:
        batch.append(item)
        total += weight(item) if max_weight is not None else 0
        if len(batch) == size or (max_weight is not None and total >= max_weight):
            yield batch
            batch, total = [], 0
    if batch:
        yield batch


def ordered_map(task, batches, workers, initializer, initargs):
    """Yield task(batch) in input order, keeping a bounded number of batches in flight (streaming).

    With one worker everything runs in this process; otherwise a pool whose processes each call
    initializer(*initargs) once. A worker that dies raises WorkerDied: the executor notices a lost
    process, where multiprocessing.Pool would wait for its result forever.
    """
    if workers <= 1:
        initializer(*initargs)
        yield from map(task, batches)
        return
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    pool = concurrent.futures.ProcessPoolExecutor(workers, ctx, initializer, initargs)
    try:
        pending = collections.deque()
        for batch in batches:
            pending.append(pool.submit(task, batch))
            if len(pending) >= 4 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise WorkerDied("a worker process died (out of memory, or killed by a signal); rerun with fewer "
                         "--workers or a smaller --batch-size") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
