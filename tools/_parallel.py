"""Streaming, order-preserving parallel map for the offline corpus tools."""
import collections
import multiprocessing


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
    initializer(*initargs) once.
    """
    if workers <= 1:
        initializer(*initargs)
        yield from map(task, batches)
        return
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    pool = ctx.Pool(workers, initializer, initargs)
    try:
        pending = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(task, (batch,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()
