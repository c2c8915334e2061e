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
from engine.optim.host_offload import HostOffload
from engine.optim.muon_owners import MuonPart, Piece
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
    chosen by `optim.offload_fraction` live on the host, whatever their dtype; `host` (engine/optim/host_offload.py)
    carries their gradients there, steps them speculatively during backward, and writes them back."""

    def __init__(self, named_params: list, cfg: OptimConfig, topo, precision: str, gradients=None):
        self.cfg, self.topo, self.gradients = cfg, topo, gradients
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        # backward produces the gradients roughly in reverse order of definition: offload in that order
        on_host = offload.offloaded([p.numel() for p in reversed(self.params)], cfg.offload_fraction)[::-1]
        self.master = [offload.host_copy(p).requires_grad_(True) if host else
                       p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                       for p, host in zip(self.params, on_host)]
        # an offloaded master's gradient crosses in the parameter's dtype, its new value returns in it
        pieces = {i: (p.numel(), p.dtype, p.dtype, slice(0, 0)) for i, (p, host) in enumerate(zip(self.params, on_host))
                  if host}
        self.host = HostOffload(self, cfg, self.master, pieces, self.params[0].device)
        self.host.wait_at_first_use(getattr(gradients, "chunks", None), self.params)
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
        self.spare_steps: dict = {}
        self.group_of = {id(m): g for g in self.inner.param_groups for m in g["params"]}
        eligible = [i for i in self.host.host_grads if gradients is not None and
                    overlaps(self.names[i], self.params[i], gradients, topo.tp_size)]
        index = {id(self.params[i]): i for i in eligible}
        self.host.overlap(eligible, gradients, lambda params: [self.host.reduced(index[id(p)])
                                                               for p in params if id(p) in index])

    def begin_step(self, lr: float) -> None:
        """Before the step's backward: offloaded parameters start their host step once their bucket is reduced."""
        self.host.begin(lr)

    def speculate(self, i: int, grad: torch.Tensor, lr: float, adam_step: int, spare: list) -> None:
        """Parameter i's AdamW into its spare master and moments (engine/optim/host_offload.py, worker thread):
        torch's AdamW kernel with the flags and hyper-parameters of its group, as inner.step() would run it."""
        m = self.master[i]
        state, group = self.inner.state.get(m), self.group_of[id(m)]
        spare[0].copy_(m)
        if state:
            spare[1].copy_(state["exp_avg"])
            spare[2].copy_(state["exp_avg_sq"])
            step = state["step"].clone()
        else:  # the first step: Adam's state starts at zero
            spare[1].zero_()
            spare[2].zero_()
            # where torch.optim keeps it: on the host unless fused or capturable (a meta master's would be unreadable)
            step = torch.zeros((), dtype=torch.float32,
                               device=m.device if group["fused"] or group["capturable"] else "cpu")
        beta1, beta2 = group["betas"]
        adamw_kernel([spare[0]], [grad], [spare[1]], [spare[2]], [], [step], foreach=group["foreach"],
                     fused=group["fused"], capturable=group["capturable"], amsgrad=False, beta1=beta1, beta2=beta2,
                     lr=lr, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        self.spare_steps[i] = step

    def commit(self, i: int, spare: list) -> None:
        """Parameter i's spares become its state (its old moments, the next step's spares)."""
        m = self.master[i]
        m.copy_(spare[0])
        state = self.inner.state[m]
        old = state.get("exp_avg"), state.get("exp_avg_sq")
        state["step"], state["exp_avg"], state["exp_avg_sq"] = self.spare_steps.pop(i), spare[1], spare[2]
        spare[1], spare[2] = (t if t is not None else offload.host_empty(m) for t in old)

    def offload_readings(self) -> dict:
        """For metrics.jsonl: the step's host AdamW seconds, the part before backward ended, redos so far."""
        return self.host.readings()

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
            if p is not m and i not in self.host:
                m.grad = g
            grads.append(g)
        return grads

    def device_grad(self, i: int) -> tuple:
        """Parameter i's gradient as it crosses to the host (its own dtype; no fp32 tail)."""
        p = self.params[i]
        return (p.grad if p.grad is not None else torch.zeros_like(p)), None

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
        self.host.send()
        grads = self._device_grads()
        if self.scaler.enabled:
            torch._foreach_div_(grads, self.scaler.scale)
        norm = self.global_grad_norm(grads)
        overflow = not math.isfinite(norm)
        self.scaler.update(overflow)
        clip = not overflow and self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad
        self.host.settle(overflow, clip, backward_end)
        if overflow:
            return norm, True
        coef = self.cfg.clip_grad / (norm + 1e-6) if clip else None
        on_device = [g for i, g in enumerate(grads) if i not in self.host]
        if clip and on_device:  # the offloaded ones are clipped on the host, by the same coefficient
            torch._foreach_mul_(on_device, coef)
        start = time.perf_counter()
        on_host = self.host.land(coef)
        for i in self.host.host_grads:  # one committed during backward has none: inner.step() passes it by
            self.master[i].grad = on_host.get(i)
        if self.muon is not None:
            self.muon.step([grads[i].view(-1) for i in self.muon_ids], lr)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        self.host.stepped(time.perf_counter() - start)
        self._adam_step += 1
        self._write_params()
        return norm, False

    def wait_writes(self) -> None:
        """Before something other than a forward reads the parameters (a replica check)."""
        self.host.wait_writes()

    def _write_params(self) -> None:
        """The new masters into the parameters: the offloaded ones through their write-backs (the tables and the
        final norm first: the next forward waits for them at its start), the others on the device."""
        self.host.write_back(self.params, self.master, self.names)
        for i, (p, m) in enumerate(zip(self.params, self.master)):
            if p is not m and i not in self.host:
                p.copy_(m)

    def host_tensors(self) -> list:
        """The state kept in host memory (optim.offload_fraction): masters, moments, gradient buffers, and the
        spare masters and moments that overlapped steps write into."""
        masters = [self.master[i] for i in self.host.host_grads]
        moments = [t for m in masters for key, t in self.inner.state.get(m, {}).items() if key != "step"]
        return masters + moments + self.host.tensors()

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "scaler": self.scaler.state_dict(),
                "master": [m.detach() for m in self.master],
                "momentum": self.muon.momentum if self.muon is not None else []}

    def load_state_dict(self, state: dict) -> None:
        self.host.writable()
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

    def keeps_loaded(self) -> frozenset[str]:
        return frozenset({"exp_avg", "exp_avg_sq"})  # handed to torch's load_state_dict, which keeps them

    @torch.no_grad()
    def load_owned_state(self, read) -> None:
        """Adam's state from flat fp32 ranges, handed to torch's own load_state_dict: it puts each tensor where
        the implementation keeps it (the fused kernel's `step` on the parameter's device, foreach's on the
        host), which a state built here by hand would have to guess."""
        self.host.writable()
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
