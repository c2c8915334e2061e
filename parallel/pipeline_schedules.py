"""Schedules of one step's micro-batches: without a pipeline, GPipe, 1F1B and interleaved 1F1B; the zero-bubble
ZB-H1 and ZBV run from their plan in parallel/zero_bubble.py.

Each rank runs its own model chunks; `PipelineComm` moves activations forward and gradients backward.
Every micro-batch's mean token loss is backpropagated with weight loss_scale / m, exactly as
`forward_backward_no_pipeline` does, so gradients equal the single-process model's.

    no pipeline  each micro-batch forward then backward on the one chunk (`forward_backward_no_pipeline`).
    GPipe        all m forwards, then all m backwards: up to m micro-batches' activations live.
    1F1B         p − rank − 1 warm-up forwards, then one forward / one backward: at most p live.
    interleaved  1F1B over v virtual chunks per rank (chunk c of the model on rank c mod p); the bubble
                 shrinks from (p−1)/(m+p−1) to (p−1)/(v·m+p−1) at the cost of v× more messages.

The interleaved schedule follows Megatron-LM's `forward_backward_pipelining_with_interleaving` (facts only;
the code is ours). With `defer_weight_grads`, GPipe and 1F1B split each backward after which a stage would
only wait (GPipe's backward phase, 1F1B's cool-down and last steady-state slot) in two, as zero-bubble
schedules do: the input gradient is computed and sent first, the weight gradients while it travels
(WeightGradQueue in kernels/grad_accumulation.py), so the previous stage starts its backward earlier. The
chain of last backwards that ends every step then costs input-gradient passes where it cost whole backwards;
the gradients are bit-identical. A `ScheduleTrace` records every slot (kind F, B or W, micro-batch, chunk,
start, end) and the number of live micro-batch activations (forward done, backward not yet). An activation
sent to the next stage has its values freed at once (`_Steps.release`); `forward_only_pipeline` is the
evaluation pass.
"""
from __future__ import annotations

import functools
import time
from collections import deque

import torch
from torch.autograd.variable import Variable

from kernels.grad_accumulation import WeightGradQueue
from parallel import comm
from parallel.comm import named_range
from parallel.micro_batch import MicroBatch
from parallel.zero_bubble import forward_only_v, loss_rank, run_zero_bubble
from parallel.zero_bubble_plan import ZERO_BUBBLE, chunks_per_rank


def forward_backward_no_pipeline(model, micro_batches: list, loss_scale: float = 1.0) -> torch.Tensor:
    """Each micro-batch's mean token loss, backpropagated with weight 1/m; returns those losses ([m], float32,
    detached). `micro_batches`: MicroBatch objects or plain token tensors [b, s + 1]."""
    micro_batches = [MicroBatch.of(mb) for mb in micro_batches]
    m = len(micro_batches)
    losses = []
    for mb in micro_batches:
        args, kwargs = mb.forward_args(first=True, last=True)
        with named_range("forward"):
            loss = model(*args, **kwargs)
        with named_range("backward"):
            (loss * (loss_scale / m)).backward()
        losses.append(loss.detach().float())
    return torch.stack(losses)


@torch.no_grad()
def forward_only_no_pipeline(model, micro_batches: list) -> torch.Tensor:
    """Evaluation: the mean of the micro-batches' mean token losses, no gradients."""
    losses = [model(*args, **kwargs).float() for args, kwargs in
              (MicroBatch.of(mb).forward_args(first=True, last=True) for mb in micro_batches)]
    return torch.stack(losses).mean()


class ScheduleTrace:
    """Per-rank record of compute slots; `peak_live` counts (chunk, micro-batch) activations held.

    On CUDA a slot's ends are CUDA events recorded on the compute stream, so a slot lasts as long as its
    kernels ran, not as long as the host took to queue them; the events are read (one synchronisation) when
    `events` is first asked for. On the CPU the host clock is the compute's clock, and each mark also reads
    the thread's CPU clock: `compute_events` then gives each slot the CPU time its thread spent in it, what the
    slot costs on a core of its own when ranks share cores (with one intra-op thread, as
    tools/pipeline_trace.py runs them; gloo's transfers run between slots, on threads of their own)."""

    def __init__(self, device: torch.device | None = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self._slots: list = []  # (kind, micro_batch, chunk, start mark, end mark)
        self._origin = None  # (wall-clock seconds, CUDA event) of the first mark, on CUDA
        self.live = 0
        self.peak_live = 0
        self._kept: set = set()  # (chunk, micro-batch) whose B ran with its W still to come

    def mark(self):
        """A point in the compute stream's time, to give `add`."""
        if not self.cuda:
            return time.time(), time.thread_time()
        event = torch.cuda.Event(enable_timing=True)
        if self._origin is None:  # wall-clock time of the first event, so that ranks' traces line up
            torch.cuda.synchronize()
            event.record()
            self._origin = (time.time(), event)
        else:
            event.record()
        return event

    def add(self, kind: str, micro_batch: int, chunk: int, start, end, keep: bool = False) -> None:
        """`keep`: a B whose W runs later, in another slot (the zero-bubble schedules): its micro-batch's
        activation counts as live until that W, which still needs the layers' inputs."""
        self._slots.append((kind, micro_batch, chunk, start, end))
        if kind == "F":
            self.live += 1
        elif kind == "B" and keep:
            self._kept.add((chunk, micro_batch))
        elif kind == "B" or (chunk, micro_batch) in self._kept:
            self._kept.discard((chunk, micro_batch))
            self.live -= 1
        self.peak_live = max(self.peak_live, self.live)

    @property
    def events(self) -> list:
        """(kind "F" | "B" | "W", micro_batch, chunk, t_start, t_end) in wall-clock seconds."""
        if not self.cuda:
            return [(kind, mb, chunk, start[0], end[0]) for kind, mb, chunk, start, end in self._slots]
        torch.cuda.synchronize()
        wall, origin = self._origin if self._origin else (0.0, None)
        return [(kind, mb, chunk, wall + origin.elapsed_time(start) / 1e3, wall + origin.elapsed_time(end) / 1e3)
                for kind, mb, chunk, start, end in self._slots]

    @property
    def compute_events(self) -> list:
        """`events` with each slot's end at its start plus the time it computed: on the CPU its thread's CPU
        time (a rank taken off its core mid-slot is not charged the wait), on CUDA the events' own span."""
        if self.cuda:
            return self.events
        return [(kind, mb, chunk, start[0], start[0] + end[1] - start[1])
                for kind, mb, chunk, start, end in self._slots]


class _Steps:
    """Forward and backward of one (chunk, micro-batch), with the loss bookkeeping of the last chunk."""

    def __init__(self, chunks, micro_batches, loss_scale: float, trace: ScheduleTrace | None,
                 defer_weight_grads: bool = False):
        self.chunks, self.micro_batches, self.trace = chunks, micro_batches, trace
        self.defer_weight_grads = defer_weight_grads
        self.weight = loss_scale / len(micro_batches)
        self.losses: list[torch.Tensor] = []

    def forward(self, chunk_id: int, mb: int, received):
        chunk = self.chunks[chunk_id]
        start = self.trace.mark() if self.trace is not None else None
        args, kwargs = self.micro_batches[mb].forward_args(chunk.pre_process, chunk.post_process, received)
        with named_range("forward"):
            out = chunk(*args, **kwargs)
        if chunk.post_process:
            self.losses.append(out.detach().float())
            out = out * self.weight
        if self.trace is not None:
            self.trace.add("F", mb, chunk_id, start, self.trace.mark())
        return out

    def release(self, chunk_id: int, output) -> None:
        """Free the values of an activation just sent to the next stage (as Megatron-LM's
        deallocate_output_tensor): that stage holds its own copy, and this one's backward needs only the
        tensor's autograd node, so one [b, s, h] per micro-batch in flight is given back."""
        if output is not None and not self.chunks[chunk_id].post_process and output._base is None:
            output.data = torch.empty(1, dtype=output.dtype, device=output.device)

    def backward(self, chunk_id: int, mb: int, received, output, output_grad, keep: bool = False):
        """`keep`: its W runs in a later slot (ScheduleTrace.add)."""
        start = self.trace.mark() if self.trace is not None else None
        with named_range("backward"):
            if output_grad is None:  # the last chunk: the output is the scaled loss
                torch.autograd.backward(output)
            else:  # the output may be released: call the engine directly, skipping the public API's shape check
                Variable._execution_engine.run_backward(tensors=(output,), grad_tensors=(output_grad,),
                                                       keep_graph=False, create_graph=False, inputs=(),
                                                       allow_unreachable=True, accumulate_grad=True)
        if self.trace is not None:
            self.trace.add("B", mb, chunk_id, start, self.trace.mark(), keep)
        return None if received is None else received.grad

    def backward_and_send(self, pipe, mb: int, received, output, output_grad) -> None:
        """The backward of (chunk 0, `mb`) after which this stage would only wait, and the send of its input
        gradient; with `defer_weight_grads` and a previous stage to send to, the send goes out before the
        weight gradients are computed."""
        if not self.defer_weight_grads or pipe.is_first:
            pipe.send_backward(self.backward(0, mb, received, output, output_grad))
            return
        with WeightGradQueue() as queue:
            input_grad = self.backward(0, mb, received, output, output_grad)
        pipe.send_backward(input_grad)
        start = self.trace.mark() if self.trace is not None else None
        with named_range("weight gradients"):
            queue.run()
        if self.trace is not None:
            self.trace.add("W", mb, 0, start, self.trace.mark())


def _forward_and_send(steps: _Steps, pipe, mb: int, more: bool) -> tuple:
    """A forward of the non-interleaved schedules that waits for no gradient: receive, run, send, release.
    `more`: another activation is received next, so its receive is posted before this forward."""
    received = pipe.recv_forward()
    if more:
        pipe.prefetch_forward()
    out = steps.forward(0, mb, received)
    pipe.send_forward(out)
    steps.release(0, out)
    return received, out


def gpipe(steps: _Steps, pipe) -> None:
    m = len(steps.micro_batches)
    saved = [_forward_and_send(steps, pipe, mb, mb < m - 1) for mb in range(m)]
    for mb in range(m):
        received, out = saved[mb]
        grad = pipe.recv_backward()
        steps.backward_and_send(pipe, mb, received, out, grad)


def one_f_one_b(steps: _Steps, pipe) -> None:
    m = len(steps.micro_batches)
    # Warm-up: the first gradient reaches this stage only after micro-batch 0 has gone through the
    # p − rank − 1 stages after it and back, so run that many forwards before any backward.
    warmup = min(pipe.pp_size - pipe.pp_rank - 1, m)
    remaining = m - warmup
    held: deque = deque()
    fwd = bwd = 0
    for _ in range(warmup):
        held.append(_forward_and_send(steps, pipe, fwd, fwd < m - 1))
        fwd += 1
    # Steady state: one forward, then the backward of the oldest micro-batch held; at most p − rank live.
    received = pipe.recv_forward() if remaining else None
    for i in range(remaining):
        out = steps.forward(0, fwd, received)
        fwd += 1
        grad = pipe.send_forward_recv_backward(out)
        steps.release(0, out)
        held.append((received, out))
        if i < remaining - 1:  # the next forward's input arrives during this backward
            pipe.prefetch_forward()
        old_in, old_out = held.popleft()
        if i == remaining - 1:
            steps.backward_and_send(pipe, bwd, old_in, old_out, grad)
        else:
            received = pipe.send_backward_recv_forward(steps.backward(0, bwd, old_in, old_out, grad))
        bwd += 1
    # Cool-down: the backwards of the warm-up's micro-batches, as their gradients arrive.
    for _ in range(warmup):
        old_in, old_out = held.popleft()
        grad = pipe.recv_backward()
        steps.backward_and_send(pipe, bwd, old_in, old_out, grad)
        bwd += 1


def interleaved(steps: _Steps, pipe) -> None:
    p, rank, v = pipe.pp_size, pipe.pp_rank, len(steps.chunks)
    m = len(steps.micro_batches)
    total = m * v
    # Forward slot k runs chunk (k mod p·v) // p on micro-batch (k // p·v)·p + k mod p: micro-batches go
    # through each chunk in groups of p. Warm-up: the first backward (micro-batch 0 on this rank's last
    # chunk) can start only after micro-batch 0 has run through every chunk, which takes this rank
    # (v − 1)·p forwards of its earlier chunks (p micro-batches each), plus 2·(p − rank − 1) slots for its
    # last chunk's output to reach the last stage and the gradient to come back. With m == p that is every
    # forward, so the schedule runs all forwards, then all backwards (as Megatron-LM does).
    all_warmup = m == p
    warmup = total if all_warmup else min((p - rank - 1) * 2 + (v - 1) * p, total)
    remaining = total - warmup
    inputs = [deque() for _ in range(v)]
    outputs = [deque() for _ in range(v)]
    grads = [deque() for _ in range(v)]

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def micro_batch_of(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def forward_step(k: int):
        c = chunk_of(k, True)
        received = None if steps.chunks[c].pre_process else inputs[c][-1]
        out = steps.forward(c, micro_batch_of(k), received)
        outputs[c].append(out)
        return None if steps.chunks[c].post_process else out

    def backward_step(k: int):
        c = chunk_of(k, False)
        received = None if steps.chunks[c].pre_process else inputs[c].popleft()
        grad = None if steps.chunks[c].post_process else grads[c].popleft()
        return steps.backward(c, micro_batch_of(k), received, outputs[c].popleft(), grad)

    if not pipe.is_first:
        inputs[0].append(pipe.communicate(recv_prev=True)[0])
    for k in range(warmup):
        nxt = chunk_of(k + 1, True)
        recv_prev = not (pipe.is_first and nxt == 0) and k != total - 1
        if recv_prev:  # the input after this one arrives during this forward
            pipe.prefetch_forward(ring=True)
        out = forward_step(k)
        if k == warmup - 1 and not all_warmup:
            received, grad = pipe.communicate(send_next=out, recv_prev=recv_prev, recv_next=not pipe.is_last)
            if grad is not None:
                grads[v - 1].append(grad)
        else:
            received, _ = pipe.communicate(send_next=out, recv_prev=recv_prev)
        steps.release(chunk_of(k, True), out)
        if recv_prev:
            inputs[nxt].append(received)
    # Steady state: forward slot k + warmup, then backward slot k, with one exchange per pair.
    for k in range(remaining):
        fk = k + warmup
        out = forward_step(fk)
        recv_prev = True
        if pipe.is_first:  # the first stage runs p − 1 slots ahead of the last, which feeds it
            nxt = chunk_of(fk - (p - 1), True)
            recv_prev = nxt != v - 1
            nxt += 1
        else:
            nxt = chunk_of(fk + 1, True)
        if k == remaining - 1:
            recv_prev = False
        if recv_prev:  # the next forward's input arrives during this backward
            pipe.prefetch_forward(ring=True)
        input_grad = backward_step(k)
        recv_next = True
        if pipe.is_last:  # and the last stage p − 1 backward slots ahead of the first
            nxt_b = chunk_of(k - (p - 1), False)
            recv_next = nxt_b != 0
            nxt_b -= 1
        else:
            nxt_b = chunk_of(k + 1, False)
        received, grad = pipe.communicate(send_next=out, send_prev=input_grad, recv_prev=recv_prev,
                                          recv_next=recv_next)
        steps.release(chunk_of(fk, True), out)
        if recv_prev:
            inputs[nxt].append(received)
        if recv_next:
            grads[nxt_b].append(grad)
    if all_warmup and not pipe.is_last:
        grads[v - 1].append(pipe.communicate(recv_next=True)[1])
    # Cool-down: the backward slots left over from the warm-up.
    for k in range(remaining, total):
        input_grad = backward_step(k)
        nxt_b = chunk_of(k + 1, False)
        recv_next = not (pipe.is_last and nxt_b == v - 1) and k != total - 1
        _, grad = pipe.communicate(send_prev=input_grad, recv_next=recv_next)
        if recv_next:
            grads[nxt_b].append(grad)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
             **{name: functools.partial(run_zero_bubble, name) for name in ZERO_BUBBLE}}


def forward_backward_pipeline(schedule: str, chunks, micro_batches: list, pipe, loss_scale: float = 1.0,
                              trace: ScheduleTrace | None = None, defer_weight_grads: bool = False
                              ) -> torch.Tensor:
    """Run one step's schedule; returns each micro-batch's mean token loss ([m], float32, detached),
    broadcast from the last stage. `micro_batches`: MicroBatch objects or plain token tensors [b, s + 1],
    the same on every stage. `defer_weight_grads`: GPipe and 1F1B send a waiting backward's input gradient
    before computing its weight gradients (parallel.defer_weight_grads)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if len(chunks) != (1 if schedule in ("gpipe", "1f1b") else chunks_per_rank(schedule)) and \
            schedule != "interleaved":
        raise ValueError(f"{len(chunks)} model chunks per rank do not fit the {schedule!r} schedule")
    micro_batches = [MicroBatch.of(mb) for mb in micro_batches]
    steps = _Steps(chunks, micro_batches, loss_scale, trace, defer_weight_grads)
    SCHEDULES[schedule](steps, pipe)
    pipe.finish()
    device = micro_batches[0].tokens.device
    losses = torch.stack(steps.losses) if steps.losses else torch.zeros(len(micro_batches), device=device)
    comm.broadcast(losses, src=loss_rank(schedule, pipe), group=pipe.group)
    return losses


@torch.no_grad()
def forward_only_pipeline(chunks, micro_batches: list, pipe) -> torch.Tensor:
    """Evaluation: the mean micro-batch loss without gradients, broadcast from the last stage.

    Each micro-batch runs through this rank's chunks in model order, receiving from the previous stage and
    sending to the next. Every rank's operations follow one global chain (micro-batch, chunk, stage), so the
    blocking exchanges cannot deadlock, and without an interleaved ring the stages overlap across
    micro-batches as in GPipe's forward half. Under the V placement (parallel.schedule=zbv) the chain goes
    down the ranks and back up (`forward_only_v`)."""
    micro_batches = [MicroBatch.of(mb) for mb in micro_batches]
    schedule = "zbv" if getattr(chunks[0], "v_placement", False) else "1f1b"  # set by build_model_chunks
    losses = forward_only_v(chunks, micro_batches, pipe) if schedule == "zbv" else []
    for mb in micro_batches if schedule != "zbv" else ():
        for chunk in chunks:
            received = None if chunk.pre_process else pipe.communicate(recv_prev=True)[0]
            args, kwargs = mb.forward_args(chunk.pre_process, chunk.post_process, received)
            out = chunk(*args, **kwargs)
            if chunk.post_process:
                losses.append(out.float())
            else:
                pipe.communicate(send_next=out)
    pipe.finish()
    device = micro_batches[0].tokens.device
    loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
    comm.broadcast(loss, src=loss_rank(schedule, pipe), group=pipe.group)
    return loss
