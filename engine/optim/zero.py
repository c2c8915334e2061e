"""AdamW on sharded fp32 master weights (ZeRO stages 1-3).

Each DP rank keeps, for every sharding unit of `parallel.fsdp_units`, only its shard of the fp32 master
weights and of Adam's two moments (12 bytes per owned element). The gradient norm used for clipping is
global: squares are summed over this rank's shard (TP-replicated parameters on TP rank 0 only, tied
pipeline duplicates never), then over the shard group and the model-parallel (TP × PP) group.

The update is torch's AdamW kernel over all shards at once (`optim.implementation`, chosen as in
kernels/adamw.py: fused by default, or foreach; apex, being GPU-only, maps to torch's fused kernel over the
shards). Weight decay only applies to some ranges of a shard, so it is applied first, as one multi-tensor
multiply over those ranges, and the kernel runs with weight_decay=0: torch's AdamW also scales the
parameter by (1 - lr·wd) before the Adam update, so the result is the same.

Under `optim.name=muon` the blocks' matrices are Muon's (engine/optim/muon_owners.MuonPart): each rank keeps a
momentum buffer for its shard ranges of them, their Newton–Schulz runs on the whole matrix at its owner rank,
and AdamW keeps moments for (and steps) only the stretches of each shard between them.

`optim.offload_fraction` puts the masters and moments of some units' shards on the host (engine/optim/offload.py):
their gradients cross to the host in their own dtype before the device unscales them (engine/optim/offload.HostGrad),
are measured and the step decided on the device as the others', then upcast, unscaled and clipped on the host
with the same operations; the same kernel steps them there, and write_shards copies the new masters back. What
crosses PCIe and the speculative host steps are `host`'s (engine/optim/host_offload.HostOffload).
"""
from __future__ import annotations

import math
import time

import torch
from torch.optim.adamw import adamw

from engine.optim import offload
from engine.optim.host_offload import HostOffload
from engine.optim.muon_owners import MuonPart, Piece
from engine.optim.param_groups import counts_in_norm, no_weight_decay, uses_muon
from engine.optim.replicated import LossScaler
from parallel import comm
from parallel.meta_values import item
from kernels.adamw import select_implementation
from parallel.fsdp import ShardedDataParallel


class ZeroAdamW:
    def __init__(self, sdp: ShardedDataParallel, cfg, topo, precision: str):
        self.sdp, self.cfg, self.topo = sdp, cfg, topo
        # Checkpoint interface: each shard is written once; under HSDP only the first replica group writes.
        self.writes_state = comm.group_rank(sdp.replicate_group) == 0
        # fp32 stage 3: the parameter shard is a tensor of its own, so it serves as the master (no copy per step)
        # backward reduces the units in reverse order: offload in that order
        on_host = offload.offloaded([u.shard_numel for u in reversed(sdp.units)], cfg.offload_fraction)[::-1]
        self.master = [offload.host_copy(u.param_shard) if host else
                       u.param_shard if sdp.stage == 3 and u.param_shard.dtype == torch.float32
                       else u.param_shard.detach().float().clone() for u, host in zip(sdp.units, on_host)]
        # each offloaded unit's gradient crosses in its own dtype (its fp32-reduced elements in fp32), its new
        # parameter shard returns in the shard's
        pieces = {i: (u.shard_numel, u.flat.dtype, u.param_shard.dtype, u.fp32_local)
                  for i, (u, host) in enumerate(zip(sdp.units, on_host)) if host}
        self.host = HostOffload(self, cfg, self.master, pieces, sdp.units[0].param_shard.device)
        self.adam_step = 0
        self.scaler = LossScaler(precision == "fp16")
        # Muon's ranges (optim.name=muon) hold a momentum buffer; Adam's moments cover the rest of each shard, the
        # runs (shard start, shard end, offset in the moments) between them: the whole shard without Muon
        self.muon_ranges = [(i, r) for i, u in enumerate(sdp.units) for r in u.shard_ranges
                            if uses_muon(r.name, r.param, cfg.name) and r.shard_end > r.shard_start]
        self.adam_runs = [adam_runs(m.numel(), [(r.shard_start, r.shard_end) for j, r in self.muon_ranges if j == i])
                          for i, m in enumerate(self.master)]
        self.exp_avg = [torch.zeros(sum(b - a for a, b, _ in runs), device=m.device)
                        for m, runs in zip(self.master, self.adam_runs)]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.exp_avg]
        self.muon = self._muon_part(cfg, topo) if cfg.name == "muon" else None
        muon_names = {r.name for _, r in self.muon_ranges}
        self.decay_ranges = [[(r.shard_start, r.shard_end) for r in u.shard_ranges
                              if not no_weight_decay(r.name, r.param) and r.name not in muon_names] for u in sdp.units]
        self.norm_ranges = [[r for r in u.shard_ranges if counts_in_norm(r.param, topo.tp_rank)] for u in sdp.units]
        self.implementation = select_implementation(cfg.implementation, sdp.units[0].param_shard.is_cuda,
                                                    sdp.units[0].param_shard.is_meta)
        # offloaded units whose gradients are final once reduced (TP-replicated ones are summed over TP later)
        eligible = [i for i in self.host.host_grads if topo.tp_size == 1 or not any(
            getattr(r.param, "tp_replicated_grad", False) for r in sdp.units[i].shard_ranges)]
        index = {id(sdp.units[i]): i for i in eligible}
        self.host.overlap(eligible, sdp, lambda unit: self.host.reduced(index[id(unit)]) if id(unit) in index else None)

    def _muon_part(self, cfg, topo) -> MuonPart:
        """Muon over this rank's pieces of the blocks' matrices (every rank of the stage builds one)."""
        held = [Piece(r.name, tuple(r.param.full_shape), r.param.tp_dim,
                      topo.tp_rank if r.param.tp_dim is not None else 0, r.param_start, r.param_end)
                for _, r in self.muon_ranges]
        masters = [self.master[i][r.shard_start:r.shard_end] for i, r in self.muon_ranges]
        return MuonPart(held, masters, cfg, topo.build_stage_group(), topo.tp_size, self.master[0].device)

    def begin_step(self, lr: float) -> None:
        """Before the step's backward: offloaded units start their host step as soon as their gradients are in."""
        self.host.begin(lr)

    def zero_grad(self) -> None:
        self.sdp.zero_grad()

    def global_grad_norm(self, grads: list) -> float:
        pieces = [g[r.shard_start:r.shard_end] for g, ranges in zip(grads, self.norm_ranges) for r in ranges]
        total = torch.zeros(1, dtype=torch.float64, device=grads[0].device)
        if pieces:  # one multi-tensor norm, accumulated in fp64
            total += torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).square().sum()
        comm.all_reduce(total, self.sdp.shard_group)  # HSDP replicas hold the same shards: not summed again
        comm.all_reduce(total, self.topo.mp_group)
        return math.sqrt(item(total))  # a dry run (no values): 0, nothing clipped

    @torch.no_grad()
    def step(self, lr: float) -> tuple[float, bool]:
        """Unscale, clip, update the owned shards, refresh the parameters; returns (norm, skipped)."""
        backward_end = time.perf_counter()
        self.host.send()
        grads = [u.master_grad() for u in self.sdp.units]
        if self.scaler.enabled:
            torch._foreach_div_(grads, self.scaler.scale)
        norm = self.global_grad_norm(grads)
        overflow = not math.isfinite(norm)
        self.scaler.update(overflow)
        clip = not overflow and self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad
        done = self.host.settle(overflow, clip, backward_end)
        if overflow:
            return norm, True
        start = time.perf_counter()
        coef = self.cfg.clip_grad / (norm + 1e-6) if clip else None
        on_device = [g for i, g in enumerate(grads) if i not in self.host]
        if clip and on_device:  # the offloaded ones are clipped on the host, by the same coefficient
            torch._foreach_mul_(on_device, coef)
        on_host = self.host.land(coef)
        if self.muon is not None:
            self.muon.step([grads[i][r.shard_start:r.shard_end] for i, r in self.muon_ranges], lr)
        rest = [i for i in range(len(grads)) if i not in done]
        self.update(rest, [on_host.get(i, grads[i]) for i in rest], lr, self.adam_step)
        self.host.stepped(time.perf_counter() - start)
        self.adam_step += 1
        self.sdp.write_shards(self.master, self.host.write_backs)
        return norm, False

    def device_grad(self, i: int) -> tuple:
        """Unit i's reduced gradient shard as it crosses to the host, and its fp32-reduced elements (or None)."""
        unit = self.sdp.units[i]
        if unit.grad_shard is None:
            return torch.zeros(unit.shard_numel, dtype=unit.flat.dtype, device=unit.param_shard.device), None
        return unit.grad_shard, unit.grad32

    def update(self, indices: list, grads: list, lr: float, adam_step: int, masters=None, exp_avgs=None,
               exp_avg_sqs=None) -> None:
        """AdamW on the units `indices` (their own state, or the given tensors in its place), Adam's step count
        `adam_step` before this update: decoupled weight decay on the decayed ranges, then the kernel."""
        c = self.cfg
        masters = masters or [self.master[i] for i in indices]
        exp_avgs = exp_avgs or [self.exp_avg[i] for i in indices]
        exp_avg_sqs = exp_avg_sqs or [self.exp_avg_sq[i] for i in indices]
        decay = [m[a:b] for i, m in zip(indices, masters) for a, b in self.decay_ranges[i]]
        for views in offload.by_device(decay):  # decoupled weight decay on the decayed ranges only
            torch._foreach_mul_(views, 1 - lr * c.weight_decay)
        runs = [(k, a, b, o) for k, i in enumerate(indices) for a, b, o in self.adam_runs[i] if b > a]
        masters, grads = [masters[k][a:b] for k, a, b, _ in runs], [grads[k][a:b] for k, a, b, _ in runs]
        exp_avgs = [exp_avgs[k][o:o + b - a] for k, a, b, o in runs]
        exp_avg_sqs = [exp_avg_sqs[k][o:o + b - a] for k, a, b, o in runs]
        if not masters:
            return
        # the kernel adds one; foreach reads the count on the host (as torch.optim keeps it), fused on the device
        steps = [torch.full((), float(adam_step), device=m.device if self.implementation == "fused" else "cpu")
                 for m in masters]
        adamw(masters, grads, exp_avgs, exp_avg_sqs, [], steps,
              foreach=self.implementation == "foreach", fused=self.implementation != "foreach", amsgrad=False,
              beta1=c.beta1, beta2=c.beta2, lr=lr, weight_decay=0.0, eps=c.eps, maximize=False)

    def speculate(self, i: int, grad: torch.Tensor, lr: float, adam_step: int, spare: list) -> None:
        """Unit i's AdamW into its spare master and moments (engine/optim/host_offload.py, on its worker thread)."""
        for dest, source in zip(spare, (self.master[i], self.exp_avg[i], self.exp_avg_sq[i])):
            dest.copy_(source)
        self.update([i], [grad], lr, adam_step, *([t] for t in spare))

    def commit(self, i: int, spare: list) -> None:
        """Unit i's spares become its state (the old state, the next step's spares); a master held in its
        write-back's buffer stays there and takes the spare's values."""
        keep = self.host.holds_master(i)
        if keep:
            self.master[i].copy_(spare[0])
        for k, tensors in enumerate((self.master, self.exp_avg, self.exp_avg_sq)):
            if k or not keep:
                tensors[i], spare[k] = spare[k], tensors[i]

    def offload_readings(self) -> dict:
        """For metrics.jsonl: the step's host AdamW seconds, the part before backward ended, redos so far."""
        return self.host.readings()

    # -- checkpoint interface (engine/interfaces.Optimizer) --------------------------------------------------
    def owned_state(self) -> dict:
        out = {}
        momentum = {(i, r.name): buf for (i, r), buf in zip(self.muon_ranges, self.muon.momentum if self.muon else [])}
        for i, (unit, master, m, v) in enumerate(zip(self.sdp.units, self.master, self.exp_avg, self.exp_avg_sq)):
            for r in unit.shard_ranges:
                state = {"shape": tuple(r.param.shape), "range": (r.param_start, r.param_end),
                         "master": master[r.shard_start:r.shard_end]}
                if (i, r.name) in momentum:  # Muon's: one momentum buffer, no Adam moments
                    out[r.name] = {**state, "momentum": momentum[(i, r.name)]}
                else:
                    moments = self.moments_of(i, r)
                    out[r.name] = {**state, "exp_avg": m[moments], "exp_avg_sq": v[moments]}
        return out

    def keeps_loaded(self) -> frozenset[str]:
        return frozenset()  # every range is copied into the flat buffers

    @torch.no_grad()
    def load_owned_state(self, read) -> None:
        self.host.writable()
        momentum = {(i, r.name): buf for (i, r), buf in zip(self.muon_ranges, self.muon.momentum if self.muon else [])}
        for i, (unit, master, m, v) in enumerate(zip(self.sdp.units, self.master, self.exp_avg, self.exp_avg_sq)):
            for r in unit.shard_ranges:
                master[r.shard_start:r.shard_end].copy_(read(r.name, "master", r.param_start, r.param_end))
                if (i, r.name) in momentum:
                    momentum[(i, r.name)].copy_(read(r.name, "momentum", r.param_start, r.param_end))
                    continue
                moments = self.moments_of(i, r)
                for key, dest in (("exp_avg", m), ("exp_avg_sq", v)):
                    dest[moments].copy_(read(r.name, key, r.param_start, r.param_end))
        self.sdp.write_shards(self.master, self.host.write_backs)

    def moments_of(self, i: int, r) -> slice:
        """Where the AdamW range `r` of unit i sits in the unit's moments (inside one run)."""
        a, _, o = next(run for run in self.adam_runs[i] if run[0] <= r.shard_start <= run[1])
        return slice(o + r.shard_start - a, o + r.shard_end - a)

    def wait_writes(self) -> None:
        """Before something other than a forward reads the parameter shards (a replica check)."""
        self.sdp.wait_writes()

    def held_tensors(self) -> list:
        """The state this rank keeps on its device."""
        return [t for i, state in enumerate(zip(self.master, self.exp_avg, self.exp_avg_sq))
                if i not in self.host for t in state] + (self.muon.momentum if self.muon is not None else [])

    def host_tensors(self) -> list:
        """The state kept in host memory (optim.offload_fraction): masters, moments, gradient buffers, and the
        spare masters and moments that overlapped steps write into."""
        return [t for i in self.host.host_grads for t in (self.master[i], self.exp_avg[i], self.exp_avg_sq[i])] + \
            self.host.tensors()


def adam_runs(numel: int, muon: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(start, end, offset in the moments) of the stretches of a shard of `numel` elements between the sorted,
    disjoint Muon ranges `muon`: AdamW steps and keeps moments for those only."""
    runs, at, offset = [], 0, 0
    for a, b in sorted(muon) + [(numel, numel)]:
        if a > at:
            runs.append((at, a, offset))
            offset += a - at
        at = b
    return runs or [(0, 0, 0)]
