"""Offloaded AdamW steps overlapped with backward (`optim.offload_overlap`).

When a piece's last gradient reduction of the step has been waited for during backward (a ZeRO unit:
parallel/fsdp.ShardedDataParallel.on_reduced; a DDP bucket's parameters: parallel/ddp.BucketedDDP.on_reduced;
never earlier, the output of an async reduction is undefined until then), its reduced gradient is copied to the
host in its own dtype (engine/optim/offload.HostGrad; on a side stream on CUDA) and a worker thread upcasts it,
unscales it and starts the piece's AdamW at once, while backward continues. The global gradient norm is only
known after the whole backward, so this step is speculative: it uses the unclipped gradient and writes into
spare buffers (master and both moments), leaving the state untouched. The optimizer step then

- commits when the norm is finite and needs no clipping: the spares become the state;
- discards on a non-finite norm (the step is skipped anyway);
- discards when the norm needs clipping, and steps the piece again after backward from the host gradient it
  already has, scaled there by the clip coefficient (no second copy from the device). Jobs still queued are
  cancelled, not awaited; only a job already running is waited for (it reads the host gradient).

The speculative step is the same kernel on the same inputs as the step it replaces (the loss scale is a power
of two, and the host upcasts, unscales and clips with the same elementwise operations as the device), hence
exact. A piece whose gradient still changes after its reduction is not speculated (the optimizers choose:
TP-replicated gradients, summed over TP in finish_gradients; under DDP also the embedding and output tables).
`opt` (engine/optim/host_offload.HostOffload, which wraps the optimizer) provides the state: `host_grads[i]` (a
HostGrad), `send_grad(i)` issues piece i's copies and returns the device tensors read, `speculate(i, grad, lr,
adam_step)` steps piece i's spares, `commit(i)` makes them its state, `scaler` and `adam_step`.

The worker runs with grad mode off (spares get no grad_fn) and `threads` intra-op threads (optim.offload_threads):
torch.set_num_threads is per thread for the OpenMP team, so the worker's team leaves cores to the autograd thread
and the data loader; the main thread's setting is put back after (torch also keeps it as the default of new threads).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch


def worker_threads(threads: int) -> None:
    """On the worker: its OpenMP team's size. torch initialises a thread's team from the process default at the
    thread's first parallel region (get_num_threads), which would undo a setting made before it."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


class SpeculativeHostSteps:
    def __init__(self, opt, eligible: list[int], on_cuda: bool, threads: int = 0, adaptive: bool = False):
        self.opt, self.eligible = opt, set(eligible)
        # optim.offload_overlap=auto: speculate on a step only when the last finite step did not clip
        self.adaptive, self.last_clipped = adaptive, False
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="trilith-offload")
        if threads > 0:
            main = torch.get_num_threads()
            self.worker.submit(worker_threads, threads).result()
            torch.set_num_threads(main)
        self.stream = torch.cuda.Stream() if on_cuda else None
        self.jobs: dict = {}
        self.landed: set = set()  # pieces whose host gradient a job has upcast and unscaled
        self.lr = None
        self.readings: dict = {}

    def begin(self, lr: float) -> None:
        """Before the step's backward: its learning rate, which the speculative steps use."""
        self.jobs, self.landed = {}, set()
        self.lr = None if self.adaptive and self.last_clipped else lr  # None: no speculation this step

    def fence(self) -> None:
        """Before the optimizer changes gradients in place (unscale, clip): the copies to the host are done."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def sent(self) -> set:
        """The pieces whose gradient crossed to the host during this step's backward."""
        return set(self.jobs)

    def reduced(self, i: int) -> None:
        """Piece `i`'s gradient is final: copy it to the host, step it there."""
        if i not in self.eligible or self.lr is None or i in self.jobs:
            return
        event = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for t in self.opt.send_grad(i):
                    t.record_stream(self.stream)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            self.opt.send_grad(i)
        self.jobs[i] = self.worker.submit(self._step, i, event, self.lr, self.opt.scaler.scale, self.opt.adam_step)

    @torch.no_grad()
    def _step(self, i: int, event, lr: float, scale: float, adam_step: int) -> tuple[float, float]:
        if event is not None:
            event.synchronize()
        start = time.perf_counter()
        grad = self.opt.host_grads[i].land()
        if self.opt.scaler.enabled:
            torch._foreach_div_([grad], scale)  # the device's unscaling, the same kernel
        self.landed.add(i)
        self.opt.speculate(i, grad, lr, adam_step)
        return start, time.perf_counter()

    def settle(self, commit: bool, backward_end: float, clipped: bool = False, overflow: bool = False
               ) -> tuple[set, set]:
        """Commit the speculative steps (waiting for them) or drop them: queued ones are cancelled, a running
        one is waited for. Returns (pieces committed, pieces whose host gradient is landed and unscaled).
        Records the host seconds and the part of them before `backward_end`, and whether this (finite) step
        `clipped`, which decides the next step's speculation under optim.offload_overlap=auto."""
        if not overflow:
            self.last_clipped = clipped
        running = [job for job in self.jobs.values() if commit or not job.cancel()]  # all cancelled before a wait
        spans = [job.result() for job in running]
        host = sum(end - start for start, end in spans)
        hidden = sum(max(0.0, min(end, backward_end) - start) for start, end in spans)
        self.readings = {"offload_host_s": host, "offload_hidden_s": hidden}
        done = set(self.jobs) if commit else set()
        for i in done:
            self.opt.commit(i)
        landed = set(self.landed)
        self.jobs, self.lr, self.landed = {}, None, set()
        return done, landed
