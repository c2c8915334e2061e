"""Point-to-point transport between neighbouring pipeline stages.

Activations travel to the next stage, their gradients back to the previous one. Every exchange is one
`torch.distributed.batch_isend_irecv` of the sends and receives a schedule tick needs, so a stage's send and
its neighbour's matching receive are always in the same batch on both sides (the condition NCCL needs to
never deadlock). Shapes are fixed by the configuration — [micro_batch, seq_length (/tp under sequence
parallelism), hidden] in the compute dtype — so receive buffers are allocated without any per-step shape
exchange; a send of any other shape is refused. Evaluation, whose micro-batches are only as long as their
longest request, sets each one's shape with `reshape` on every stage (the shape follows from the same
requests there, so it needs no exchange either).

An exchange waits for its receives only: its sends stay in flight while the stage computes (as
torch.distributed.pipelining does), holding the sent tensors, and are waited for at the next exchange or at
`finish`, which a schedule calls before the step's loss broadcast. That holds where the backend returns one
handle per operation (gloo); NCCL coalesces a batch into one handle, so a batch that receives is waited for
whole (a stream wait on the GPU, not a host stall). A sent activation's own storage may be
released meanwhile (`_Steps.release` swaps the tensor's data): the send holds a detached alias of the old
storage, whose values nothing modifies.

On gloo, whose background threads deliver each operation as soon as both sides have posted it,
`prefetch_forward` posts the next activation's receive alone, before the compute that precedes it (a forward
in GPipe and in the warm-ups, a backward in the steady states of 1F1B and interleaved 1F1B), so that its
transfer overlaps that compute; the next exchange then only sends and waits for that receive. A receive posted early only lets its
message in sooner and holds nothing up. On NCCL it does nothing: an operation posted alone runs in order on
the communicator's stream, where a lone receive could hold back a later send, and the batch rule above stays
the one guarantee.

Every send and receive is recorded in `comm.RECORD` (ops "send" and "recv", group "pp") when posted.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import comm
from parallel import nccl_semantics

# With two stages in an interleaved ring the next and the previous stage are the same rank. NCCL ignores tags and
# matches a pair's sends and receives by order alone: each batch lists forward-direction ops (activations) before
# backward-direction ops (gradients) on both sides, and that order is what keeps them apart. The tags only label
# the directions for gloo; the NCCL-semantics mode zeroes them, so the CPU tests match by order as NCCL does.
FORWARD_TAG, BACKWARD_TAG = 0, 1
# The waits happen after comm.issue's range (the posting) has closed: a profile shows them under this name.
WAIT_RANGE = "comm:wait[pp]"


class PipelineComm:
    """One rank's links to its pipeline neighbours (wrapping around, for the interleaved ring)."""

    def __init__(self, topo, shape: tuple[int, ...], dtype: torch.dtype, device):
        self.group = topo.pp_group
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.is_first, self.is_last = topo.is_first_stage, topo.is_last_stage
        self.pp_rank, self.pp_size = topo.pp_rank, topo.pp_size
        self.next_rank, self.prev_rank = topo.pp_neighbour(1), topo.pp_neighbour(-1)
        self.last_rank = topo.group_ranks["pp"][-1]
        self.early_receives = dist.get_backend(self.group) == dist.Backend.GLOO and not nccl_semantics.ENABLED
        self._sending: list = []  # (work, tensor) of sends not yet waited for
        self._prefetched = None  # (work, buffer) of the next activation's receive, posted early
        # Later batches involve only neighbour pairs; NCCL wants the group's first operation to include all.
        comm.all_reduce(torch.zeros(1, device=device), self.group)

    @classmethod
    def for_model(cls, topo, model_cfg, micro_batch_size: int, sequence_parallel: bool, dtype, device):
        seq = model_cfg.seq_length // topo.cp_size // (topo.tp_size if sequence_parallel and topo.tp_size > 1 else 1)
        return cls(topo, (micro_batch_size, seq, model_cfg.hidden_size), dtype, device)

    def reshape(self, shape: tuple[int, ...]) -> None:
        """Exchange activations of `shape` from now on; between schedules only, with nothing in flight."""
        if self._sending or self._prefetched is not None:
            raise RuntimeError("a pipeline reshape while exchanges are in flight: reshape between schedules")
        self.shape = tuple(shape)

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(f"pipeline send of {tuple(tensor.shape)} {tensor.dtype}, but stages exchange "
                               f"{self.shape} {self.dtype} (micro_batch, sequence, hidden) fixed by the config")
        return tensor.detach().contiguous()

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def finish_sends(self) -> None:
        with comm.named_range(WAIT_RANGE):
            for work, _ in self._sending:
                work.wait()
        self._sending = []

    def finish(self) -> None:
        """End of a schedule: wait for the sends still in flight; a prefetched receive left unused means the
        schedule and its exchanges disagree."""
        self.finish_sends()
        if self._prefetched is not None:
            self._prefetched = None
            raise RuntimeError("a prefetched pipeline receive was never used: the schedule and its exchanges "
                               "disagree")

    def prefetch_forward(self, ring: bool = False) -> None:
        """Post the receive of the next activation now, if this backend runs it independently (see above).
        `ring`: the interleaved schedule, where the first stage too receives (its later chunks' inputs)."""
        if self.early_receives and (ring or not self.is_first) and self._prefetched is None:
            buffer = self._buffer()
            self._prefetched = (comm.batch_isend_irecv([("recv", buffer, self.prev_rank, FORWARD_TAG)],
                                                       self.group)[0], buffer)

    def communicate(self, send_next=None, send_prev=None, recv_prev: bool = False, recv_next: bool = False):
        """One batched exchange; returns (activation from previous stage, gradient from next stage) once both
        have arrived. The previous exchange's sends are waited for first: at most one batch's are in flight."""
        self.finish_sends()
        ops, from_prev, from_next = [], None, None
        prefetched = None
        if recv_prev:
            prefetched, self._prefetched = self._prefetched, None
        if send_next is not None:
            ops.append(("send", self._checked(send_next), self.next_rank, FORWARD_TAG))
        if recv_prev and prefetched is None:
            from_prev = self._buffer()
            ops.append(("recv", from_prev, self.prev_rank, FORWARD_TAG))
        if send_prev is not None:
            ops.append(("send", self._checked(send_prev), self.prev_rank, BACKWARD_TAG))
        if recv_next:
            from_next = self._buffer()
            ops.append(("recv", from_next, self.next_rank, BACKWARD_TAG))
        works = comm.batch_isend_irecv(ops, self.group)
        with comm.named_range(WAIT_RANGE):
            if len(works) == len(ops):  # one handle per operation: sends stay in flight, receives are waited for
                for op, work in zip(ops, works):
                    if op[0] == "send":
                        self._sending.append((work, op[1]))
                    else:
                        work.wait()
            elif from_prev is not None or from_next is not None:  # one handle for the batch (NCCL): it holds the
                for work in works:                                 # receives, so it is waited for now
                    work.wait()
            else:
                self._sending.extend((work, None) for work in works)
            if prefetched is not None:
                prefetched[0].wait()
                from_prev = prefetched[1]
        if from_prev is not None:
            from_prev.requires_grad_(True)
        return from_prev, from_next

    # -- the non-interleaved exchanges: no-ops at the ends of the pipeline ---------------------------
    def recv_forward(self):
        return None if self.is_first else self.communicate(recv_prev=True)[0]

    def send_forward(self, output) -> None:
        if not self.is_last:
            self.communicate(send_next=output)

    def recv_backward(self):
        return None if self.is_last else self.communicate(recv_next=True)[1]

    def send_backward(self, input_grad) -> None:
        if not self.is_first:
            self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output):
        return None if self.is_last else self.communicate(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad):
        return None if self.is_first else self.communicate(send_prev=input_grad, recv_prev=True)[0]
