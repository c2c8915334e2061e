"""NCCL's semantics over gloo, so that the CPU test suite sees what a multi-GPU run would.

gloo forgives what NCCL does not. Under gloo, `batch_isend_irecv` returns one handle per operation and an
async operation's output is usually written by the time anyone reads it; under NCCL the batch is coalesced
into one handle (torch's `batch_isend_irecv` returns its coalescing manager's single work), and an output is
written on the communicator's stream at an unknown time after the call, reading it before `wait` reads
whatever was there. NCCL also reads an async operation's input while the caller goes on, so writing into it
or freeing it before the wait corrupts what the peers receive.

With TRILITH_COMM_SEMANTICS=nccl (the multi-process tests set it), parallel/comm.py runs every operation
through this module, which makes each of those rules fail loudly on the CPU:
- a batch of sends and receives returns one handle, and its tags are zeroed: NCCL ignores them
  (`ProcessGroupNCCL::send(..., int /* unused */)`) and matches a pair's sends and receives by order alone, so
  gloo must too;
- the async operations on one communicator complete in the order they were posted (NCCL's one stream per
  communicator): waiting for a later one completes the earlier ones first, and a synchronous operation on it
  waits for them;
- an async operation runs on private copies of its tensors: its outputs hold poison (NaN, or the integer
  type's largest value) until its handle is waited for, and the wait raises if an input was written or
  resized, or a poisoned output written, while it was in flight;
- dtypes NCCL has no type for and reductions it has no kernel for are refused;
- object collectives and barriers need a device bound first (`bind_device`; NCCL otherwise picks a GPU by
  guessing and can hang);
- `assert_drained` raises if an async operation of the step was never waited for.
What it cannot show (streams, a real GPU's timing, NCCL's own transport) is listed in docs/validation.md.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

ENABLED = os.environ.get("TRILITH_COMM_SEMANTICS", "").lower() == "nccl"

# The dtypes ProcessGroupNCCL maps to an ncclDataType_t (bool travels as uint8).
NCCL_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
               torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2}
NCCL_REFUSED_OPS = {dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR}

_bound_device: torch.device | None = None
_pending: dict[int, "Deferred"] = {}
_streams: dict = {}  # communicator key -> its async operations posted so far, in order (some perhaps done)


def bind_device(device: torch.device) -> None:
    """Record the device this rank's collectives run on (what torch.cuda.set_device does for NCCL)."""
    global _bound_device
    _bound_device = torch.device(device)


def require_bound_device(op: str) -> None:
    if ENABLED and _bound_device is None:
        raise RuntimeError(f"{op} before this rank's device was bound: under NCCL the object collectives and "
                           "barriers pick a GPU by guessing and can hang; bind it first "
                           "(parallel.distributed.pick_device)")


def check(op: str, tensors, reduce_op=None) -> None:
    """Refuse what NCCL refuses: a dtype it has no type for, a bitwise reduction."""
    if not ENABLED:
        return
    for tensor in tensors:
        if tensor.dtype not in NCCL_DTYPES:
            raise TypeError(f"{op} of a {tensor.dtype} tensor: NCCL has no such type; convert it (for example to "
                            "int32 or float32) before the collective")
    if reduce_op is not None and reduce_op in NCCL_REFUSED_OPS:
        raise ValueError(f"{op} with {reduce_op}: NCCL has no bitwise reductions; use SUM, MIN or MAX")


def poison(tensor: torch.Tensor) -> None:
    if tensor.dtype.is_floating_point:
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).max)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


class Deferred:
    """One async operation (or coalesced batch) under NCCL's rules: `wait` first completes the operations posted
    before it on the same communicator (`stream`: NCCL runs them in order on one stream, so a later batch never
    finishes before an earlier one), checks the inputs were left alone, then writes the outputs. Waiting twice is
    harmless, as with a CUDA work handle."""

    def __init__(self, name: str, works: list, inputs: list, outputs: list, stream=None):
        self.name, self.works, self.done = name, works, False
        self.inputs = inputs  # (live tensor, its bytes when posted, its snapshot the operation really reads)
        self.outputs = outputs  # (live tensor now poisoned, the private tensor the operation really writes)
        _pending[id(self)] = self
        self.stream, self.earlier = stream, []
        if stream is not None:
            queue = _streams.setdefault(stream, [])
            self.earlier = list(queue)
            queue.append(self)

    def transfer(self) -> None:
        """The transfer itself, after every earlier one on the communicator; the outputs stay poisoned until
        `wait` (NCCL has written them by then, but only a wait makes reading them right)."""
        for earlier in self.earlier:
            earlier.transfer()
        self.earlier = []
        for work in self.works:
            work.wait()
        self.works = []
        queue = _streams.get(self.stream, [])
        if self in queue:  # done: later operations need not wait for it, nor hold on to its copies
            queue.remove(self)

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        self.transfer()
        self.done = True
        _pending.pop(id(self), None)
        for live, nbytes, snapshot in self.inputs:
            if live.untyped_storage().nbytes() < nbytes or not _same_bits(live, snapshot):
                raise RuntimeError(f"{self.name}: an input was written or freed while the operation was in flight; "
                                   "NCCL reads it on its stream after the call returns: wait for the handle first")
        for live, private in self.outputs:
            shadow = torch.empty_like(live)
            poison(shadow)
            if not _same_bits(live, shadow):
                raise RuntimeError(f"{self.name}: its output was written while the operation was in flight; NCCL "
                                   "would overwrite it at an unknown time: wait for the handle first")
            live.copy_(private)
        return True

    def is_completed(self) -> bool:
        return self.done


def drain_stream(stream) -> None:
    """Complete the transfers still in flight on a communicator before a synchronous operation on it (which NCCL
    orders after them on the same stream)."""
    for pending in _streams.pop(stream, []):
        pending.transfer()


def deferred(name: str, call, inputs: list, outputs: list, in_place: list | None = None, stream=None) -> Deferred:
    """Start `call(private_inputs, private_outputs)` (which returns a list of works) on copies of `inputs` and
    fresh buffers for `outputs`, poison `outputs` and return the handle. `in_place` tensors are both read and
    written (an in-place all-reduce): the operation gets a copy, the live tensor is poisoned. `stream`: a key of
    the communicator (its operations complete in posting order)."""
    in_place = in_place or []
    snapshots = [t.detach().clone() for t in inputs]
    private_out = [torch.empty_like(t) for t in outputs] + [t.detach().clone() for t in in_place]
    works = call(snapshots, private_out)
    live_out = list(outputs) + list(in_place)
    for t in live_out:
        poison(t)
    return Deferred(name, works, [(t, t.untyped_storage().nbytes(), s) for t, s in zip(inputs, snapshots)],
                    list(zip(live_out, private_out)), stream)


def assert_drained(where: str) -> None:
    """Every async operation issued so far has been waited for (a step's end: NCCL would still be writing)."""
    if not ENABLED or not _pending:
        return
    names = sorted({d.name for d in _pending.values()})
    _pending.clear()
    raise RuntimeError(f"{where}: async operation(s) {', '.join(names)} never waited for; under NCCL their "
                       "outputs would be written at an unknown later time")
