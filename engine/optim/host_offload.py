"""The host half of an optimizer under `optim.offload_fraction`: a wrapper around its AdamW update, not branches
inside it. The optimizer (engine/optim/replicated.py per parameter, engine/optim/zero.py per unit shard) decides
where each master lives (engine/optim/offload.offloaded), builds the masters, and hands the offloaded pieces here;
this object then owns what crosses PCIe (engine/optim/offload.py: the gradients' HostGrad, the masters' WriteBack,
their PinnedArena) and the speculative host steps (engine/optim/offload_overlap.SpeculativeHostSteps with their
spare masters and moments). The optimizer's step makes the same calls with or without offload (with no piece on
the host each does nothing):

- `begin(lr)` before backward;
- `send()` before the device unscales gradients in place: the gradients not sent during backward cross now
  (on a CPU device they cross in `land` instead, read in place: see `send`);
- `settle(overflow, clip, backward_end)` once the norm decides the step: the speculative steps commit or are
  dropped; returns the pieces already stepped (AdamW passes them by);
- `land(coef)` the other pieces' fp32 gradients on the host, unscaled and clipped by the device's operations;
- `stepped(seconds)` the host step's time, for the readings.

From the optimizer it needs `scaler`, `adam_step`, `device_grad(i)` (piece i's reduced gradient on the device
and its fp32 tail or None, parallel/fsdp_units.Unit.grad32), `speculate(i, grad, lr, adam_step, spare)` (AdamW
into the spare master and moments) and `commit(i, spare)` (the spares become the state).
"""
from __future__ import annotations

import torch

from engine.optim import offload
from engine.optim.offload_overlap import SpeculativeHostSteps


class HostOffload:
    def __init__(self, opt, cfg, masters: list, pieces: dict, device: torch.device):
        """`pieces`: piece index → (elements, gradient dtype, parameter dtype, fp32 tail slice) of each offloaded
        master `masters[i]`: its gradient crosses in the gradient dtype, its new value returns in the parameter's,
        both through pinned views into one exact arena. A master whose parameter is fp32 is replaced in `masters`
        by its write-back's arena view, holding the same values (offload.WriteBack.holds_master)."""
        self.opt, self.cfg, self.device = opt, cfg, device
        self.in_place = device.type != "cuda"  # the host reads the device's gradients where they are (see send)
        ids = list(pieces)
        self.arena = offload.PinnedArena([offload.HostGrad.request(n, grad, tail) for n, grad, _, tail in
                                          pieces.values()] + [(n, param) for n, _, param, _ in pieces.values()],
                                         offload.host_of(device))
        self.host_grads = {i: offload.HostGrad(masters[i], grad, self.arena.views[k], tail)
                           for k, (i, (_, grad, _, tail)) in enumerate(pieces.items())}
        stream = offload.side_stream(device) if ids else None
        self.write_backs = {}
        for k, (i, (_, _, param, _)) in enumerate(pieces.items()):
            staging, holds = self.arena.views[len(ids) + k], param == torch.float32
            if holds:  # the fp32 master moves into its write-back's buffer: no host copy on the way back
                m = masters[i]
                masters[i] = staging.view(m.shape).copy_(m.detach()).requires_grad_(m.requires_grad)
            self.write_backs[i] = offload.WriteBack(staging, stream, holds)
        self.speculation, self.spares, self.redos, self.first_use = None, {}, 0, False
        self.late, self.deferred, self.done, self.landed = [], set(), set(), set()

    def __contains__(self, i: int) -> bool:
        """Whether piece i's master lives on the host."""
        return i in self.host_grads

    def overlap(self, eligible: list[int], source, hook) -> None:
        """Under optim.offload_overlap, step the `eligible` pieces speculatively as their reductions end: `hook`
        becomes `source.on_reduced` (parallel/ddp.BucketedDDP or parallel/fsdp.ShardedDataParallel) and calls
        `reduced(i)`."""
        if self.cfg.offload_overlap == "false" or not eligible:
            return
        self.speculation = SpeculativeHostSteps(self, eligible, self.device.type == "cuda",
                                                offload.host_threads(self.cfg), self.cfg.offload_overlap == "auto")
        self.spares = {i: [offload.host_empty(self.host_grads[i].fp32) for _ in range(3)] for i in eligible}
        source.on_reduced = hook

    def reduced(self, i: int) -> None:
        self.speculation.reduced(i)

    # -- the state interface SpeculativeHostSteps steps through ---------------------------------------------
    @property
    def scaler(self):
        return self.opt.scaler

    @property
    def adam_step(self) -> int:
        return self.opt.adam_step

    def send_grad(self, i: int, coef: float | None = None) -> list:
        """Issue the copies of piece i's gradient to its host buffers (a crossing deferred to `land`: taken in
        one pass, an fp32 one clipped by `coef` on the way); returns the device tensors read."""
        grad, tail = self.opt.device_grad(i)
        if i in self.deferred:
            self.host_grads[i].take(grad, tail, coef)
        else:
            self.host_grads[i].send(grad, tail)
        return [t for t in (grad, tail) if t is not None]

    def speculate(self, i: int, grad: torch.Tensor, lr: float, adam_step: int) -> None:
        self.opt.speculate(i, grad, lr, adam_step, self.spares[i])

    def commit(self, i: int) -> None:
        self.opt.commit(i, self.spares[i])

    # -- the step ------------------------------------------------------------------------------------------
    def begin(self, lr: float) -> None:
        """Before the step's backward: offloaded pieces start their host step once their gradient is final."""
        if self.speculation is not None:
            self.speculation.begin(lr)

    def send(self) -> None:
        """After backward, before unscaling changes an fp32 gradient in place: the copies to the host issued
        during backward are done, the other offloaded gradients cross now."""
        sent = set()
        if self.speculation is not None:
            self.speculation.fence()
            sent = self.speculation.sent()
        # on a CPU device the crossing is a copy by the same cores, which overlaps nothing: it waits for land and
        # reads the device's gradient there, in one pass (a 16-bit one, which the device only reads, upcast with no
        # staging copy; an fp32 one, which nothing changes in place before land without a loss scale, clipped)
        self.deferred = {i for i, g in self.host_grads.items() if i not in sent and self.in_place
                         and (g.staging is not None or not self.opt.scaler.enabled)}
        self.late = [t for i in self.host_grads if i not in sent | self.deferred for t in self.send_grad(i)]

    def settle(self, overflow: bool, clip: bool, backward_end: float) -> set:
        """Commit the speculative steps when the step neither overflows nor clips, else drop them (a clipped
        step counts a redo); returns the pieces committed."""
        self.writable()
        self.done, self.landed = set(), set()
        if self.speculation is not None:
            self.redos += int(clip and bool(self.speculation.jobs))
            self.done, self.landed = self.speculation.settle(not overflow and not clip, backward_end, clip, overflow)
        return self.done

    def writable(self) -> None:
        """Before the host writes the masters (a commit, AdamW, a checkpoint's load): the copies to the device that
        read those held in the arena are complete."""
        for write_back in self.write_backs.values():
            write_back.settled()

    def holds_master(self, i: int) -> bool:
        """Whether piece i's master is its write-back's arena buffer (a commit copies into it, not swaps)."""
        return self.write_backs[i].holds_master

    def land(self, coef: float | None) -> dict:
        """Piece → its fp32 gradient on the host, for the pieces not committed: upcast, unscaled and clipped by
        `coef` (None: not clipped) with the device's elementwise operations (those landed by a speculative job
        are upcast and unscaled already; a deferred fp32 one is copied and clipped in one pass)."""
        offload.wait_for_device(self.late)
        for i in self.deferred - self.done:
            self.send_grad(i, coef)
        grads = {i: g.fp32 if i in self.landed | self.deferred else g.land() for i, g in self.host_grads.items()
                 if i not in self.done}
        fresh = [g for i, g in grads.items() if i not in self.landed]
        if self.opt.scaler.enabled and fresh:
            torch._foreach_div_(fresh, self.opt.scaler.scale)
        clipped = {i for i in self.deferred if self.host_grads[i].staging is None}  # on the way, by take
        if coef is not None and len(grads) > len(clipped):
            torch._foreach_mul_([g for i, g in grads.items() if i not in clipped], coef)
        return grads

    def stepped(self, seconds: float) -> None:
        """The host's AdamW after backward (on a GPU the whole update: it is host-bound)."""
        if self.speculation is not None:
            self.speculation.readings["offload_host_s"] += seconds

    def readings(self) -> dict:
        """For metrics.jsonl: the step's host AdamW seconds, the part before backward ended, redos so far."""
        if self.speculation is None:
            return {}
        return {**self.speculation.readings, "offload_redos": self.redos}

    # -- the write-backs of a replicated optimizer (parallel/fsdp.ShardedDataParallel.write_shards has ZeRO's) --
    def wait_at_first_use(self, chunks, params: list) -> None:
        """Each offloaded parameter's write-back is waited for by the forward pre-hook of the transformer layer
        holding it, the rest (tables, final norm: the chunk's own forward reads the output weight) by the chunk's;
        without chunks (a bare optimizer), right after the copies are issued."""
        self.first_use = chunks is not None
        if not self.write_backs or chunks is None:
            return
        index = {id(params[i]): i for i in self.write_backs}
        for chunk in chunks:
            layers = list(chunk.model.layers.values()) if hasattr(chunk, "model") else []
            under = {id(p) for layer in layers for p in layer.parameters()}
            rest = [index[id(p)] for p in chunk.parameters() if id(p) in index and id(p) not in under]
            for module, ids in [(layer, [index[id(p)] for p in layer.parameters() if id(p) in index])
                                for layer in layers] + [(chunk, rest)]:
                if ids:
                    module.register_forward_pre_hook(lambda m, args, ids=ids: self._wait_writes(ids))

    def _wait_writes(self, ids) -> None:
        for i in ids:
            self.write_backs[i].wait()

    def wait_writes(self) -> None:
        self._wait_writes(self.write_backs)

    def write_back(self, params: list, masters: list, names: list) -> None:
        """The offloaded masters into their parameters (the tables and the final norm first: the next forward
        waits for them at its start)."""
        for i in sorted(self.write_backs, key=lambda i: "layers." in names[i]):
            self.write_backs[i].send(params[i], masters[i])
        if not self.first_use:
            self.wait_writes()

    def tensors(self) -> list:
        """Its host memory: the gradients' upcast buffers, the spare masters and moments, the arena."""
        grads = [t for g in self.host_grads.values() for t in g.tensors()]
        return grads + [t for s in self.spares.values() for t in s] + self.arena.tensors()
