"""CPU training: have glibc's malloc keep freed memory for the next step instead of returning it to the kernel.

Every step frees its activations and allocates the same sizes again. glibc serves a block above its mmap
threshold (128 KiB, raised automatically up to at most 32 MiB) with a fresh mmap and unmaps it on free, and
returns the top of the heap to the kernel once more than twice that is free. The next step's tensors are then
new pages, each page faulted in and zeroed by the kernel on first write: at the peer benchmark's shape
(1,024 tokens per rank, an 8,192-token vocabulary, so 32 MiB logits) that was a tenth of a CPU step
(docs/benchmarks.md). Raising both thresholds to 1 GiB makes the allocator reuse the pages it already has.

`train.cpu_allocator`: `reuse` (default) sets the thresholds when training runs on the CPU; `default` leaves
glibc alone. GPU runs keep activations in CUDA's caching allocator and are not touched. Thresholds given in
the environment (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, read by glibc at start) win over this.
Elsewhere than glibc (musl, macOS) this does nothing.
"""
from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
THRESHOLD_BYTES = 1 << 30
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def reuse_freed_memory(environ=None) -> str:
    """Raise glibc's mmap and trim thresholds for this process; returns what was done, for the log."""
    env = os.environ if environ is None else environ
    chosen = [name for name in ENVIRONMENT if name in env]
    if chosen:
        return f"malloc thresholds left as set in the environment ({', '.join(chosen)})"
    if platform.libc_ver()[0] != "glibc":
        return "malloc left alone (not glibc)"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES)):
        return "malloc left alone (glibc refused the thresholds)"
    return f"malloc keeps freed memory for reuse (mmap and trim thresholds {THRESHOLD_BYTES >> 20} MiB)"
