"""Optimizer state in host memory (`optim.offload_fraction`, Megatron's meaning): the share of a rank's fp32
optimizer state (master weights and both Adam moments) that lives, and is stepped, on the host.

The share is taken in whole state tensors (a parameter's under DDP, a unit's shard under ZeRO), in the order
backward produces their gradients, each tensor going to the host when that keeps the offloaded elements nearest
the fraction: 0 keeps everything on the device, 1 moves everything. Only what crosses PCIe is pinned: the gradients'
staging buffers (HostGrad) and the write-back's (WriteBack), views into one exact block per rank (PinnedArena);
the masters, the moments and the fp32 gradients a 16-bit one is upcast into never cross, so they are ordinary
host memory.

Exactness: the gradient norm, unscaling and clipping still run on the device over the same tensors, and the
AdamW kernel is elementwise and per tensor, so a tensor stepped on the host gets the update it would get on the
device wherever the same kernel runs (on CPU: bit for bit).
"""
from __future__ import annotations

import os

import torch

HOST = torch.device("cpu")


def offloaded(numels: list[int], fraction: float) -> list[bool]:
    """Which of these state tensors (in order) go to the host so that their elements come nearest `fraction`
    of the total: a tensor goes when at least half of it fits under the target."""
    target, taken, out = fraction * sum(numels), 0, []
    for n in numels:
        go = n > 0 and taken + n / 2 <= target
        taken += n if go else 0
        out.append(go)
    return out


def host_threads(cfg) -> int:
    """Intra-op threads of the host step's worker (optim.offload_threads; 0: the node's cores over its local
    ranks, minus one for the rank's own autograd and loader thread, at least one)."""
    if cfg.offload_threads > 0:
        return cfg.offload_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) - 1)


def pinned() -> bool:
    return torch.cuda.is_available()


def host_of(device: torch.device) -> torch.device:
    """Where the host memory of a rank on `device` lives: the CPU, except for a rank whose tensors are on the
    meta device (engine/dry_run simulates a large job's ranks on one CPU): its host buffers are shapes too."""
    return device if device.type == "meta" else HOST


def host_empty(like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An ordinary (pageable) host buffer shaped like `like`."""
    return torch.empty(like.shape, dtype=dtype, device=host_of(like.device))


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """An fp32 host copy of `t`."""
    return host_empty(t).copy_(t.detach())


def even(numel: int) -> int:
    """A 16-bit buffer's elements rounded up to even, so that what follows it in the arena is 4-byte aligned."""
    return numel + numel % 2


class PinnedArena:
    """Every host buffer of a rank that crosses PCIe, as views into one block of exactly their total size (each
    request's bytes rounded up to a multiple of 4, for the alignment of the fp32 views). torch's caching host
    allocator rounds each pinned tensor up to a power of two (a 180 MiB shard takes 256 MiB); this block comes
    from the ordinary CPU allocator, exact, and on a GPU is page-locked in place (cudaHostRegister), so
    non_blocking copies from and to it are asynchronous DMA. On CPU it is ordinary memory."""

    def __init__(self, requests: list[tuple[int, torch.dtype]], host: torch.device = HOST):
        sizes = [-(-numel * dtype.itemsize // 4) * 4 for numel, dtype in requests]
        self.block = torch.empty(sum(sizes), dtype=torch.uint8, device=host)
        self.views, at = [], 0
        for (numel, dtype), size in zip(requests, sizes):
            self.views.append(self.block[at:at + numel * dtype.itemsize].view(dtype))
            at += size
        self.registered = False
        if pinned() and self.block.is_cpu and self.block.numel():
            code = torch.cuda.cudart().cudaHostRegister(self.block.data_ptr(), self.block.numel(), 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister of the offload's {self.block.numel()} staging bytes failed "
                                   f"(error {int(code)}): lower optim.offload_fraction or raise the locked-memory limit")
            self.registered = True

    def __del__(self):
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.block.data_ptr())

    def tensors(self) -> list:
        return [self.block]


class WriteBack:
    """An offloaded master's way back into its device parameter: the host rounds the fp32 master into a pinned
    `staging` buffer in the parameter's dtype (round-to-nearest-even, the bits the device's cast gives), then a
    side stream copies it to the device without blocking the host, and records one event that the parameter's
    first use waits on (a stream wait, not a host synchronisation). On CPU the same code runs with the copies
    synchronous, except that a CPU device's parameter, which the host writes where it is (`in_place`), takes the
    rounded master directly (the staging copy would be a second pass by the same cores). The next write-back into
    `staging` first waits for this copy (issued a whole step earlier). When the parameter is fp32 the master
    itself lives in `staging` (`holds_master`): nothing to round, so the copy to the device reads it where AdamW
    wrote it; whoever writes the master first calls `settled`."""

    def __init__(self, staging: torch.Tensor, stream, holds_master: bool = False):
        self.staging, self.stream, self.holds_master, self.in_place = staging, stream, holds_master, stream is None
        self.event, self.waiting = None, False

    def settled(self) -> None:
        """The host may overwrite `staging`: the last copy from it is complete (issued a step ago; no-op on CPU)."""
        if self.event is not None:
            self.event.synchronize()

    def send(self, device: torch.Tensor, master: torch.Tensor) -> None:
        if self.in_place:
            device.view(-1).copy_(master.detach().reshape(-1))
            return
        if not self.holds_master:
            self.settled()
            self.staging.copy_(master.detach().reshape(-1))
        if self.stream is None:
            device.view(-1).copy_(self.staging)
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # the device tensor's earlier readers are done
        with torch.cuda.stream(self.stream):
            device.view(-1).copy_(self.staging, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        self.waiting = True

    def wait(self) -> None:
        """Before the device tensor's first use: the compute stream waits for the copy (no-op on CPU)."""
        if self.waiting:
            torch.cuda.current_stream().wait_event(self.event)
            self.waiting = False


class HostGrad:
    """Where an offloaded piece's gradient lands on the host. It crosses PCIe in the device gradient's own
    dtype: a 16-bit gradient into a pinned 16-bit `staging` buffer (half the bytes of an fp32 copy), then upcast
    on the host into `fp32`, what the host step reads (the upcast is exact: the same bits as upcasting on the
    device); an fp32 gradient straight into `fp32`, then the one pinned. A ZeRO unit's fp32-reduced elements
    (`tail`, positions in its shard, parallel/fsdp_units.Unit.grad32) cross in fp32, in the staging buffer's last
    bytes, and overwrite their positions after the upcast, as Unit.master_grad does on the device."""

    def __init__(self, like: torch.Tensor, dtype: torch.dtype, crossing: torch.Tensor, tail: slice = slice(0, 0)):
        """`crossing`: its pinned buffer, of `request(like.numel(), dtype, tail)` (a PinnedArena view)."""
        n = like.numel()
        self.tail, self.staging, self.has_tail = tail, None, False
        if dtype == torch.float32:
            self.fp32 = crossing.view(like.shape)
        else:
            self.fp32 = host_empty(like)
            self.staging = crossing
            self.main, self.tail32 = self.staging[:n], self.staging[even(n):].view(torch.float32)

    @staticmethod
    def request(numel: int, dtype: torch.dtype, tail: slice = slice(0, 0)) -> tuple[int, torch.dtype]:
        """The pinned buffer a gradient crosses in: fp32 itself, or 16 bits with the fp32 tail after it (the
        element count rounded up to even, so that the tail starts 4-byte aligned)."""
        return (numel, dtype) if dtype == torch.float32 else (even(numel) + 2 * (tail.stop - tail.start), dtype)

    def send(self, grad: torch.Tensor, tail32: torch.Tensor | None = None) -> None:
        """Issue the copies from the device (asynchronous when pinned: wait for the stream before `land`)."""
        if self.staging is None:
            self.fp32.view(-1).copy_(grad.reshape(-1), non_blocking=True)
            return
        self.main.copy_(grad.reshape(-1), non_blocking=True)
        self.has_tail = tail32 is not None
        if self.has_tail:
            self.tail32.copy_(tail32, non_blocking=True)

    def land(self) -> torch.Tensor:
        """After the copies are complete: the fp32 gradient on the host (upcast here)."""
        if self.staging is not None:
            flat = self.fp32.view(-1)
            flat.copy_(self.main)
            if self.has_tail:
                flat[self.tail].copy_(self.tail32)
        return self.fp32

    def take(self, grad: torch.Tensor, tail32: torch.Tensor | None = None, coef: float | None = None
             ) -> torch.Tensor:
        """`send` and `land` in one pass where the host reads the device's gradient in place (a CPU device): a
        16-bit one upcast straight into `fp32`, no staging copy; an fp32 one copied and clipped by `coef` on the
        way (the bits of a copy, then the clip)."""
        flat = self.fp32.view(-1)
        if self.staging is None and coef is not None:
            torch.mul(grad.reshape(-1), coef, out=flat)
            return self.fp32
        flat.copy_(grad.reshape(-1))
        if tail32 is not None:
            flat[self.tail].copy_(tail32)
        return self.fp32

    def tensors(self) -> list:
        """Its ordinary host memory (the crossing buffer is the arena's)."""
        return [self.fp32] if self.staging is not None else []


def wait_for_device(tensors: list) -> None:
    """The copies issued on the current stream from these device tensors are complete (no-op on CPU)."""
    if any(t.is_cuda for t in tensors):
        torch.cuda.current_stream().synchronize()


def by_device(tensors: list) -> list[list]:
    """`tensors` grouped by device (a multi-tensor kernel runs on one device at a time)."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def side_stream(device: torch.device):
    """The stream write-backs are copied on (None on CPU: the copies are synchronous)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None
