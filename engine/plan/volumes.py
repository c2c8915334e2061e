"""Bytes each collective of one training step moves, per group, as the engine issues them (what parallel/comm.py
records: an all-gather's output, a reduce-scatter's input), and which link a group uses.

Per micro-batch, with T = micro batch × sequence / CP tokens on a rank and e the compute-dtype bytes:
- tensor parallelism: per layer four all-reduces of T·h·e (two in forward, two in backward), five under full
  recomputation (its forward is run again up to the last reduction, whose output backward does not need);
  under sequence parallelism four all-gathers and four reduce-scatters of that size (each has its conjugate in
  backward), six and five under full recomputation; the embedding and the output layer one more each (one of
  each kind under SP), the vocabulary-parallel loss three of T·4 bytes;
- context parallelism (allgather): each layer gathers its keys and values (CP·T·2·kv·e) in forward (again under
  either recomputation: the gather is inside the recomputed attention core) and reduce-scatters their gradients
  in backward;
  (alltoall) each layer exchanges q, k, v and its output (T·q·e, T·kv·e each) in forward and their gradients in
  backward; (ring) each layer sends its keys and values (T·2·kv·e) CP − 1 times to the next rank in forward and
  their fp32 gradients (T·2·kv·4 below fp32) CP − 1 times back;
- a pipeline boundary: T·h·e (÷ TP under SP) forward and the same back, per model chunk.
Per step, over DP × CP (the gradient reduction group), unit by unit as parallel/fsdp_units cuts them (padded
to the shard group): ZeRO 0 all-reduces every gradient (25 MB buckets), but exchanges the untied input
embedding's by the rows the step read when parallel/embedding_rows.rows_worth_it says so; ZeRO 1 reduce-scatters
once and ZeRO 2 every micro-batch (below fp32 a unit's norm segment apart, in fp32), and both all-gather the
updated parameters after the step; ZeRO 3 gathers each unit before every micro-batch's forward and again
before its backward (not the embedding, whose backward reads no weight, nor with zero3_keep_last_gathered the
chunk's last unit) and reduce-scatters every micro-batch, looking the embedding up by rows
(parallel/embedding_shards.lookup_worth_it) where that is smaller. HSDP reduces within its group and
all-reduces the shard across the groups. Hierarchical reduction
(parallel.hierarchical_node_size) is counted stage by stage, within the node block and across the blocks. Under
ZeRO the gradients of TP-replicated parameters (norms under SP, KV projections kept whole) in a rank's shard
are summed over TP in fp32 after the reduction, under ZeRO 0 all of them.
Per step under optim.name=muon, over the stage group (TP × CP × DP: engine/optim/muon_owners.py): the two
all-to-alls of the owner plan (engine/memory_estimate.muon_plan), the pieces to their matrices' owners and the
results back, each a send buffer of the group's size × its largest message in optim.muon_ns_dtype (none where
nothing moves: the gather under DDP without TP).
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

import torch

from engine.config.schema import Config, data_parallel_size
from engine.memory_estimate import (DTYPE_BYTES, NS_BYTES, chunk_units, muon_plan, replicated_in_shards, stage_chunks,
                                    tp_summed_later)
from parallel.ddp import reduces_in_fp32
from parallel.embedding_rows import rows_worth_it
from parallel.embedding_shards import lookup_worth_it

WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "p2p": lambda n: 1.0}
STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
         "all_to_all": lambda n: n - 1, "p2p": lambda n: 1}  # ring steps, each paying the link's latency
INDEX = 8  # int64 token ids
EMBEDDING = "model.embed_tokens.weight"


@dataclass
class Collective:
    """`count` calls of `op` over a group of `ranks` of `nbytes` each, on link type `link`."""

    group: str
    op: str
    nbytes: float
    count: float
    ranks: int
    link: str
    phase: str = "critical"  # data parallelism: reduce | gather_forward | gather_backward (hidden behind
    # compute when they can be), or after_step | critical (exposed)

    def wire_bytes(self) -> float:
        """Bytes each rank sends per call (ring algorithms)."""
        return WIRE[self.op](self.ranks) * self.nbytes

    def seconds(self, link) -> float:
        """One call's time on `link` (engine/plan/profile.py:Link)."""
        return link.time(self.wire_bytes(), STEPS[self.op](self.ranks))


def link_of(span: int, gpus_per_node: int) -> str:
    """intra when a group's ranks (within `span` consecutive ranks in rank order) sit on one node."""
    return "intra" if span <= gpus_per_node else "inter"


def stage_parameters(cfg: Config, stage: int) -> int:
    """Parameters (this rank's TP slice) on pipeline stage `stage`."""
    return sum(n for unit in stage_units(cfg, stage) for _, n in unit)


def stage_units(cfg: Config, stage: int) -> list:
    return [u for layers, pre, post in stage_chunks(cfg, stage) for u in chunk_units(cfg, layers, pre, post)]


def tokens(cfg: Config) -> int:
    return cfg.train.micro_batch_size * cfg.model.seq_length // cfg.parallel.context


def per_micro_batch(cfg: Config, stage: int, world_size: int, gpus_per_node: int,
                    layers_measured: bool = False) -> list[Collective]:
    """TP, CP and pipeline collectives of one micro-batch on `stage` (all on the critical path). With
    `layers_measured` (the device profile timed the layers and the output layer on this layout's own groups,
    collectives included) only the embedding's TP collectives and the pipeline's are left to count."""
    m, p = cfg.model, cfg.parallel
    e, t, c = DTYPE_BYTES[cfg.train.precision], p.tensor, p.context
    full = cfg.train.recompute == "full"
    out = []
    chunks = stage_chunks(cfg, stage)
    layers = 0 if layers_measured else sum(n for n, _, _ in chunks)
    pre = sum(1 for _, first, _ in chunks if first)
    post = 0 if layers_measured else sum(1 for _, _, last in chunks if last)
    activation = tokens(cfg) * m.hidden_size * e
    if t > 1 and layers + pre + post:
        tp_link = link_of(t, gpus_per_node)
        if p.sequence_parallel:  # every gather has its reduce-scatter in backward and the reverse
            out += [Collective("tp", "all_gather", activation, (6 if full else 4) * layers + pre + post, t, tp_link),
                    Collective("tp", "reduce_scatter", activation, (5 if full else 4) * layers + pre + post, t,
                               tp_link)]
        else:
            out.append(Collective("tp", "all_reduce", activation, (5 if full else 4) * layers + pre + post, t,
                                  tp_link))
        if post:
            out.append(Collective("tp", "all_reduce", tokens(cfg) * 4, 3 * post, t, tp_link))
    if c > 1 and layers:
        kv = (m.kv_heads // t if m.kv_heads >= t else 1) * m.head_dim
        cp_link = link_of(t * c, gpus_per_node)
        again = cfg.train.recompute != "none"  # both recomputations run the core again, a ring's shifts with it
        if p.context_attention == "alltoall":  # q, k, v to heads and the output back, forward and backward
            q = m.num_attention_heads // t * m.head_dim
            # a recomputation runs q, k and v's exchange again; selective's stops once the attention kernel's
            # saved tensors are rebuilt (torch's checkpoint stops early), before the output's exchange
            queries, keys = 4 + (2 if full else 1 if again else 0), 4 + (2 if again else 0)
            # KV heads repeated until they split evenly over CP (parallel/context.py, _alltoall)
            repeat = c // math.gcd(kv // m.head_dim, c)
            out += [Collective("cp", "all_to_all", tokens(cfg) * q * e, queries * layers, c, cp_link),
                    Collective("cp", "all_to_all", tokens(cfg) * kv * repeat * e, keys * layers, c, cp_link)]
        elif p.context_attention == "ring":  # each forward shifts keys and values c - 1 times round the ring,
            block = tokens(cfg) * 2 * kv  # the backward their gradients (accumulated in fp32 below fp32)
            out += [Collective("cp", "p2p", block * e, (c - 1) * layers * (2 if again else 1), 2, cp_link),
                    Collective("cp", "p2p", block * max(e, 4), (c - 1) * layers, 2, cp_link)]
        else:
            gathered = c * tokens(cfg) * 2 * kv * e
            out += [Collective("cp", "all_gather", gathered, layers * (2 if again else 1), c, cp_link),
                    Collective("cp", "reduce_scatter", gathered, layers, c, cp_link)]
    if p.pipeline > 1:
        sent = activation // (t if p.sequence_parallel else 1)
        stride = t * c * data_parallel_size(cfg, world_size)  # pipeline neighbours are this many ranks apart
        out.append(Collective("pp", "p2p", sent, 2 * p.virtual_stages, 2, link_of(2 * stride, gpus_per_node)))
    return out


def padded(numel: int, shard_size: int) -> int:
    return -(-max(numel, 1) // shard_size) * shard_size


def fp32_width(cfg: Config, unit: tuple, shard_size: int) -> int:
    """Elements per rank of a ZeRO unit's fp32 norm segment, which below fp32 reduce-scatters on its own
    (parallel/fsdp_units.Unit.fp32_send_buffer: the segment sits at the unit's end, each rank's part of it padded
    to the largest); 0 in fp32 or without one."""
    if DTYPE_BYTES[cfg.train.precision] == 4:
        return 0
    return widest_fp32_part(unit, shard_size, tuple(cfg.parallel.fp32_reduce))


@functools.lru_cache(maxsize=4096)  # the same few units of thousands of layouts
def widest_fp32_part(unit: tuple, shard_size: int, fp32_reduce: tuple) -> int:
    numel = sum(n for _, n in unit)
    fp32 = sum(n for name, n in unit if reduces_in_fp32(name, fp32_reduce))
    if not fp32:
        return 0
    shard, start = -(-max(numel, 1) // shard_size), numel - fp32
    return max(max(0, min(numel, (r + 1) * shard) - max(start, r * shard)) for r in range(shard_size))


def tp_replicated(cfg: Config, units: list, shard_size: int) -> list[int]:
    """Per rank of the shard group: elements of TP-replicated parameters (engine/memory_estimate.tp_summed_later)
    inside its shard of the units; their reduced gradients are summed over TP in fp32 after the reduction
    (parallel/fsdp)."""
    p = cfg.parallel
    total = [0] * shard_size
    if p.tensor == 1:
        return total
    split = DTYPE_BYTES[cfg.train.precision] != 4
    for unit, times in Counter(units).items():  # the blocks' units are equal: each distinct one once
        fp32_last = tuple(split and reduces_in_fp32(name, p.fp32_reduce) for name, _ in unit)
        replicated = tuple(tp_summed_later(cfg, [x]) for x in unit)
        total = [a + times * b for a, b in zip(total, replicated_in_shards(unit, fp32_last, replicated, shard_size))]
    return total


def flat_or_hierarchical(cfg: Config, op: str, nbytes: float, count: float, ranks: int, link: str,
                         gpus_per_node: int) -> list[Collective]:
    """A gradient reduction over the DP × CP group, or, under parallel.hierarchical_node_size, its stages as
    parallel/ddp.hierarchical_all_reduce and parallel/fsdp issue them: reduce-scatter within the node block,
    then across the blocks on the block's share (all-reduce, and an all-gather back within the block, for an
    all-reduce)."""
    node = cfg.parallel.hierarchical_node_size
    if not node or node >= ranks:
        return [Collective("dp", op, nbytes, count, ranks, link, "reduce")]
    intra = link_of(cfg.parallel.tensor * node, gpus_per_node)
    out = [Collective("dp", "reduce_scatter", nbytes, count, node, intra, "reduce"),
           Collective("dp", op, nbytes / node, count, ranks // node, link, "reduce")]
    if op == "all_reduce":
        out.append(Collective("dp", "all_gather", nbytes, count, node, intra, "reduce"))
    return out


def per_step(cfg: Config, stage: int, world_size: int, gpus_per_node: int,
             shard_rank: int | None = None) -> list[Collective]:
    """The gradient and parameter collectives of data parallelism on `stage`, per step, of the rank `shard_rank`
    of its ZeRO shard group (by default the one with the most TP-replicated gradient elements to sum)."""
    p, m = cfg.parallel, cfg.model
    e = DTYPE_BYTES[cfg.train.precision]
    dp = data_parallel_size(cfg, world_size)
    n = dp * p.context  # gradients are reduced over DP × CP
    if n == 1:  # nothing to reduce, but TP-replicated gradients are summed over TP at every ZeRO stage
        return tp_sum_of_replicated(cfg, stage_units(cfg, stage), gpus_per_node)
    micro_batches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    span = p.tensor * n
    chunks = stage_chunks(cfg, stage)
    units = [(chunk_units(cfg, *chunk), chunk) for chunk in chunks]
    table = [u for unit_list, _ in units for u in unit_list if [name for name, _ in u] == [EMBEDDING]]
    rows, width = (table[0][0][1] // m.hidden_size, m.hidden_size) if table else (0, 0)
    link = link_of(span, gpus_per_node)
    if p.zero_stage == 0:
        by_rows = bool(table) and p.embedding_row_exchange and rows_worth_it(
            torch.empty(rows, width, dtype=torch.float32 if e == 4 else torch.bfloat16, device="meta"), n,
            cfg.train.global_batch_size // dp * m.seq_length)
        dense = sum(num * (4 if reduces_in_fp32(name, p.fp32_reduce) else e) for unit_list, _ in units
                    for unit in unit_list for name, num in unit if not (by_rows and name == EMBEDDING))
        buckets = max(1, -(-dense // int(p.bucket_mb * 2**20)))  # one reduction a step, in this many calls
        out = [c for _ in range(buckets) for c in flat_or_hierarchical(cfg, "all_reduce", dense / buckets, 1, n, link,
                                                                          gpus_per_node)]
        if by_rows:
            bound = min(micro_batches * tokens(cfg), rows)  # distinct rows this rank read at most
            out += [Collective("dp", "all_gather", n * bound * width * e, 1, n, link),
                    Collective("dp", "all_gather", n * bound * INDEX, 1, n, link)]
        return out + tp_sum_of_replicated(cfg, [u for unit_list, _ in units for u in unit_list], gpus_per_node)
    k = p.hsdp_group_size or n
    shard_link = link_of(p.tensor * k, gpus_per_node)
    lookup = (p.zero_stage == 3 and p.zero3_embedding_rows and bool(table) and not p.hsdp_group_size
              and not p.hierarchical_node_size
              and lookup_worth_it(rows, width, e, k, cfg.train.micro_batch_size * m.seq_length))
    reductions = 1 if p.zero_stage == 1 else micro_batches
    out = []
    for unit_list, _ in units:
        for i, unit in enumerate(unit_list):
            size = padded(sum(num for _, num in unit), k) * e
            embedding = [name for name, _ in unit] == [EMBEDDING]
            if not (embedding and lookup):
                out += flat_or_hierarchical(cfg, "reduce_scatter", size, reductions, k, shard_link, gpus_per_node)
                if fp32_width(cfg, unit, k):
                    out += flat_or_hierarchical(cfg, "reduce_scatter", k * fp32_width(cfg, unit, k) * 4, reductions,
                                                k, shard_link, gpus_per_node)
            if p.zero_stage < 3:
                out.append(Collective("dp", "all_gather", size, 1, k, shard_link, "after_step"))
                continue
            if not (embedding and lookup):
                out.append(Collective("dp", "all_gather", size, micro_batches, k, shard_link, "gather_forward"))
            if not (embedding or i == len(unit_list) - 1 and p.zero3_keep_last_gathered):
                out.append(Collective("dp", "all_gather", size, micro_batches, k, shard_link, "gather_backward"))
    if lookup:
        looked_up = tokens(cfg)
        out += [Collective("dp", "all_gather", k * looked_up * INDEX, micro_batches, k, shard_link),
                Collective("dp", "all_to_all", k * looked_up * width * e, micro_batches, k, shard_link),
                Collective("dp", "all_gather", k * looked_up * width * e, micro_batches, k, shard_link)]
    if k < n:
        shards = sum(padded(sum(num for _, num in unit), k) for unit_list, _ in units for unit in unit_list) // k
        out.append(Collective("dp-replicas", "all_reduce", shards * e, reductions, n // k, link))
        fp32 = sum(fp32_width(cfg, unit, k) for unit_list, _ in units for unit in unit_list)
        if fp32:  # the norm segments, reduced across the replicas in fp32 as they were reduce-scattered
            out.append(Collective("dp-replicas", "all_reduce", fp32 * 4, reductions, n // k, link))
    flat_units = [u for unit_list, _ in units for u in unit_list]
    per_rank = tp_replicated(cfg, flat_units, k)
    replicated = max(per_rank) if shard_rank is None else per_rank[shard_rank]
    if replicated:
        out.append(Collective("tp", "all_reduce", replicated * 4, 1, p.tensor, link_of(p.tensor, gpus_per_node)))
    return out


def tp_sum_of_replicated(cfg: Config, units: list, gpus_per_node: int) -> list[Collective]:
    """ZeRO 0: the gradients of TP-replicated parameters in a stage's `units` (engine/memory_estimate.tp_summed_later),
    summed over TP in fp32 after the data-parallel reduction (parallel/ddp.py, parallel/tensor.py)."""
    t = cfg.parallel.tensor
    if t == 1:
        return []
    replicated = sum(n for unit in units for name, n in unit if tp_summed_later(cfg, [(name, n)]))
    return [Collective("tp", "all_reduce", replicated * 4, 1, t, link_of(t, gpus_per_node))] if replicated else []


def muon_exchange(cfg: Config, stage: int, world_size: int, gpus_per_node: int) -> list[Collective]:
    """Muon's gather and return all-to-alls of one step on `stage` (exposed: the optimizer step waits on them)."""
    plan = muon_plan(cfg, world_size, stage)
    if plan is None or plan.world == 1:
        return []
    link = link_of(plan.world, gpus_per_node)  # TP × CP × DP: consecutive ranks in the default rank order
    size = NS_BYTES[cfg.optim.muon_ns_dtype]
    return [Collective("stage", "all_to_all", plan.world * chunk * size, 1, plan.world, link, "after_step")
            for chunk in (plan.gather_chunk, plan.result_chunk) if chunk]
