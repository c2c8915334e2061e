"""Point-to-point transport between neighbouring pipeline stages.

Activations travel to the next stage, their gradients back to the previous one. Every exchange is one
`torch.distributed.batch_isend_irecv` of the sends and receives a schedule tick needs, waited on as a
whole, so a stage's send and its neighbour's matching receive are always in the same batch on both
sides (the condition NCCL needs to never deadlock). Shapes are fixed by the configuration —
[micro_batch, seq_length (/tp under sequence parallelism), hidden] in the compute dtype — so receive
buffers are allocated without any per-step shape exchange; a send of any other shape is refused.

Every send and receive is recorded in `comm.RECORD` (ops "send" and "recv", group "pp").
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import comm

# With two stages in an interleaved ring the next and the previous stage are the same rank: the tags keep
# activations (forward direction) and gradients (backward direction) from matching each other's receives,
# and each batch lists forward-direction ops before backward-direction ops so the order agrees on both sides.
FORWARD_TAG, BACKWARD_TAG = 0, 1


def batch_isend_irecv(ops: list[tuple[str, torch.Tensor, int, int]], group) -> None:
    """Run ("send" | "recv", tensor, peer global rank, tag) operations as one batch and wait for all."""
    if not ops:
        return
    batch = []
    for kind, tensor, peer, tag in ops:
        comm.RECORD.add(kind, group, tensor)
        batch.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group, tag))

    def exchange():
        for work in dist.batch_isend_irecv(batch):
            work.wait()
    comm.issue("send/recv", group, exchange)


class PipelineComm:
    """One rank's links to its pipeline neighbours (wrapping around, for the interleaved ring)."""

    def __init__(self, topo, shape: tuple[int, ...], dtype: torch.dtype, device):
        self.group = topo.pp_group
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.is_first, self.is_last = topo.is_first_stage, topo.is_last_stage
        self.pp_rank, self.pp_size = topo.pp_rank, topo.pp_size
        self.next_rank, self.prev_rank = topo.pp_neighbour(1), topo.pp_neighbour(-1)
        self.last_rank = topo.group_ranks["pp"][-1]
        # Later batches involve only neighbour pairs; NCCL wants the group's first operation to include all.
        comm.all_reduce(torch.zeros(1, device=device), self.group)

    @classmethod
    def for_model(cls, topo, model_cfg, micro_batch_size: int, sequence_parallel: bool, dtype, device):
        seq = model_cfg.seq_length // (topo.tp_size if sequence_parallel and topo.tp_size > 1 else 1)
        return cls(topo, (micro_batch_size, seq, model_cfg.hidden_size), dtype, device)

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(f"pipeline send of {tuple(tensor.shape)} {tensor.dtype}, but stages exchange "
                               f"{self.shape} {self.dtype} (micro_batch, sequence, hidden) fixed by the config")
        return tensor.detach().contiguous()

    def communicate(self, send_next=None, send_prev=None, recv_prev: bool = False, recv_next: bool = False):
        """One batched exchange; returns (activation from previous stage, gradient from next stage)."""
        ops, from_prev, from_next = [], None, None
        if send_next is not None:
            ops.append(("send", self._checked(send_next), self.next_rank, FORWARD_TAG))
        if recv_prev:
            from_prev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(("recv", from_prev, self.prev_rank, FORWARD_TAG))
        if send_prev is not None:
            ops.append(("send", self._checked(send_prev), self.prev_rank, BACKWARD_TAG))
        if recv_next:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(("recv", from_next, self.next_rank, BACKWARD_TAG))
        batch_isend_irecv(ops, self.group)
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
