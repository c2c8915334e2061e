"""The data-parallel strategy of a run: which gradient synchroniser and which optimizer `parallel.zero_stage`
selects, with the process groups they need. Gradients are reduced over DP × CP (`Topology.reduce_group`): context-
parallel ranks hold the same weights and each has a part of every sequence's gradient."""
from __future__ import annotations

import dataclasses
import os

import torch

from engine.config.schema import Config
from engine.interfaces import DataParallel, Optimizer
from engine.optim.replicated import MixedPrecisionAdamW
from engine.optim.zero import ZeroAdamW
from engine.plan.offload_pays import speculation_pays
from engine.plan.profile import default_profile, load_profile
from parallel.ddp import BucketedDDP
from parallel.fsdp import ShardedDataParallel


def build_data_parallel(cfg: Config, topo, tp, chunks: list, named_params: list,
                        dtype: torch.dtype) -> tuple[DataParallel, Optimizer]:
    """(gradient synchroniser, optimizer) for `parallel.zero_stage`: bucketed DDP + replicated AdamW for
    stage 0, sharded units + ZeroAdamW for stages 1-3."""
    p = cfg.parallel
    optim = overlap_setting(cfg, topo.layout.world_size, chunks)
    hierarchy = topo.build_hierarchical_dp(p.hierarchical_node_size) if p.hierarchical_node_size else None
    tied = topo.embedding_group if cfg.model.tie_embeddings else None  # embedding + its last-stage copy
    if p.zero_stage == 0:
        # the most tokens a rank reads in a step (the full batch, after any ramp)
        tokens = cfg.train.global_batch_size // topo.dp_size * cfg.model.seq_length if p.embedding_row_exchange else 0
        ddp = BucketedDDP(named_params, topo.reduce_group, tp, chunks, p.bucket_mb, p.fp32_reduce, hierarchy, tied,
                          tokens)
        return ddp, MixedPrecisionAdamW(named_params, optim, topo, cfg.train.precision, ddp)
    hsdp = topo.build_hierarchical_dp(p.hsdp_group_size) if p.hsdp_group_size else None
    unit_groups = topo.build_unit_groups(max_units(cfg), p.unit_group_count) if p.unit_process_groups else None
    # the most tokens a rank's micro-batch holds (before and after a micro-batch switch)
    lookup_tokens = max(cfg.train.micro_batch_size, cfg.train.micro_batch_size_after_switch) * \
        cfg.model.seq_length if p.zero3_embedding_rows else 0
    sdp = ShardedDataParallel(chunks, p.zero_stage, topo.reduce_group, topo.reduce_size, tp, dtype,
                              p.fp32_reduce, unit_groups, hsdp, hierarchy, tied, p.zero3_keep_last_gathered,
                              lookup_tokens)
    return sdp, ZeroAdamW(sdp, optim, topo, cfg.train.precision)


def overlap_setting(cfg: Config, world_size: int, chunks: list):
    """The optimizer's configuration, with optim.offload_overlap=auto turned off where the time model predicts
    that speculative host steps lengthen the step (engine/plan/offload_pays.speculation_pays, from the shipped
    profile of this device type); "auto" then still speculates only after a step that did not clip."""
    o = cfg.optim
    if o.offload_fraction <= 0 or o.offload_overlap != "auto":
        return o
    device = next(p for chunk in chunks for p in chunk.parameters()).device
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if speculation_pays(cfg, world_size, load_profile(default_profile(device.type, cfg.train.precision)), ranks):
        return o
    return dataclasses.replace(o, offload_overlap="false")


def max_units(cfg: Config) -> int:
    """An upper bound on any rank's unit count, the same on every rank (group creation is collective)."""
    return cfg.model.num_layers + 2
