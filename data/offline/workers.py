"""Streaming, order-preserving parallel map for the offline corpus tools."""
import collections
import concurrent.futures
import multiprocessing
from concurrent.futures.process import BrokenProcessPool


class WorkerDied(RuntimeError):
    """A worker process ended without finishing its task (the kernel's OOM killer, a signal)."""


def batched(items, size):
    """Lists of `size` consecutive items (the last may be shorter)."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
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
