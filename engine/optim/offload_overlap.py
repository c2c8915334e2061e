"""Offloaded AdamW steps overlapped with backward (`optim.offload_overlap`).

When a piece's last gradient reduction of the step has been waited for during backward (a ZeRO unit:
parallel/fsdp.ShardedDataParallel.on_reduced; a DDP bucket's parameters: parallel/ddp.BucketedDDP.on_reduced;
never earlier, the output of an async reduction is undefined until then), its reduced fp32 gradient is copied
to the host (on a side stream on CUDA) and a worker thread starts the piece's AdamW at once, while backward
continues. The global gradient norm is only known after the whole backward, so this step is speculative: it
uses the unscaled, unclipped gradient and writes into spare buffers (master and both moments), leaving the
state untouched. The optimizer step then

- commits when the norm is finite and needs no clipping: the spares become the state;
- discards on a non-finite norm (the step is skipped anyway);
- discards and redoes when the norm needs clipping: the offloaded pieces are stepped again after backward with
  the clipped gradients, as without overlap (a redo costs one host step of the offloaded share on the critical
  path, plus the wasted speculative one off it).

The speculative step is the same kernel on the same inputs as the step it replaces (the loss scale is a power
of two, so unscaling on the host or the device gives the same bits), hence exact. A piece whose gradient still
changes after its reduction is not speculated (the optimizers choose: TP-replicated gradients, summed over TP
in finish_gradients; under DDP also the embedding and output tables). The optimizer provides the state:
`speculate(i, grad, lr, adam_step)` steps piece i's spares, `commit(i)` makes them its state.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch


class SpeculativeHostSteps:
    def __init__(self, opt, eligible: list[int], on_cuda: bool):
        self.opt, self.eligible = opt, set(eligible)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="trilith-offload")
        self.stream = torch.cuda.Stream() if on_cuda else None
        self.jobs: dict = {}
        self.lr = None
        self.readings: dict = {}

    def begin(self, lr: float) -> None:
        """Before the step's backward: its learning rate, which the speculative steps use."""
        self.lr, self.jobs = lr, {}

    def fence(self) -> None:
        """Before the optimizer changes gradients in place (unscale, clip): the copies to the host are done."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def reduced(self, i: int, grad: torch.Tensor) -> None:
        """Piece `i`'s fp32 gradient `grad` (on the device) is final: copy it to the host, step it there."""
        if i not in self.eligible or self.lr is None or i in self.jobs:
            return
        host = self.opt.host_grads[i]
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
        self.opt.speculate(i, grad, lr, adam_step)
        return start, time.perf_counter()

    def settle(self, commit: bool, backward_end: float) -> set:
        """Wait for the speculative steps; commit them or drop them. Returns the pieces committed. Records the
        host seconds and the part of them before `backward_end`."""
        spans = [job.result() for job in self.jobs.values()]
        host = sum(end - start for start, end in spans)
        hidden = sum(max(0.0, min(end, backward_end) - start) for start, end in spans)
        self.readings = {"offload_host_s": host, "offload_hidden_s": hidden}
        done = set(self.jobs) if commit else set()
        for i in done:
            self.opt.commit(i)
        self.jobs, self.lr = {}, None
        return done
