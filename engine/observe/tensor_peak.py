"""The peak of live tensor bytes over a stretch of code: what `torch.cuda.max_memory_allocated` reports on a GPU,
measured the same way on the CPU, where the resident set also holds freed pages, gloo's buffers and the libraries.

    with TensorPeak(device) as peak:
        ...                      # build a Trainer, run a first step
        peak.reset()             # from here on: torch.cuda.reset_peak_memory_stats
        ...                      # the steps to measure
    peak.bytes                   # the most bytes of tensors allocated inside the block alive at one moment since reset

On CUDA it is the allocator's own peak (reset at entry, less what was allocated before). On the CPU it replays
torch.profiler's allocation events (profile_memory=True: every allocation and free of the CPU allocator, with
its address and size) in order, counting only blocks allocated inside: the profiler's own running total also
carries blocks of earlier profiling sessions freed since, so it is not used. `reset` is a marker event
(torch.profiler.record_function): the peak is taken over the allocations after it, of everything alive.
Profiling slows the code inside several-fold: time steps outside the block.
"""
from __future__ import annotations

import torch
from torch._C._profiler import _EventType

MARK = "trilith.tensor_peak.reset"


def _walk(roots):
    stack = list(roots)
    while stack:
        event = stack.pop()
        yield event
        stack.extend(event.children)


def replay_peak(events, since_ns: int = 0) -> int:
    """Most live bytes at or after `since_ns` of (start ns, address, signed size) allocation events, counting only
    blocks allocated among them (a free of an older block is skipped)."""
    live, now, peak = {}, 0, 0
    for at, address, size in sorted(events, key=lambda e: (e[0], e[2] > 0)):  # a free before an alloc at one time
        if size > 0:
            now += size - live.get(address, 0)  # an address is live once: a free left unordered came first
            live[address] = size
        elif address in live:
            now -= live.pop(address)
        if at >= since_ns:
            peak = max(peak, now)
    return peak


class TensorPeak:
    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.bytes = 0
        self._profiler = None

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

    def reset(self) -> None:
        """Count the peak from here on (what was allocated before and is still alive counts)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with torch.profiler.record_function(MARK):
                pass

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._before
            return
        self._profiler.__exit__(*exc)
        events = list(_walk(self._profiler.profiler.kineto_results.experimental_event_tree()))
        since = max((e.start_time_ns for e in events if e.name == MARK), default=0)
        self.bytes = replay_peak(((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size) for e in events
                                  if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"), since)
