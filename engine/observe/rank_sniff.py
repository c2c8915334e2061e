"""The pre-flight's sniff test: the same matmul and the same all-reduce timed on every rank, so that a slow
part (a throttled GPU, a degraded link, a host running something else) is named with its host before the big
run is launched onto it.

Each rank keeps the fastest of `REPEATS` tries: a try slowed by a passing hiccup says nothing about the part,
while a slow part is slow on every try. A rank slower than `SNIFF_RATIO` × the median over ranks fails the check.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from parallel import comm
from parallel.distributed import node_name, world_group

REPEATS = 10
# Wider than run.straggler_threshold: a millisecond of work is noisier than a step (CPU ranks sharing a loaded
# host agree within about 25%), while a GPU held at its power or thermal limit, or a link that fell back to a
# slower transport, is about 2× slower or worse.
SNIFF_RATIO = 1.5
# CPU ranks outnumbering their host's cores cannot all run at once: an all-reduce waits on whichever rank the OS
# scheduler left out, so its time is partly the scheduler's (8 ranks on 2 cores: up to 1.56× the median seen in
# CI, fastest of 10). Such hosts take more tries and a wider margin, still well below the 4× or more of a rank
# that adds its own delay to every collective.
SHARED_CORES_RATIO = 2.5
SHARED_CORES_REPEATS = 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fastest(device: torch.device, work, before=None, repeats: int = REPEATS) -> float:
    """Seconds of the fastest of `repeats` calls of `work()`, each after an untimed `before()`, not counting a
    first call that pays for the library's start-up."""
    seconds = []
    for _ in range(repeats + 1):
        if before is not None:
            before()
        _sync(device)
        start = time.perf_counter()
        work()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return min(seconds[1:])


def matmul_seconds(device: torch.device) -> float:
    # 4096² in bf16 keeps a GPU's tensor cores busy for a fraction of a millisecond, 256² in fp32 a CPU core for
    # as long: well above the timer's resolution, and short enough that few tries are cut by the OS scheduler
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    if device.type == "cuda":
        return _fastest(device, lambda: torch.mm(a, b))
    # CPU ranks share their host's cores: timed together they would measure one another, so they take turns
    group, seconds = world_group(), 0.0
    for turn in range(comm.group_size(group)):
        comm.barrier(group)
        if turn == comm.group_rank(group):
            seconds = _fastest(device, lambda: torch.mm(a, b))
    return seconds


def all_reduce_seconds(device: torch.device, shared_cores: bool) -> float:
    numel = (64 if device.type == "cuda" else 1) * 2**20 // 4  # 64 MiB on GPUs (bandwidth-bound), 1 MiB on CPUs
    buffer, group = torch.ones(numel, device=device), world_group()
    # every rank starts together: the time is the transfer, not the wait for the last rank to arrive
    return _fastest(device, lambda: comm.all_reduce(buffer, group), lambda: comm.barrier(group),
                    SHARED_CORES_REPEATS if shared_cores else REPEATS)


def _verdict(name: str, seconds: list[float], hosts: list[str], ratio: float, why: str = "") -> tuple[bool, str]:
    median = statistics.median(seconds)
    limit = f" (limit ×{ratio:g}{why})"
    slow = sorted((r for r, s in enumerate(seconds) if s > ratio * median), key=lambda r: -seconds[r])
    if slow:
        return False, f"{name} alike on every rank: " + "; ".join(
            f"rank {r} on {hosts[r]} {seconds[r] * 1e3:.2f} ms, {seconds[r] / median:.2f}× the median "
            f"{median * 1e3:.2f} ms" for r in slow) + limit
    slowest = max(range(len(seconds)), key=lambda r: seconds[r])
    return True, (f"{name} alike on {len(seconds)} ranks: median {median * 1e3:.2f} ms, slowest rank {slowest} on "
                  f"{hosts[slowest]} {seconds[slowest] / median:.2f}×{limit}")


def _crowded_host(device: torch.device, hosts: list[tuple[str, int]]) -> str | None:
    """A host whose CPU ranks outnumber its cores, as 'NAME (R ranks on C cores)', from every rank's (host,
    cores); None on GPUs or when none is."""
    if device.type == "cuda":
        return None
    names = [name for name, _ in hosts]
    for name, cores in dict(hosts).items():
        if names.count(name) > cores:
            return f"{name} ({names.count(name)} ranks on {cores} cores)"
    return None


def sniff(device: torch.device) -> list[tuple[bool, str]]:
    """(passed, report line) for the matmul and for the all-reduce; [] when there is one rank to compare."""
    group = world_group()
    if group is None:
        return []
    hosts = [None] * comm.group_size(group)
    comm.all_gather_object(hosts, (node_name(), os.cpu_count() or 1), group)
    crowded = _crowded_host(device, hosts)
    hosts = [name for name, _ in hosts]
    mine = torch.tensor([[matmul_seconds(device), all_reduce_seconds(device, crowded is not None)]],
                        dtype=torch.float64, device=device)
    table = comm.all_gather(mine, group).cpu().tolist()
    all_reduce_limit = (SHARED_CORES_RATIO, f": {crowded}") if crowded else (SNIFF_RATIO,)
    return [_verdict("matmul", [row[0] for row in table], hosts, SNIFF_RATIO),
            _verdict("all-reduce", [row[1] for row in table], hosts, *all_reduce_limit)]
