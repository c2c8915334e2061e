"""The peak of live tensor bytes over a stretch of code: what `torch.cuda.max_memory_allocated` reports on a GPU,
measured the same way on the CPU, where the resident set also holds freed pages, gloo's buffers and the libraries.

    with TensorPeak(device) as peak:
        ...                      # build a Trainer, run a first step
        with peak.measuring():   # as torch.cuda.reset_peak_memory_stats before and max_memory_allocated after
            ...                  # the steps to measure
    peak.bytes                   # the most bytes of tensors allocated inside TensorPeak alive at one moment of
                                 # the measured block

On CUDA it is the allocator's own peak (reset at entry, less what was allocated before). On the CPU it replays
torch.profiler's allocation events (profile_memory=True: every allocation and free of the CPU allocator, with
its address and size) in order, counting only blocks allocated inside: the profiler's own running total also
carries blocks of earlier profiling sessions freed since, so it is not used. `measuring` is a profiler range
(torch.profiler.record_function): the peak is taken over the allocations within it, of everything alive.
Profiling slows the code inside several-fold: time steps outside the block.
"""
from __future__ import annotations

import contextlib

import torch
from torch._C._profiler import _EventType

MARK = "trilith.tensor_peak.measured"


def _walk(roots):
    stack = list(roots)
    while stack:
        event = stack.pop()
        yield event
        stack.extend(event.children)


def replay_peak(events, since_ns: int = 0, until_ns: float = float("inf")) -> int:
    """Most live bytes from `since_ns` to `until_ns` of (start ns, address, signed size) allocation events,
    counting only blocks allocated among them (a free of an older block is skipped)."""
    live, now, peak = {}, 0, 0
    for at, address, size in sorted(events, key=lambda e: (e[0], e[2] > 0)):  # a free before an alloc at one time
        if size > 0:
            now += size - live.get(address, 0)  # an address is live once: a free left unordered came first
            live[address] = size
        elif address in live:
            now -= live.pop(address)
        if since_ns <= at <= until_ns:
            peak = max(peak, now)
    return peak


class TensorPeak:
    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.bytes = 0
        self._profiler, self._cuda_peak = None, None

    def __enter__(self) -> "TensorPeak":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    profile_memory=True)
            self._profiler.__enter__()
        return self

    @contextlib.contextmanager
    def measuring(self):
        """Take the peak over this block (what was allocated earlier inside TensorPeak and is still alive counts)."""
        if self.device.type != "cuda":
            with torch.profiler.record_function(MARK):
                yield
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        torch.cuda.synchronize(self.device)
        self._cuda_peak = torch.cuda.max_memory_allocated(self.device)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = self._cuda_peak if self._cuda_peak is not None else torch.cuda.max_memory_allocated(self.device)
            self.bytes = peak - self._before
            return
        self._profiler.__exit__(*exc)
        events = list(_walk(self._profiler.profiler.kineto_results.experimental_event_tree()))
        block = max((e for e in events if e.name == MARK), key=lambda e: e.start_time_ns, default=None)
        bounds = (block.start_time_ns, block.end_time_ns) if block is not None else ()
        self.bytes = replay_peak(((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size) for e in events
                                  if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"), *bounds)
