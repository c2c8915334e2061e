"""AdamW on sharded fp32 master weights (ZeRO stages 1-3).

Each DP rank keeps, for every sharding unit of `parallel.fsdp_units`, only its shard of the fp32 master
weights and of Adam's two moments (12 bytes per owned element). The gradient norm used for clipping is
global: squares are summed over this rank's shard (TP-replicated parameters on TP rank 0 only, tied
pipeline duplicates never), then over the shard group and the model-parallel (TP × PP) group.
"""
from __future__ import annotations

import math

import torch

from engine.optimizer import LossScaler, counts_in_norm, no_weight_decay
from parallel import comm
from parallel.fsdp import ShardedDataParallel


class ZeroAdamW:
    def __init__(self, sdp: ShardedDataParallel, cfg, topo, precision: str):
        self.sdp, self.cfg, self.topo = sdp, cfg, topo
        # Checkpoint interface: each shard is written once; under HSDP only the first replica group writes.
        self.writes_state = comm.group_rank(sdp.replicate_group) == 0
        self.master = [u.param_shard.detach().float().clone() for u in sdp.units]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        self.adam_step = 0
        self.scaler = LossScaler(precision == "fp16")
        self.decay_ranges = [[r for r in u.shard_ranges if not no_weight_decay(r.name, r.param)] for u in sdp.units]
        self.norm_ranges = [[r for r in u.shard_ranges if counts_in_norm(r.param, topo.tp_rank)] for u in sdp.units]

    def zero_grad(self) -> None:
        self.sdp.zero_grad()

    def global_grad_norm(self, grads: list) -> float:
        total = torch.zeros(1, dtype=torch.float64, device=self.master[0].device)
        for g, ranges in zip(grads, self.norm_ranges):
            for r in ranges:
                total += g[r.shard_start:r.shard_end].double().pow(2).sum()
        comm.all_reduce(total, self.sdp.shard_group)  # HSDP replicas hold the same shards: not summed again
        comm.all_reduce(total, self.topo.mp_group)
        return math.sqrt(total.item())

    @torch.no_grad()
    def step(self, lr: float) -> tuple[float, bool]:
        """Unscale, clip, update the owned shards, refresh the parameters; returns (norm, skipped)."""
        grads = [u.master_grad() for u in self.sdp.units]
        if self.scaler.enabled:
            for g in grads:
                g.div_(self.scaler.scale)
        norm = self.global_grad_norm(grads)
        overflow = not math.isfinite(norm)
        self.scaler.update(overflow)
        if overflow:
            return norm, True
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            for g in grads:
                g.mul_(self.cfg.clip_grad / (norm + 1e-6))
        self.adam_step += 1
        c = self.cfg
        bias1, bias2_sqrt = 1 - c.beta1 ** self.adam_step, math.sqrt(1 - c.beta2 ** self.adam_step)
        for master, m, v, g, decay in zip(self.master, self.exp_avg, self.exp_avg_sq, grads, self.decay_ranges):
            for r in decay:  # decoupled weight decay, as torch.optim.AdamW applies it
                master[r.shard_start:r.shard_end].mul_(1 - lr * c.weight_decay)
            m.lerp_(g, 1 - c.beta1)
            v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
            denom = (v.sqrt() / bias2_sqrt).add_(c.eps)
            master.addcdiv_(m, denom, value=-lr / bias1)
        self.sdp.write_shards(self.master)
        return norm, False

    # -- checkpoint interface (engine/interfaces.Optimizer) --------------------------------------------------
    def owned_state(self) -> dict:
        out = {}
        for unit, master, m, v in zip(self.sdp.units, self.master, self.exp_avg, self.exp_avg_sq):
            for r in unit.shard_ranges:
                piece = slice(r.shard_start, r.shard_end)
                out[r.name] = {"shape": tuple(r.param.shape), "range": (r.param_start, r.param_end),
                               "master": master[piece], "exp_avg": m[piece], "exp_avg_sq": v[piece]}
        return out

    @torch.no_grad()
    def load_owned_state(self, read) -> None:
        for unit, master, m, v in zip(self.sdp.units, self.master, self.exp_avg, self.exp_avg_sq):
            for r in unit.shard_ranges:
                for key, dest in (("master", master), ("exp_avg", m), ("exp_avg_sq", v)):
                    dest[r.shard_start:r.shard_end].copy_(read(r.name, key, r.param_start, r.param_end))
        self.sdp.write_shards(self.master)

    def held_tensors(self) -> list:
        return self.master + self.exp_avg + self.exp_avg_sq
