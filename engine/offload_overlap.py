"""Offloaded AdamW steps overlapped with backward (`optim.offload_overlap`, ZeRO stages 1-3).

When a unit's last gradient reduction of the step has been waited for during backward
(parallel/fsdp.ShardedDataParallel.on_reduced: never earlier, the output of an async reduction is undefined
until then), its reduced fp32 shard is copied to the host (on a side stream on CUDA) and a worker thread starts
the unit's AdamW at once, while backward continues. The global gradient norm is only known after the whole
backward, so this step is speculative: it uses the unscaled, unclipped gradient and writes into spare buffers
(master and both moments), leaving the state untouched. The optimizer step then

- commits when the norm is finite and needs no clipping: the spares become the state (a swap, no copy);
- discards on a non-finite norm (the step is skipped anyway);
- discards and redoes when the norm needs clipping: the offloaded units are stepped again after backward with
  the clipped gradients, as without overlap (a redo costs one host step of the offloaded share on the critical
  path, plus the wasted speculative one off it).

The speculative step is the same kernel on the same inputs as the step it replaces (the loss scale is a power
of two, so unscaling on the host or the device gives the same bits), hence exact. A unit whose gradient still
changes after its reduction (TP-replicated gradients summed over TP in finish_gradients) is not speculated.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from engine import offload


class SpeculativeHostSteps:
    def __init__(self, opt, units: list, eligible: list[int]):
        self.opt, self.units = opt, units
        self.index = {id(units[i]): i for i in eligible}
        self.spares = {i: [offload.host_empty(opt.master[i]) for _ in range(3)] for i in eligible}
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="trilith-offload")
        self.stream = torch.cuda.Stream() if any(u.param_shard.is_cuda for u in units) else None
        self.jobs: dict = {}
        self.lr = None
        self.redos = 0
        self.readings: dict = {}

    def begin(self, lr: float) -> None:
        """Before the step's backward: its learning rate, which the speculative steps use."""
        self.lr, self.jobs = lr, {}

    def reduced(self, unit) -> None:
        """`unit`'s gradient shard is final (its reduction waited for): copy it to the host, step it there."""
        i = self.index.get(id(unit))
        if i is None or self.lr is None or i in self.jobs:
            return
        grad, host = unit.master_grad(), self.opt.host_grads[i]
        event = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                host.copy_(grad, non_blocking=True)
                grad.record_stream(self.stream)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            host.copy_(grad)
        self.jobs[i] = self.worker.submit(self._step, i, event, self.lr, self.opt.scaler.scale, self.opt.adam_step)

    def _step(self, i: int, event, lr: float, scale: float, adam_step: int) -> tuple[float, float]:
        if event is not None:
            event.synchronize()
        start = time.perf_counter()
        grad = self.opt.host_grads[i]
        if self.opt.scaler.enabled:
            grad.div_(scale)
        spare = self.spares[i]
        for dest, source in zip(spare, (self.opt.master[i], self.opt.exp_avg[i], self.opt.exp_avg_sq[i])):
            dest.copy_(source)
        self.opt.update([i], [grad], lr, adam_step, *([t] for t in spare))
        return start, time.perf_counter()

    def settle(self, commit: bool, backward_end: float) -> set:
        """Wait for the speculative steps; commit them (swap the spares in) or drop them. Returns the units
        committed. Records the host seconds, the part of them before `backward_end`, and redos."""
        spans = [job.result() for job in self.jobs.values()]
        host = sum(end - start for start, end in spans)
        hidden = sum(max(0.0, min(end, backward_end) - start) for start, end in spans)
        self.readings = {"offload_host_s": host, "offload_hidden_s": hidden}
        done = set(self.jobs) if commit else set()
        for i in done:
            state = (self.opt.master, self.opt.exp_avg, self.opt.exp_avg_sq)
            for tensors, spare_index in zip(state, range(3)):
                tensors[i], self.spares[i][spare_index] = self.spares[i][spare_index], tensors[i]
        self.jobs, self.lr = {}, None
        return done

    def held(self) -> list:
        return [t for spare in self.spares.values() for t in spare]
