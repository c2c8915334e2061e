"""Every collective Trilith issues, recorded, and the autograd pairs of Megatron's f/g operators.

The low-level functions (`all_reduce`, `all_gather`, `reduce_scatter`, ...) are thin wrappers over
torch.distributed that append (op, group, bytes, dtype) to `RECORD` while recording is on, with what a
schedule check needs (engine/dry_run/schedule_check.py): the group's global ranks, the element count and shape,
the peer of a send or receive and the batch it was posted in; an event's place in the list is its order. A
group of None means "size 1": the call is a no-op and is not recorded (barrier and all_gather_object, whose
None is the world, excepted). Under torch.profiler each collective is a range
named `comm:<op>[<group>]`; on the steps that engine/observe/stragglers.py times, `TIMER` adds up its seconds. The autograd Functions below use them, so
the record shows exactly what crosses the wire in forward and in backward.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from parallel import nccl_semantics as nccl

_GROUP_NAMES: dict = {}
_GROUP_RANKS: dict = {}  # group -> its global ranks, looked up once


def register_group(group, name: str) -> None:
    if group is not None:
        _GROUP_NAMES[group] = name


def group_ranks(group) -> tuple:
    """The global ranks of `group` (None: the world)."""
    group = dist.group.WORLD if group is None else group
    if group not in _GROUP_RANKS:
        _GROUP_RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return _GROUP_RANKS[group]


def registered_groups() -> set:
    """The process groups this rank has built (and named) so far."""
    return set(_GROUP_NAMES)


def destroy_groups_since(before: set) -> None:
    """Destroy the groups built after `before` (registered_groups()), once no collective on them is pending: a
    process that builds Trainer after Trainer (a benchmark) otherwise keeps every group's transport to the end
    (under gloo ~12 threads and ~40 sockets per layout of 8 ranks)."""
    for group in registered_groups() - before:
        del _GROUP_NAMES[group]
        _GROUP_RANKS.pop(group, None)
        dist.destroy_process_group(group)


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class CommEvent:
    op: str
    group: str
    bytes: int
    dtype: str
    ranks: tuple = ()  # the group's global ranks
    count: int = 0  # elements
    shape: tuple = ()
    peer: int = -1  # a send's or receive's peer (global rank)
    batch: int = -1  # send and receive events posted together share it


class CommRecord:
    def __init__(self):
        self.events: list[CommEvent] = []
        self.enabled = False
        self.batches = 0

    @contextlib.contextmanager
    def capture(self):
        self.events, self.enabled = [], True
        try:
            yield self.events
        finally:
            self.enabled = False

    def add(self, op: str, group, tensor: torch.Tensor, peer: int = -1, batch: int = -1) -> None:
        if self.enabled:
            self.events.append(CommEvent(op, _GROUP_NAMES.get(group, "?"), tensor.numel() * tensor.element_size(),
                                         str(tensor.dtype).replace("torch.", ""), group_ranks(group), tensor.numel(),
                                         tuple(tensor.shape), peer, batch))

    def new_batch(self) -> int:
        self.batches += 1
        return self.batches

    def summary(self) -> dict:
        out: dict = {}
        for e in self.events:
            key = f"{e.op}[{e.group},{e.dtype}]"
            count, nbytes = out.get(key, (0, 0))
            out[key] = (count + 1, nbytes + e.bytes)
        return out


RECORD = CommRecord()


def named_range(name: str):
    """A range called `name` in a torch.profiler trace (engine/observe/profiling.py); nothing when no profiler runs."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class CommTimer:
    """Seconds this rank spent in collectives while `active` (the steps engine/observe/stragglers.py times). Then each
    collective is waited for where it is issued and, on CUDA (`cuda`), the device synchronised before and after
    it: the time is this rank's wait for its peers plus the transfer, not the kernels queued before it."""

    def __init__(self):
        self.active, self.cuda, self.seconds = False, False, 0.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


TIMER = CommTimer()


def issue(op: str, group, call, async_op: bool = False):
    """`call()`: one torch.distributed operation on `group`, in a profiler range named after it and, on timed
    steps, waited for and timed. Returns what `call` returns (a work handle when `async_op`)."""
    if not TIMER.active and not torch.autograd._profiler_enabled():
        return call()
    with named_range(f"comm:{op}[{_GROUP_NAMES.get(group, '?')}]"):
        if not TIMER.active:
            return call()
        TIMER.sync()
        start = time.perf_counter()
        work = call()
        if async_op and work is not None:
            work.wait()
        TIMER.sync()
        TIMER.seconds += time.perf_counter() - start
        return work


def _name(op: str, group) -> str:
    return f"{op}[{_GROUP_NAMES.get(group, '?')}]"


def _issue_flat(op: str, group, launch, inputs: list, outputs: list, async_op: bool, in_place=()):
    """`launch(inputs, outputs, async_op)`: one flat collective. Asynchronous under NCCL semantics it runs on
    private buffers and its outputs (and `in_place` tensors, read and written) hold poison until waited for."""
    if async_op and nccl.ENABLED:
        return issue(op, group, lambda: nccl.deferred(
            _name(op, group), lambda inp, out: [launch(inp, out, True)], inputs, outputs, list(in_place),
            _stream(group)), True)
    if nccl.ENABLED:
        nccl.drain_stream(_stream(group))
    return issue(op, group, lambda: launch(inputs, [*outputs, *in_place], async_op), async_op)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    if group is None:
        return None
    RECORD.add("all_reduce", group, tensor)
    nccl.check("all_reduce", [tensor], op)
    return _issue_flat("all_reduce", group, lambda _, out, a: dist.all_reduce(out[0], op=op, group=group, async_op=a),
                       [], [], async_op, in_place=[tensor])


def all_reduce_flat(tensors: list, group, dtype: torch.dtype | None = None) -> None:
    """Sum `tensors` over `group` in place with one all-reduce of their concatenation, taken in `dtype`
    (by default theirs), instead of one small collective each."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) if dtype is None else t.reshape(-1).to(dtype) for t in tensors])
    all_reduce(flat, group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


# torch 2.13 renamed the flat collectives (the old names warn on every rank); torch >= 2.4 is supported
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim`, returned contiguous: the layers that read it (q/k/v,
    gate/up under sequence parallelism) then share one saved input instead of each flattening its own copy."""
    world = group_size(group)
    if world == 1:
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0],) + moved.shape[1:], dtype=tensor.dtype, device=tensor.device)
    RECORD.add("all_gather", group, out)
    nccl.check("all_gather", [moved])
    issue("all_gather", group, lambda: _all_gather_flat(out, moved, group=group))
    return out.movedim(0, dim).contiguous()


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """Flat all-gather into a preallocated buffer (FSDP parameter gathering)."""
    if group is None:
        output.copy_(shard)
        return None
    RECORD.add("all_gather", group, output)
    nccl.check("all_gather", [shard])
    return _issue_flat("all_gather", group,
                       lambda inp, out, a: _all_gather_flat(out[0], inp[0], group=group, async_op=a),
                       [shard], [output], async_op)


def reduce_scatter(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over ranks, keep this rank's chunk of `dim`."""
    world = group_size(group)
    if world == 1:
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    if moved.shape[0] % world:
        raise ValueError(f"reduce_scatter: dimension {dim} of size {moved.shape[0]} not divisible by {world}")
    out = torch.empty((moved.shape[0] // world,) + moved.shape[1:], dtype=tensor.dtype, device=tensor.device)
    RECORD.add("reduce_scatter", group, moved)
    nccl.check("reduce_scatter", [moved])
    issue("reduce_scatter", group, lambda: _reduce_scatter_flat(out, moved, group=group))
    return out.movedim(0, dim)


def reduce_scatter_into(output: torch.Tensor, flat: torch.Tensor, group, async_op: bool = False):
    """Flat reduce-scatter into a preallocated shard (ZeRO gradient reduction)."""
    if group is None:
        output.copy_(flat)
        return None
    RECORD.add("reduce_scatter", group, flat)
    nccl.check("reduce_scatter", [flat])
    return _issue_flat("reduce_scatter", group,
                       lambda inp, out, a: _reduce_scatter_flat(out[0], inp[0], group=group, async_op=a),
                       [flat], [output], async_op)


def all_to_all_into(output: torch.Tensor, chunks: torch.Tensor, group) -> None:
    """Chunk j of `chunks` (split evenly along dim 0) goes to rank j; chunk i of `output` comes from rank i."""
    if group is None:
        output.copy_(chunks)
        return
    RECORD.add("all_to_all", group, chunks)
    nccl.check("all_to_all", [chunks])
    issue("all_to_all", group, lambda: dist.all_to_all_single(output, chunks, group=group))


def broadcast(tensor: torch.Tensor, src: int, group) -> None:
    if group is None:
        return
    RECORD.add("broadcast", group, tensor)
    nccl.check("broadcast", [tensor])
    issue("broadcast", group, lambda: dist.broadcast(tensor, src=src, group=group))


def batch_isend_irecv(ops: list[tuple[str, torch.Tensor, int, int]], group) -> list:
    """Post ("send" | "recv", tensor, peer global rank, tag) operations as one batch. Returns what torch returns:
    one work handle per operation where the backend runs them separately (gloo), ONE for the whole batch where
    it coalesces them (NCCL) — callers must accept either."""
    if not ops:
        return []
    batch = RECORD.new_batch()
    for kind, tensor, peer, _ in ops:
        RECORD.add(kind, group, tensor, peer, batch)
    nccl.check("send/recv", [tensor for _, tensor, _, _ in ops])

    def post(tensors):
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group,
                                                  tag) for (kind, _, peer, tag), tensor in zip(ops, tensors)])

    if not nccl.ENABLED:
        return issue("send/recv", group, lambda: _Works(post([t for _, t, _, _ in ops])), async_op=True).works
    ops = [(kind, tensor, peer, 0) for kind, tensor, peer, _ in ops]  # NCCL ignores tags: only the order matches
    sends = [t for kind, t, _, _ in ops if kind == "send"]
    recvs = [t for kind, t, _, _ in ops if kind == "recv"]

    def post_private(sent, received):
        sent, received = iter(sent), iter(received)
        return post([next(sent) if kind == "send" else next(received) for kind, _, _, _ in ops])

    return [issue("send/recv", group, lambda: nccl.deferred(_name("send/recv", group), post_private, sends, recvs,
                                                            stream=_stream(group)), async_op=True)]


def _stream(group):
    """The key of `group`'s communicator (one NCCL stream each) for the NCCL-semantics mode."""
    return id(group) if group is not None else None


class _Once:
    """A work handle waited for at most once: a second wait on a gloo send or receive would wait for another
    transfer on its buffer and never return (issue waits on timed steps, the caller again later)."""

    def __init__(self, work):
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class _Works:
    """Several work handles that issue can wait for as one (on timed or profiled steps)."""

    def __init__(self, works):
        self.works = [_Once(work) for work in works]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


_NOTHING = torch.empty(0)


def barrier(group) -> None:
    nccl.require_bound_device("barrier")
    RECORD.add("barrier", group or dist.group.WORLD, _NOTHING)
    dist.barrier(group=group)


def all_gather_object(out: list, obj, group) -> None:
    nccl.require_bound_device("all_gather_object")
    RECORD.add("all_gather_object", group or dist.group.WORLD, _NOTHING)  # its size is the object's pickle
    dist.all_gather_object(out, obj, group=group)


def host_send_recv(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int, group) -> None:
    """Blocking point-to-point of CPU tensors on a host (gloo) group, for transfers beside training (memory
    snapshots, parallel/snapshot_exchange.py), possibly from a background thread: the send and the receive are
    posted together, so that a ring of pairs cannot deadlock, and waited for here, outside the NCCL-semantics
    bookkeeping of the training's groups. `dst`/`src` are global ranks; None skips that direction."""
    works = []
    if send is not None:
        RECORD.add("send", group, send, dst)
        works.append(dist.isend(send, dst, group=group))
    if recv is not None:
        RECORD.add("recv", group, recv, src)
        works.append(dist.irecv(recv, src, group=group))
    for work in works:
        work.wait()


def split_along(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return tensor
    if tensor.shape[dim] % world:
        raise ValueError(f"cannot split dimension {dim} of size {tensor.shape[dim]} over {world} ranks")
    return tensor.chunk(world, dim=dim)[group_rank(group)].contiguous()


# -- autograd pairs (Megatron's f and g, and their sequence-parallel forms) ------------------------

class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward (entering a tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward (leaving a tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """Sequence parallel f: all-gather the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Sequence parallel g: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, ctx.dim), None, None


class _ScatterToSequence(torch.autograd.Function):
    """Keep this rank's sequence chunk forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromLastDim(torch.autograd.Function):
    """All-gather the last (vocab/feature) dimension forward, keep own chunk backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, x.dim() - 1)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.group, grad.dim() - 1), None


def copy_to_tensor_region(x, group):
    return x if group is None else _CopyToRegion.apply(x, group)


def reduce_from_tensor_region(x, group):
    return x if group is None else _ReduceFromRegion.apply(x, group)


def gather_from_sequence_region(x, group, dim: int = 1):
    return x if group is None else _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence_region(x, group, dim: int = 1):
    return x if group is None else _ReduceScatterToSequence.apply(x, group, dim)


def scatter_to_sequence_region(x, group, dim: int = 1):
    return x if group is None else _ScatterToSequence.apply(x, group, dim)


def gather_from_last_dim(x, group):
    return x if group is None else _GatherFromLastDim.apply(x, group)


# -- context parallelism (parallel/context.py) -----------------------------------------------------

def start_ring_shift(x: torch.Tensor, group, send_to: int, receive_from: int) -> tuple[torch.Tensor, list]:
    """Post the send of the contiguous `x` to global rank `send_to` and the receive of a tensor of its shape from
    `receive_from` as one batch, and return at once: (the receive buffer, the work handles). Until
    `finish_ring_shift`, the buffer holds nothing (NaN under NCCL semantics) and `x` must not be written."""
    received = torch.empty_like(x)
    works = batch_isend_irecv([("send", x, send_to, 0), ("recv", received, receive_from, 0)], group)
    return received, works


def finish_ring_shift(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
    """Wait for a `start_ring_shift` and return what it received."""
    received, works = pending
    for work in works:
        work.wait()
    return received


class _AllToAll(torch.autograd.Function):
    """Split `scatter_dim` into one chunk per rank, send chunk j to rank j, and concatenate the chunks received
    along `gather_dim` (in rank order); backward is the same exchange with the two dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = group_size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(f"all-to-all: dimension {scatter_dim} of size {x.shape[scatter_dim]} not divisible by {world}")
    chunks = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    received = torch.empty_like(chunks)
    all_to_all_into(received, chunks, group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _SumOverContext(torch.autograd.Function):
    """A context-parallel rank's share of the loss summed over the CP group forward; backward passes the
    gradient on multiplied by the CP size, because the gradient reduction averages over DP × CP ranks while the
    CP ranks' gradients are parts of one replica's sum."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.size = group_size(group)
        x = x.clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None


def all_to_all_region(x, group, scatter_dim: int, gather_dim: int):
    return x if group is None else _AllToAll.apply(x, group, scatter_dim, gather_dim)


def sum_over_context(x, group):
    return x if group is None else _SumOverContext.apply(x, group)
