"""AdamW (and under optim.name=muon, Muon for the blocks' matrices: engine/optim/muon_owners.py) on replicated
fp32 master weights, a dynamic loss scaler for fp16, and gradient clipping whose norm is global over the tensor-
and pipeline-parallel ranks (each parameter counted exactly once)."""
from __future__ import annotations

import math
import time

import torch

from torch.optim.adamw import adamw as adamw_kernel

from engine.optim import offload
from engine.config.schema import OptimConfig
from engine.optim.muon_owners import MuonPart, Piece
from engine.optim.offload_overlap import SpeculativeHostSteps
from engine.optim.param_groups import counts_in_norm, no_weight_decay, uses_muon
from kernels.adamw import adamw
from parallel import comm
from parallel.meta_values import item


class LossScaler:
    """Dynamic loss scaling (fp16): halve on overflow and skip the step, double after `window` good steps."""

    def __init__(self, enabled: bool, initial: float = 2.0**16, window: int = 1000):
        self.enabled, self.scale, self.window, self.good_steps = enabled, initial if enabled else 1.0, window, 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale, self.good_steps = max(self.scale / 2, 1.0), 0
        else:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]


def overlaps(name: str, param: torch.nn.Parameter, gradients, tp_size: int) -> bool:
    """Whether an offloaded parameter's host step can start as soon as its DDP bucket is reduced: its `.grad`
    is then final (an in-place bucket of a flat reduction over more than one rank; not summed over TP or a tied
    group afterwards; the embedding and output tables never, whose row exchange or tie is summed later)."""
    bucket = getattr(gradients, "bucket_of", {}).get(param)
    return (bucket is not None and bucket.in_place and gradients.dp_size > 1 and gradients.hierarchy is None
            and "embed_tokens" not in name and "lm_head" not in name
            and not (tp_size > 1 and getattr(param, "tp_replicated_grad", False)))


class MixedPrecisionAdamW:
    """Holds fp32 master copies of low-precision model parameters (or uses fp32 parameters directly).
    `gradients`, when given, owns the parameters' `.grad` storage (parallel/ddp.BucketedDDP: views into
    persistent buckets) and zeroes it in `zero_grad`. The masters (and so the moments) of the parameters
    chosen by `optim.offload_fraction` live on the host (engine/optim/offload.py), whatever their dtype."""

    def __init__(self, named_params: list, cfg: OptimConfig, topo, precision: str, gradients=None):
        self.cfg, self.topo, self.gradients = cfg, topo, gradients
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        # backward produces the gradients roughly in reverse order of definition: offload in that order
        on_host = offload.offloaded([p.numel() for p in reversed(self.params)], cfg.offload_fraction)[::-1]
        self.master = [offload.host_copy(p).requires_grad_(True) if host else
                       p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                       for p, host in zip(self.params, on_host)]
        # where an offloaded master's gradient arrives, in the parameter's dtype, upcast on the host, and the pinned
        # buffer its new value returns through (engine/optim/offload.WriteBack): views into one exact arena
        ids = [i for i, host in enumerate(on_host) if host]
        self.arena = offload.PinnedArena([offload.HostGrad.request(self.params[i].numel(), self.params[i].dtype)
                                          for i in ids] + [(self.params[i].numel(), self.params[i].dtype) for i in ids])
        self.host_grads = {i: offload.HostGrad(self.master[i], self.params[i].dtype, self.arena.views[k])
                           for k, i in enumerate(ids)}
        stream = offload.side_stream(self.params[0].device) if ids else None
        self.write_backs = {i: offload.WriteBack(self.arena.views[len(ids) + k], stream) for k, i in enumerate(ids)}
        self._wait_at_first_use(getattr(gradients, "chunks", None))
        self.muon_ids = [i for i, (n, p) in enumerate(named_params) if uses_muon(n, p, cfg.name)]
        self.muon = muon_part([(named_params[i], self.master[i]) for i in self.muon_ids], cfg, topo) \
            if cfg.name == "muon" else None
        adam = [(n, p, m) for i, ((n, p), m) in enumerate(zip(named_params, self.master)) if i not in self.muon_ids]
        decay = [m for n, p, m in adam if not no_weight_decay(n, p)]
        other = [m for n, p, m in adam if no_weight_decay(n, p)]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
        self.inner = adamw([g for g in groups if g["params"]], cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps,
                           cfg.implementation)
        self.scaler = LossScaler(precision == "fp16")
        self._adam_step = 0
        # Checkpoint interface: every DP rank holds the same state, so only DP rank 0 writes it.
        self.writes_state = topo.reduce_rank == 0  # DP and CP ranks hold replicas
        self.redos, self.speculation, self.spares = 0, None, {}
        eligible = [i for i in self.host_grads if gradients is not None and
                    overlaps(self.names[i], self.params[i], gradients, topo.tp_size)]
        if cfg.offload_overlap != "false" and eligible:
            self.speculation = SpeculativeHostSteps(self, eligible, self.params[0].is_cuda, offload.host_threads(cfg),
                                                    cfg.offload_overlap == "auto")
            self.spares = {i: [offload.host_empty(self.master[i]) for _ in range(3)] for i in eligible}
            self.spare_steps: dict = {}
            self.group_of = {id(m): g for g in self.inner.param_groups for m in g["params"]}
            index = {id(self.params[i]): i for i in eligible}
            gradients.on_reduced = lambda params: [self.speculation.reduced(index[id(p)])
                                                   for p in params if id(p) in index]

    def begin_step(self, lr: float) -> None:
        """Before the step's backward: offloaded parameters start their host step once their bucket is reduced."""
        if self.speculation is not None:
            self.speculation.begin(lr)

    def speculate(self, i: int, grad: torch.Tensor, lr: float, adam_step: int) -> None:
        """Parameter i's AdamW into its spare master and moments (engine/optim/offload_overlap.py, worker thread):
        torch's AdamW kernel with the flags and hyper-parameters of its group, as inner.step() would run it."""
        m, spare = self.master[i], self.spares[i]
        state, group = self.inner.state.get(m), self.group_of[id(m)]
        spare[0].copy_(m)
        if state:
            spare[1].copy_(state["exp_avg"])
            spare[2].copy_(state["exp_avg_sq"])
            step = state["step"].clone()
        else:  # the first step: Adam's state starts at zero
            spare[1].zero_()
            spare[2].zero_()
            step = torch.zeros((), dtype=torch.float32, device=m.device)
        beta1, beta2 = group["betas"]
        adamw_kernel([spare[0]], [grad], [spare[1]], [spare[2]], [], [step], foreach=group["foreach"],
                     fused=group["fused"], capturable=group["capturable"], amsgrad=False, beta1=beta1, beta2=beta2,
                     lr=lr, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        self.spare_steps[i] = step

    def commit(self, i: int) -> None:
        """Parameter i's spares become its state (its old moments, the next step's spares)."""
        m, spare = self.master[i], self.spares[i]
        m.copy_(spare[0])
        state = self.inner.state[m]
        old = state.get("exp_avg"), state.get("exp_avg_sq")
        state["step"], state["exp_avg"], state["exp_avg_sq"] = self.spare_steps.pop(i), spare[1], spare[2]
        spare[1], spare[2] = (t if t is not None else offload.host_empty(m) for t in old)

    def offload_readings(self) -> dict:
        """For metrics.jsonl: the step's host AdamW seconds, the part before backward ended, redos so far."""
        if self.speculation is None:
            return {}
        return {**self.speculation.readings, "offload_redos": self.redos}

    def zero_grad(self) -> None:
        if self.gradients is not None:
            self.gradients.zero_grad()
        else:
            for p in self.params:
                p.grad = None
        for p, m in zip(self.params, self.master):
            if m is not p:  # an fp32 parameter is its own master: its `.grad` is handled above
                m.grad = None

    def _device_grads(self) -> list:
        """Every master's fp32 gradient on the parameter's device (an offloaded master's too: the norm and
        clipping run there, as without offload); a master on the device gets it as its `.grad`."""
        grads = []
        for i, (p, m) in enumerate(zip(self.params, self.master)):
            if p.grad is None and p is m:
                p.grad = torch.zeros_like(p)
            g = p.grad.float() if p.grad is not None else torch.zeros(p.shape, device=p.device)
            if p is not m and i not in self.host_grads:
                m.grad = g
            grads.append(g)
        return grads

    def send_grad(self, i: int) -> list:
        """Issue the copy of parameter i's gradient (its own dtype) to its host buffer; returns the tensor read."""
        p = self.params[i]
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        self.host_grads[i].send(grad)
        return [grad]

    def _grads_on_host(self, late: list, done: set, landed: set, coef: float | None) -> None:
        """The offloaded masters' gradients, as the device has them (upcast, unscaled, clipped by `coef`), as
        their `.grad`, but for those `done` (stepped during backward and committed: no gradient, so inner.step()
        passes them by); those `landed` are upcast and unscaled already."""
        offload.wait_for_device(late)
        fresh = [self.host_grads[i].land() for i in self.host_grads if i not in done and i not in landed]
        if self.scaler.enabled and fresh:
            torch._foreach_div_(fresh, self.scaler.scale)
        on_host = [self.host_grads[i].fp32 for i in self.host_grads if i not in done]
        if coef is not None and on_host:
            torch._foreach_mul_(on_host, coef)
        for i, buffer in self.host_grads.items():
            self.master[i].grad = None if i in done else buffer.fp32

    def global_grad_norm(self, grads: list) -> float:
        counted = [g for p, g in zip(self.params, grads) if counts_in_norm(p, self.topo.tp_rank)]
        # One multi-tensor kernel for the per-tensor norms; their squares are summed in fp64.
        norms = torch._foreach_norm(counted) if counted else []
        total = torch.stack(norms).double().pow(2).sum().reshape(1) if norms else \
            torch.zeros(1, dtype=torch.float64, device=self.params[0].device)
        comm.all_reduce(total, self.topo.mp_group)
        return math.sqrt(item(total))  # a dry run (no values): 0, nothing clipped

    @torch.no_grad()
    def step(self, lr: float) -> tuple[float, bool]:
        """Unscale, clip, update; returns (gradient norm before clipping, whether the step was skipped)."""
        backward_end = time.perf_counter()
        sent = set()
        if self.speculation is not None:
            self.speculation.fence()
            sent = self.speculation.sent()
        # the other offloaded gradients cross now, before unscaling changes an fp32 gradient in place
        late = [t for i in self.host_grads if i not in sent for t in self.send_grad(i)]
        grads = self._device_grads()
        if self.scaler.enabled:
            torch._foreach_div_(grads, self.scaler.scale)
        norm = self.global_grad_norm(grads)
        overflow = not math.isfinite(norm)
        self.scaler.update(overflow)
        clip = not overflow and self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad
        done = landed = set()
        if self.speculation is not None:
            self.redos += int(clip and bool(self.speculation.jobs))
            done, landed = self.speculation.settle(not overflow and not clip, backward_end, clip, overflow)
        if overflow:
            return norm, True
        coef = self.cfg.clip_grad / (norm + 1e-6) if clip else None
        on_device = [g for i, g in enumerate(grads) if i not in self.host_grads]
        if clip and on_device:  # the offloaded ones are clipped on the host, by the same coefficient
            torch._foreach_mul_(on_device, coef)
        start = time.perf_counter()
        self._grads_on_host(late, done, landed, coef)
        if self.muon is not None:
            self.muon.step([grads[i].view(-1) for i in self.muon_ids], lr)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        if self.speculation is not None:  # host steps after backward (on a GPU, the whole call: it is host-bound)
            self.speculation.readings["offload_host_s"] += time.perf_counter() - start
        self._adam_step += 1
        self._write_params()
        return norm, False

    def _wait_at_first_use(self, chunks) -> None:
        """Each offloaded parameter's write-back is waited for by the forward pre-hook of the transformer layer
        holding it, the rest (tables, final norm: the chunk's own forward reads the output weight) by the chunk's;
        without chunks (a bare optimizer), right after the copies are issued."""
        self.first_use = chunks is not None
        if not self.write_backs or chunks is None:
            return
        index = {id(self.params[i]): i for i in self.write_backs}
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
        """Before something other than a forward reads the parameters (a replica check)."""
        self._wait_writes(self.write_backs)

    def _write_params(self) -> None:
        """The new masters into the parameters: the offloaded ones through their write-backs (the tables and the
        final norm first: the next forward waits for them at its start), the others on the device."""
        ordered = sorted(self.write_backs, key=lambda i: "layers." in self.names[i])
        for i in ordered:
            self.write_backs[i].send(self.params[i], self.master[i])
        if not self.first_use:
            self.wait_writes()
        for i, (p, m) in enumerate(zip(self.params, self.master)):
            if p is not m and i not in self.write_backs:
                p.copy_(m)

    def host_tensors(self) -> list:
        """The state kept in host memory (optim.offload_fraction): masters, moments, gradient buffers, and the
        spare masters and moments that overlapped steps write into."""
        masters = [self.master[i] for i in self.host_grads]
        moments = [t for m in masters for key, t in self.inner.state.get(m, {}).items() if key != "step"]
        grads = [t for g in self.host_grads.values() for t in g.tensors()]
        return masters + moments + grads + [t for s in self.spares.values() for t in s] + self.arena.tensors()

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "scaler": self.scaler.state_dict(),
                "master": [m.detach() for m in self.master],
                "momentum": self.muon.momentum if self.muon is not None else []}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.scaler.load_state_dict(state["scaler"])
        with torch.no_grad():
            for buf, saved in zip(self.muon.momentum if self.muon is not None else [], state["momentum"]):
                buf.copy_(saved)
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
            self._write_params()

    # Checkpoint interface (docs/checkpoints.md): optimizer state per parameter name as flat fp32 ranges.

    @property
    def adam_step(self) -> int:
        return self._adam_step

    @adam_step.setter
    def adam_step(self, value: int) -> None:
        self._adam_step = int(value)
        for state in self.inner.state.values():
            if "step" in state:
                state["step"].fill_(float(value))

    def owned_state(self) -> dict[str, dict]:
        out = {}
        for i, buf in zip(self.muon_ids, self.muon.momentum if self.muon is not None else []):
            m = self.master[i]
            out[self.names[i]] = {"shape": tuple(m.shape), "range": (0, m.numel()), "master": m.detach().reshape(-1),
                                  "momentum": buf}
        for i, (name, m) in enumerate(zip(self.names, self.master)):
            if i in self.muon_ids:
                continue
            state = self.inner.state.get(m, {})
            flat = m.detach().reshape(-1)
            zeros = None if state else torch.zeros_like(flat)
            out[name] = {"shape": tuple(m.shape), "range": (0, flat.numel()), "master": flat,
                         "exp_avg": state["exp_avg"].reshape(-1) if state else zeros,
                         "exp_avg_sq": state["exp_avg_sq"].reshape(-1) if state else zeros}
        return out

    @torch.no_grad()
    def load_owned_state(self, read) -> None:
        """Adam's state from flat fp32 ranges, handed to torch's own load_state_dict: it puts each tensor where
        the implementation keeps it (the fused kernel's `step` on the parameter's device, foreach's on the
        host), which a state built here by hand would have to guess."""
        index = {id(m): i for i, m in enumerate(m for group in self.inner.param_groups for m in group["params"])}
        state = self.inner.state_dict()
        state["state"] = {}
        for i, buf in zip(self.muon_ids, self.muon.momentum if self.muon is not None else []):
            n = self.master[i].numel()
            self.master[i].copy_(read(self.names[i], "master", 0, n).view_as(self.master[i]))
            buf.copy_(read(self.names[i], "momentum", 0, n))
        for i, (name, m) in enumerate(zip(self.names, self.master)):
            if i in self.muon_ids:
                continue
            n = m.numel()
            m.copy_(read(name, "master", 0, n).view_as(m))
            state["state"][index[id(m)]] = {"step": torch.tensor(float(self._adam_step), dtype=torch.float32),
                                            "exp_avg": read(name, "exp_avg", 0, n).view_as(m),
                                            "exp_avg_sq": read(name, "exp_avg_sq", 0, n).view_as(m)}
        self._write_params()
        self.inner.load_state_dict(state)
        self.check_state_devices()

    def check_state_devices(self) -> None:
        """Every moment sits with its parameter, and a fused kernel's step too (the first step on a GPU would
        otherwise fail, or copy the state over every step)."""
        fused = any(group.get("fused") or group.get("capturable") for group in self.inner.param_groups)
        for name, m in zip(self.names, self.master):
            for key, value in self.inner.state.get(m, {}).items():
                if torch.is_tensor(value) and (key != "step" or fused) and value.device != m.device:
                    raise RuntimeError(f"optimizer state {key} of {name} is on {value.device}, its parameter on "
                                       f"{m.device}: the state was built off the parameter's device")


def muon_part(named: list, cfg: OptimConfig, topo) -> MuonPart:
    """Muon over whole (TP-local) matrices: ((name, parameter), fp32 master) each; every rank of the stage
    builds one (the exchange's plan is collective)."""
    held = [Piece(n, tuple(getattr(p, "full_shape", p.shape)), getattr(p, "tp_dim", None),
                  topo.tp_rank if getattr(p, "tp_dim", None) is not None else 0, 0, p.numel()) for (n, p), _ in named]
    device = named[0][1].device if named else torch.device("cpu")
    return MuonPart(held, [m.view(-1) for _, m in named], cfg, topo.build_stage_group(), topo.tp_size, device)
