"""Memory per rank before the run: parameters, gradients, optimizer state, activations and communication buffers.

    estimate(cfg, world_size) -> [StageMemory per pipeline stage]   (every rank of a stage holds the same)

Parameters, gradients and optimizer state are counted tensor by tensor as the engine allocates them: the model
chunks' parameters at the TP size (vocabulary padded to a multiple of TP, KV projections kept whole when there
are fewer KV heads than TP ranks), and for ZeRO the sharding units of parallel/fsdp (one flat buffer per block,
padded to a multiple of the shard group, HSDP's group when set). Stage 0 keeps every gradient in the compute
dtype and fp32 masters (below fp32) plus the two Adam moments (under optim.name=muon one momentum buffer for the
blocks' matrices instead); stage ≥ 1 keeps a fp32 master and moments (or Muon's momentum) of its shard; stage 1 keeps full gradients, stages 2-3 their reduced shards (fp32 for the norm segment under
bf16/fp16); stage 3 keeps only the parameter shard. `optim.offload_fraction` moves the state of some tensors
(engine/optim/offload.py: whole parameters at stage 0, whole unit shards at stage ≥ 1, chosen as the engine chooses)
to the host: 16 bytes per element there (fp32 master, two moments, the fp32 gradient buffer) and, under
bf16/fp16, the 2-byte staging buffer the gradient crosses in (engine/optim/offload.HostGrad), plus the write-back's
staging buffer in the parameter's dtype below fp32 (offload.WriteBack; an fp32 master is that buffer itself; each
crossing buffer rounded up to 4 bytes: they are views into one exact arena, offload.PinnedArena, so no allocator
rounding applies), none left on the device, and 12
more per element of a ZeRO unit stepped during backward (optim.offload_overlap: spare master and moments; under
DDP, of a parameter stepped as its bucket is reduced: see ddp_overlaps). checkpoint.async_save adds a host copy
of the rank's saved state (fp32 master and moments) while a save is written. The host total of a node is its
ranks × the fullest rank's, judged against HOST_SHARE of its memory.

Activations are the bytes autograd saves for backward, per micro-batch, summed from the tensors each kernel
saves (T = micro batch × sequence tokens, Ts = T / TP under sequence parallelism, e = compute-dtype bytes):
each RMSNorm its fp32 input (4h·Ts), its 1/rms (4·Ts) and normalised input (e·h·Ts), the next linears their
(gathered) input (e·h·T, a copy per linear under SP); attention q, k, v and its output (e·T·(2q + 2kv) of
this rank's heads) and the log-sum-exp (4·T per head, not under selective recomputation); SwiGLU gate, up
and product (3e·T·f/TP); under full recomputation only each block's input (e·h·Ts). The loss keeps fp32
log-probabilities when one unsplit chunk holds every token, else the logits (e·T·V/TP), and nothing of size V
when fused with the output layer. Times the micro-batches a schedule holds at once: one without a pipeline, all under GPipe,
min(PP - stage, m) under 1F1B, the interleaved schedule's warm-up (of one chunk each), and under ZB-H1 / ZBV the
plan's most chunk activations held from F to W (parallel/zero_bubble_plan.py). Stages after the first
that defer weight gradients (parallel.defer_weight_grads) also hold, for one backward, the output gradient of
every linear layer of their chunk, the output layer's included (the zero-bubble schedules: every stage, for as many
backwards as the plan holds between their B and W).

Transients (`StageMemory.transient`, not part of `total`, which stays the held tensors): what the loss allocates
and frees within a step on a stage that computes it, counted at the worst of its forward (chunk fp32 copies, or
the unsplit logits beside torch's log-probabilities) and its backward (the logits' gradient and a chunk's
softmax; torch's unsplit kernel: the fp32 gradients of the log-probabilities and of the logits), less what the
queued output gradients already count. Under optim.name=muon the optimizer step's own
(`StageMemory.optimizer_transient`): the owner plan of the stage's ranks (`muon_plan`: the pieces each holds, fed
to engine/optim/muon_owners.owner_plan, the function the run agrees its plan with) and the bytes its step
allocates at once on the fullest of them (OwnerPlan.transient_bytes: the Newton–Schulz inputs, the two
all-to-alls' buffers, each owned matrix whole with the iteration's buffers, the update upcast as it is applied).
`peak` = the larger of total + transient and, in the optimizer step after backward has freed the activations,
total − activations + the RoPE tables + optimizer_transient: the most live tensor bytes of a step, what
`torch.cuda.max_memory_allocated` reports on a GPU, and engine/observe/tensor_peak.py on the CPU.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from engine.config.schema import Config, data_parallel_size
from engine.optim.muon_owners import OwnerPlan, Piece, owner_plan
from engine.optim.offload import offloaded
from engine.optim.param_groups import muon_matrix
from engine.stage_balance import chunk_layers
from parallel.ddp import reduces_in_fp32
from parallel.stage_layers import chunk_roles, stage_layer_ids
from parallel.tensor import padded_vocab_size
from parallel.topology import Layout
from parallel.zero_bubble_plan import ZERO_BUBBLE, peaks

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NS_BYTES = {"fp32": 4, "bf16": 2}  # optim.muon_ns_dtype
FP32 = 4
INDEX = 8  # int64 token ids and labels
HOST_STATE = 16  # per offloaded element: fp32 master, exp_avg, exp_avg_sq and the gradient's host buffer
HOST_SPARE = 12  # per element a ZeRO unit steps during backward (optim.offload_overlap): spare master and moments
HOST_SHARE = 0.8  # of a node's memory, the most offloaded state may take (the rest: processes, loader, page cache)
MODEL_ORDER = {"model.embed_tokens.weight": 0, "model.norm.weight": 2, "lm_head.weight": 3}  # blocks: 1


@dataclass
class StageMemory:
    """Bytes on one rank of pipeline stage `stage`; `in_flight` micro-batch activations of `per_micro_batch`."""

    stage: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    comm_buffers: int
    per_micro_batch: int
    in_flight: float
    host: int = 0  # optimizer state in host memory (optim.offload_fraction), not part of `total`
    transient: int = 0  # the loss's temporaries at their worst moment, beyond `total` (module docstring)
    optimizer_transient: int = 0  # Muon's step: its inputs, buffers and whole matrices (module docstring)
    resident: int = 0  # of the activations, what outlives backward (the RoPE tables)
    notes: list = field(default_factory=list)

    @property
    def total(self) -> int:
        """The tensors held: parameters, gradients, optimizer state, saved activations, collective buffers."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.comm_buffers

    @property
    def peak(self) -> int:
        """The most live tensor bytes during a step: the held tensors and the loss's transients, or in the
        optimizer step, after backward has freed the activations, the held state and Muon's transients."""
        return max(self.total + self.transient,
                   self.total - self.activations + self.resident + self.optimizer_transient)


# -- parameters ----------------------------------------------------------------------------------------
def layer_parameters(cfg: Config) -> list[tuple[str, int]]:
    """(name, local numel) of one transformer block at parallel.tensor, in the order the block holds them."""
    m, t = cfg.model, cfg.parallel.tensor
    h, d, f = m.hidden_size, m.head_dim, m.ffn_hidden_size
    q = m.num_attention_heads * d // t
    kv = m.kv_heads * d // t if m.kv_heads >= t else m.kv_heads * d  # fewer KV heads than TP: kept whole
    out = [("input_layernorm.weight", h), ("self_attn.q_proj.weight", q * h)]
    out += [("self_attn.q_proj.bias", q)] if m.attention_bias else []
    for name in ("k_proj", "v_proj"):
        out += [(f"self_attn.{name}.weight", kv * h)] + ([(f"self_attn.{name}.bias", kv)] if m.attention_bias else [])
    out += [("self_attn.o_proj.weight", h * q), ("post_attention_layernorm.weight", h)]
    out += [(f"mlp.{name}.weight", f // t * h) for name in ("gate_proj", "up_proj", "down_proj")]
    return out


def chunk_units(cfg: Config, layer_count: int, pre: bool, post: bool) -> list[tuple[tuple[str, int], ...]]:
    """The parameters of one model chunk grouped as parallel/fsdp's sharding units (embedding [+ final norm when
    the tied output layer is on the same chunk], each block, final norm + output layer). Units are tuples, so that
    the planner's per-unit counts can be memoised on them."""
    m, t = cfg.model, cfg.parallel.tensor
    return list(units_of_chunk(tuple(layer_parameters(cfg)), padded_vocab_size(m.vocab_size, t) // t, m.hidden_size,
                               m.tie_embeddings, layer_count, pre, post))


@functools.lru_cache(maxsize=4096)  # the planner asks for the same few chunks of thousands of layouts
def units_of_chunk(block: tuple, vocab_rows: int, hidden: int, tied: bool, layer_count: int, pre: bool,
                   post: bool) -> tuple:
    embedding = ("model.embed_tokens.weight", vocab_rows * hidden)
    norm = ("model.norm.weight", hidden)
    tied_here = post and pre and tied
    units = [(embedding, norm) if tied_here else (embedding,)] if pre else []
    units += [tuple((f"model.layers.{name}", n) for name, n in block)] * layer_count
    if post and not tied_here:
        units.append((norm, ("lm_head.weight", vocab_rows * hidden)))
    return tuple(units)


def stage_chunks(cfg: Config, stage: int) -> list[tuple[int, bool, bool]]:
    """(layers, pre_process, post_process) of each model chunk of pipeline stage `stage`."""
    p = cfg.parallel
    if p.pipeline == 1:
        return [(cfg.model.num_layers, True, True)]
    return list(pipeline_chunks(cfg.model.num_layers, p.pipeline, p.virtual_stages, p.schedule == "zbv",
                                tuple(chunk_layers(cfg)))[stage])


@functools.lru_cache(maxsize=4096)
def pipeline_chunks(num_layers: int, pipeline: int, virtual: int, v_shape: bool, counts: tuple) -> tuple:
    """stage_chunks of every stage, for layers per chunk `counts`."""
    ids = stage_layer_ids(num_layers, pipeline, virtual, list(counts), v_shape)
    return tuple(tuple((len(ids[stage][j]), *chunk_roles(stage, pipeline, virtual, j, v_shape))
                       for j in range(virtual)) for stage in range(pipeline))


def state_bytes(cfg: Config, units: list, shard_size: int, shard_rank: int | None = None
                ) -> tuple[int, int, int, int, int]:
    """(parameters, gradients, device optimizer state, largest unit's full bytes, host optimizer state) of the
    rank `shard_rank` of its shard group, by default the one with the most gradient bytes (ranks differ only in
    the fp32 gradients of the norm segment their shard holds)."""
    e, stage, fraction = DTYPE_BYTES[cfg.train.precision], cfg.parallel.zero_stage, cfg.optim.offload_fraction
    if stage == 0:
        distinct = Counter(units)  # the blocks' units are equal: each distinct one counted once, times its count
        n = sum(times * sum(k for _, k in unit) for unit, times in distinct.items())
        muon = sum(times * sum(k for name, k in unit if muon_stepped(cfg, name))  # one momentum buffer, not two
                   for unit, times in distinct.items())  # moments
        host = spares = staging = 0
        if fraction:  # the optimizer offloads whole parameters, in reverse model order
            named = sorted((x for unit in units for x in unit), key=lambda x: MODEL_ORDER.get(x[0], 1))
            params = [k for _, k in named]
            on_host = offloaded(params[::-1], fraction)[::-1]
            host = sum(k for k, off in zip(params, on_host) if off)
            spares = sum(k for (name, k), off in zip(named, on_host) if off and ddp_overlaps(cfg, name, shard_size))
            staging = sum(staging_bytes(e, k) for k, off in zip(params, on_host) if off) if e != FP32 else 0
            if e != FP32:  # an fp32 master is its write-back's buffer (offload.WriteBack.holds_master)
                staging += sum(write_back_bytes(e, k) for k, off in zip(params, on_host) if off)
        state = (n - host) * (8 if e == FP32 else 12) - muon * FP32
        return n * e, n * e, state, 0, host * HOST_STATE + spares * HOST_SPARE + staging
    shards = [-(-max(sum(n for _, n in unit), 1) // shard_size) for unit in units]
    on_host = offloaded(shards[::-1], fraction)[::-1]
    split = e != FP32
    weights = grads = largest = 0
    optim = [0] * shard_size  # per rank: Muon's elements hold one fp32 buffer, not two moments
    spares = [0] * shard_size  # per rank: elements of the offloaded shards it steps during backward
    fp32_held = [0] * shard_size  # per rank: elements of the units' fp32 norm segments its shards hold
    staging = [0] * shard_size  # per rank: the offloaded units' 16-bit gradient staging buffers (offload.HostGrad)
    # the blocks' units are equal: each distinct (unit, placement) is counted once, times how often it occurs
    for (unit, host), times in Counter(zip(units, on_host)).items():
        if host and cfg.optim.offload_overlap != "false":  # a shard holding TP-summed elements is not stepped early
            summed = replicated_in_shards(unit, tuple(split and reduces_in_fp32(name, cfg.parallel.fp32_reduce)
                                                      for name, _ in unit),
                                          tuple(tp_summed_later(cfg, [x]) for x in unit), shard_size)
            spares = [a + times * -(-max(sum(n for _, n in unit), 1) // shard_size) * (k == 0)
                      for a, k in zip(spares, summed)]
        numel = sum(n for _, n in unit)
        fp32_numel = sum(n for name, n in unit if split and reduces_in_fp32(name, cfg.parallel.fp32_reduce))
        shard = -(-max(numel, 1) // shard_size)
        largest = max(largest, shard * shard_size * e)
        fp32_start = numel - fp32_numel
        held32 = [0] * shard_size
        for rank in range(fp32_start // shard, -(-numel // shard)) if fp32_numel else ():
            held32[rank] = min(numel, (rank + 1) * shard) - max(fp32_start, rank * shard)
        fp32_held = [a + times * b for a, b in zip(fp32_held, held32)]
        if host and split:
            staging = [a + times * staging_bytes(e, shard, k) for a, k in zip(staging, held32)]
        if host and split:  # an fp32 master is its write-back's buffer (offload.WriteBack.holds_master)
            staging = [a + times * write_back_bytes(e, shard) for a in staging]
        weights += times * shard * (e if stage == 3 else e * shard_size)
        grads += times * (shard * shard_size * e + fp32_numel * FP32 if stage == 1 else shard * e)
        if not host:  # fp32 stage 3: the shard is the master
            muon = muon_in_shards(cfg, unit, shard, shard_size)
            optim = [o + times * ((2 if stage == 3 and not split else 3) * FP32 * shard - FP32 * k)
                     for o, k in zip(optim, muon)]
    grads += FP32 * (max(fp32_held) if shard_rank is None else fp32_held[shard_rank])
    optim = max(optim) if shard_rank is None else optim[shard_rank]
    return weights, grads, optim, largest, HOST_STATE * sum(s for s, host in zip(shards, on_host) if host) + \
        HOST_SPARE * (max(spares) if shard_rank is None else spares[shard_rank]) + \
        (max(staging) if shard_rank is None else staging[shard_rank])


def staging_bytes(e: int, numel: int, fp32_numel: int = 0) -> int:
    """engine/optim/offload.HostGrad's 16-bit staging buffer: `numel` elements rounded up to even, then the
    `fp32_numel` fp32-reduced ones in fp32."""
    return e * (numel + numel % 2) + FP32 * fp32_numel


def write_back_bytes(e: int, numel: int) -> int:
    """engine/optim/offload.WriteBack's staging buffer in the parameter's dtype, rounded up to 4 bytes (its
    place in the PinnedArena)."""
    return -(-e * numel // 4) * 4


def muon_stepped(cfg: Config, name: str) -> bool:
    return cfg.optim.name == "muon" and muon_matrix(name)


def muon_in_shards(cfg: Config, unit: list, shard: int, shard_size: int) -> list[int]:
    """Per rank of the shard group: the elements of Muon's matrices inside its `shard`-element piece of `unit`."""
    split = DTYPE_BYTES[cfg.train.precision] != FP32  # parallel/fsdp_units: fp32-reduced parameters go last
    fp32 = [x for x in unit if split and reduces_in_fp32(x[0], cfg.parallel.fp32_reduce)]
    out, offset = [0] * shard_size, 0
    for name, n in [x for x in unit if x not in fp32] + fp32:
        if muon_stepped(cfg, name):
            for rank in range(shard_size):
                out[rank] += max(0, min(offset + n, (rank + 1) * shard) - max(offset, rank * shard))
        offset += n
    return out


def muon_matrices(cfg: Config) -> list[tuple[str, tuple, int | None]]:
    """(name inside a block, full shape, TP split dimension) of each Muon matrix of a block, in the block's order
    (parallel/tensor.py: column-parallel q, k, v, gate, up split their rows, row-parallel o, down their columns;
    k and v kept whole with fewer KV heads than TP ranks)."""
    m, t = cfg.model, cfg.parallel.tensor
    h, f, q, kv = m.hidden_size, m.ffn_hidden_size, m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim
    rows, cols = (0, 1) if t > 1 else (None, None)
    kv_dim = rows if m.kv_heads >= t else None
    return [("self_attn.q_proj.weight", (q, h), rows), ("self_attn.k_proj.weight", (kv, h), kv_dim),
            ("self_attn.v_proj.weight", (kv, h), kv_dim), ("self_attn.o_proj.weight", (h, q), cols),
            ("mlp.gate_proj.weight", (f, h), rows), ("mlp.up_proj.weight", (f, h), rows),
            ("mlp.down_proj.weight", (h, f), cols)]


def muon_plan(cfg: Config, world_size: int, stage: int) -> OwnerPlan | None:
    """The owner plan (engine/optim/muon_owners.owner_plan) of pipeline stage `stage`'s group (TP × CP × DP, in
    rank order), from the pieces each of its ranks holds as the optimizers cut them: every block matrix's TP slice
    whole under DDP (engine/optim/replicated.muon_part), the Muon ranges of its ZeRO shard of each block's unit
    (engine/optim/zero.py, parallel/fsdp_units.py). None without optim.name=muon."""
    if cfg.optim.name != "muon":
        return None
    p = cfg.parallel
    if p.pipeline == 1:
        layer_ids = tuple(range(cfg.model.num_layers))
    else:
        ids = stage_layer_ids(cfg.model.num_layers, p.pipeline, p.virtual_stages, chunk_layers(cfg),
                              p.schedule == "zbv")[stage]
        layer_ids = tuple(i for chunk in ids for i in chunk)
    matrices = tuple((name, shape, dim) for name, shape, dim in muon_matrices(cfg))
    return stage_owner_plan(p.tensor, p.pipeline, data_parallel_size(cfg, world_size), p.context, p.rank_order,
                            stage, layer_ids, tuple(layer_parameters(cfg)), matrices,
                            DTYPE_BYTES[cfg.train.precision] != FP32, tuple(p.fp32_reduce), p.hsdp_group_size,
                            p.zero_stage, cfg.optim.muon_ns_steps)


@functools.lru_cache(maxsize=256)  # the planner asks for it from the estimate, the volumes and the time model
def stage_owner_plan(tp: int, pp: int, dp: int, cp: int, order: str, stage: int, layer_ids: tuple, block: tuple,
                     matrices: tuple, split: bool, fp32_reduce: tuple, hsdp_group_size: int, zero_stage: int,
                     ns_steps: int) -> OwnerPlan:
    """muon_plan's work, on hashable inputs: of every layout the planner scores, those that differ only in micro
    batch, recomputation or schedule share one plan."""
    layout = Layout(tp=tp, pp=pp, dp=dp, order=order, cp=cp)
    group = next(g for g in layout.groups_along("tp", "cp", "dp") if layout.coords(g[0])["pp"] == stage)
    matrices = {name: (shape, dim) for name, shape, dim in matrices}
    placed = sorted(block, key=lambda x: split and reduces_in_fp32(x[0], fp32_reduce))  # fp32 segment last
    shard_size = hsdp_group_size or len(group) // tp
    everyone = []
    for rank in group:
        tp_rank = layout.coords(rank)["tp"]
        reduce_group = next(g for g in layout.groups_along("dp", "cp") if rank in g)
        shard_rank = reduce_group.index(rank) % shard_size
        pieces = []
        for layer in layer_ids:
            numel, offset = sum(n for _, n in block), 0
            shard = -(-max(numel, 1) // shard_size)
            lo, hi = (shard_rank * shard, (shard_rank + 1) * shard) if zero_stage else (0, numel)
            for name, n in placed if zero_stage else block:
                first, end = max(offset, lo), min(offset + n, hi)
                if name in matrices and first < end:
                    shape, dim = matrices[name]
                    pieces.append(Piece(f"model.layers.{layer}.{name}", shape, dim,
                                        tp_rank if dim is not None else 0, first - offset, end - offset))
                offset += n
        everyone.append(pieces)
    return owner_plan(everyone, ns_steps)


def muon_transient(cfg: Config, world_size: int, stage: int) -> int:
    """Bytes Muon's step allocates at once on the fullest rank of `stage` (OwnerPlan.transient_bytes)."""
    plan = muon_plan(cfg, world_size, stage)
    if plan is None:
        return 0
    size = NS_BYTES[cfg.optim.muon_ns_dtype]
    return max(plan.transient_bytes(rank, size, cfg.optim.muon_nesterov) for rank in range(plan.world))


def ddp_overlaps(cfg: Config, name: str, reduce_size: int) -> bool:
    """engine/optim/replicated.overlaps from the configuration: an offloaded parameter stepped during backward (and so
    holding spares) under DDP with optim.offload_overlap."""
    p, low_precision = cfg.parallel, cfg.train.precision != "fp32"
    return (cfg.optim.offload_overlap != "false" and reduce_size > 1 and not p.hierarchical_node_size
            and "embed_tokens" not in name and "lm_head" not in name
            and not (low_precision and reduces_in_fp32(name, p.fp32_reduce))
            and not tp_summed_later(cfg, [(name, 0)]))


def tp_summed_later(cfg: Config, unit: list) -> bool:
    """Whether a unit holds TP-replicated gradients, summed over TP after the reduction (norm weights under
    sequence parallelism, KV projections kept whole): engine/optim/offload_overlap.py does not step it early."""
    m, p = cfg.model, cfg.parallel
    if p.tensor == 1:
        return False
    return any((p.sequence_parallel and "norm" in name) or (m.kv_heads < p.tensor and ("k_proj" in name or
                                                                                      "v_proj" in name))
               for name, _ in unit)


@functools.lru_cache(maxsize=4096)
def replicated_in_shards(unit: tuple, fp32_last: tuple, replicated: tuple, shard_size: int) -> tuple:
    """Per shard: elements of the `replicated` parameters of `unit` in it, laid out as parallel/fsdp_units does
    (the fp32-reduced ones, `fp32_last`, at the end)."""
    shard = -(-max(sum(n for _, n in unit), 1) // shard_size)
    placed = sorted(zip(unit, replicated, fp32_last), key=lambda x: x[2])
    out = [0] * shard_size
    offset = 0
    for (_, n), is_replicated, _ in placed:
        for rank in range(offset // shard, -(-(offset + n) // shard)) if is_replicated else ():
            out[rank] += min((rank + 1) * shard, offset + n) - max(rank * shard, offset)
        offset += n
    return tuple(out)


# -- activations ---------------------------------------------------------------------------------------
def norm_activation(cfg: Config, tokens: int) -> int:
    """An RMSNorm and the linears after it: fp32 input, 1/rms, normalised input (sequence shard
    under SP), and the linears' input: one tensor they all save (under SP the gathered sequence, which
    parallel.comm.all_gather returns contiguous)."""
    h, e, t = cfg.model.hidden_size, DTYPE_BYTES[cfg.train.precision], cfg.parallel.tensor
    sp = cfg.parallel.sequence_parallel and t > 1
    local = tokens // t if sp else tokens
    return (FP32 + e) * h * local + FP32 * local + e * h * tokens


def layer_activation(cfg: Config, tokens: int, recompute: str) -> int:
    m, p = cfg.model, cfg.parallel
    e, t = DTYPE_BYTES[cfg.train.precision], p.tensor
    local = tokens // t if p.sequence_parallel else tokens
    if recompute == "full":  # the block's input only
        return e * m.hidden_size * local
    heads = m.num_attention_heads // t
    kv = (m.kv_heads // t if m.kv_heads >= t else 1) * m.head_dim
    saved = (2 * norm_activation(cfg, tokens)  # before q/k/v, then before gate/up
             + e * tokens * (2 * heads * m.head_dim + 2 * kv + 3 * m.ffn_hidden_size // t))
    if recompute == "none":
        saved += FP32 * tokens * heads  # the attention's log-sum-exp
    if m.hidden_dropout > 0:
        saved += 2 * m.hidden_size * local  # two dropout masks (bytes)
    return saved


def ring_attention_saved(cfg: Config, micro_batch: int) -> int:
    """Bytes one layer's ring attention (parallel/context_ring.py) saves for backward on a CP rank: its queries
    and output, their fp32 log-sum-exp, the c K/V blocks it attended (its own among them), and the document ids
    [b, s] and ALiBi slopes when used. No mask, bias or dropout mask: those are rebuilt per block."""
    m, p = cfg.model, cfg.parallel
    e, c, t = DTYPE_BYTES[cfg.train.precision], p.context, p.tensor
    local = micro_batch * m.seq_length // c
    heads, kv = m.num_attention_heads // t, (m.kv_heads // t if m.kv_heads >= t else 1)
    saved = 2 * e * local * heads * m.head_dim + FP32 * local * heads + c * e * local * 2 * kv * m.head_dim
    if cfg.data.reset_attention_mask:
        saved += INDEX * micro_batch * m.seq_length
    if m.position_embedding == "alibi":
        saved += FP32 * heads
    return saved


def unsplit_loss(cfg: Config, tokens: int) -> bool:
    """Whether the loss of `tokens` tokens is torch's log-softmax over one unsplit chunk (not fused, no TP, eager)."""
    m = cfg.model
    return (not m.fused_lm_head_loss and cfg.parallel.tensor == 1 and not cfg.train.compile
            and (m.loss_chunk_tokens == 0 or tokens <= m.loss_chunk_tokens))


def loss_activation(cfg: Config, tokens: int) -> int:
    m, t = cfg.model, cfg.parallel.tensor
    e, vocab = DTYPE_BYTES[cfg.train.precision], padded_vocab_size(m.vocab_size, t) // t
    per_token = INDEX + FP32  # labels, log-sum-exp
    if m.fused_lm_head_loss:
        return per_token * tokens
    if unsplit_loss(cfg, tokens):  # torch's log-softmax keeps fp32 log-probabilities
        return (FP32 * vocab + INDEX) * tokens
    return (e * vocab + per_token + 1) * tokens


def loss_transient(cfg: Config, tokens: int, queued_logits_grad: bool) -> tuple[int, int]:
    """(forward, backward) bytes the loss allocates beyond what `loss_activation` keeps, for `tokens` tokens
    (kernels/cross_entropy.py's eager kernels; compiled ones fuse a chunk's passes, so this bounds them from
    above); `queued_logits_grad`: the logits' gradient is already counted among a deferring stage's queued
    output gradients."""
    m, t = cfg.model, cfg.parallel.tensor
    e, padded = DTYPE_BYTES[cfg.train.precision], padded_vocab_size(m.vocab_size, t)
    vocab = padded // t
    logits_grad = 0 if queued_logits_grad else e * tokens * vocab
    if unsplit_loss(cfg, tokens):
        # torch's log-softmax: forward the logits (and their fp32 copy) beside the fp32 log-probabilities;
        # backward the fp32 gradients of the log-probabilities and of the logits (the latter cast to e)
        forward = (e + (FP32 if e != FP32 else 0)) * tokens * vocab
        return forward, FP32 * tokens * vocab + (FP32 * tokens * vocab if e != FP32 else 0) + logits_grad
    chunk = min(tokens, m.loss_chunk_tokens or tokens) * vocab * FP32  # one chunk of fp32 logits
    copy = chunk if e != FP32 or padded != m.vocab_size else 0  # the chunk's own fp32 copy
    if m.fused_lm_head_loss:  # the chunk's logits recomputed; the output weight's gradient in fp32
        logits = e * chunk // FP32
        return (logits + copy + 2 * chunk,
                FP32 * vocab * m.hidden_size + logits + copy + chunk + (logits if e != FP32 else 0))
    return copy + 2 * chunk, logits_grad + copy + chunk  # forward: x − max, exp; backward: the softmax


def chunk_activation(cfg: Config, layers: int, pre: bool, post: bool, micro_batch: int, recompute: str) -> int:
    """Bytes saved for backward by one forward of one micro-batch through a model chunk (this rank's share of
    the sequence under context parallelism: activations scale as 1/c)."""
    tokens = micro_batch * cfg.model.seq_length // cfg.parallel.context
    saved = layers * layer_activation(cfg, tokens, recompute)
    if pre:
        saved += INDEX * tokens * (1 if cfg.parallel.tensor == 1 else 2)  # token ids (and their local copy)
    if post:
        saved += norm_activation(cfg, tokens) + loss_activation(cfg, tokens)
    return saved


def defers_weight_grads(cfg: Config, stage: int) -> bool:
    """Whether `stage` queues weight gradients behind its input gradient (parallel/pipeline_schedules.py)."""
    p = cfg.parallel
    # ZeRO-2's gradients are not `.grad` views while a backward runs: nothing is queued
    if p.schedule in ZERO_BUBBLE:  # every stage, always: the split is the schedule
        return p.pipeline > 1
    return p.defer_weight_grads and stage > 0 and p.schedule in ("gpipe", "1f1b") and p.zero_stage != 2


def queued_backwards(cfg: Config, stage: int, micro_batches: int) -> float:
    """Backwards (of a whole stage) whose output gradients wait for their W at once: one where a W follows
    its B directly (gpipe, 1f1b), the plan's most for the zero-bubble schedules."""
    p = cfg.parallel
    if p.schedule not in ZERO_BUBBLE:
        return 1
    return peaks(p.schedule, p.pipeline, micro_batches, stage)[1] / p.virtual_stages


def queued_output_gradients(cfg: Config, layers: int, post: bool, micro_batch: int) -> int:
    """Bytes of the linear layers' output gradients a deferring backward keeps until its weight gradients:
    q, k, v, o, gate, up, down per layer, and the output layer's logits gradient unless fused with the loss."""
    m, t, e = cfg.model, cfg.parallel.tensor, DTYPE_BYTES[cfg.train.precision]
    tokens = micro_batch * m.seq_length // cfg.parallel.context
    kv = (m.kv_heads // t if m.kv_heads >= t else 1) * m.head_dim
    per_layer = m.num_attention_heads // t * m.head_dim + 2 * kv + 2 * m.hidden_size + 2 * m.ffn_hidden_size // t
    queued = layers * e * tokens * per_layer
    if post and not m.fused_lm_head_loss:
        queued += e * tokens * padded_vocab_size(m.vocab_size, t) // t
    return queued


def in_flight(cfg: Config, stage: int, micro_batches: int) -> float:
    """Micro-batches (of a whole stage) whose activations the schedule holds at once on pipeline stage `stage`."""
    p = cfg.parallel
    if p.pipeline == 1:
        return 1
    if p.schedule == "gpipe":
        return micro_batches
    if p.schedule == "1f1b":
        return min(p.pipeline - stage, micro_batches)
    if p.schedule in ZERO_BUBBLE:  # held from F until W (an upper bound: B frees the layers' internals)
        return peaks(p.schedule, p.pipeline, micro_batches, stage)[0] / p.virtual_stages
    total, v = micro_batches * p.virtual_stages, p.virtual_stages
    warmup = total if micro_batches == p.pipeline else min((p.pipeline - stage - 1) * 2 + (v - 1) * p.pipeline,
                                                          total)
    return min(warmup + 1, total) / v  # chunk forwards, one chunk's activations each


# -- the estimate --------------------------------------------------------------------------------------
def estimate(cfg: Config, world_size: int, shard_rank: int | None = None) -> list[StageMemory]:
    """One StageMemory per pipeline stage (the configuration must be valid for `world_size`): of the rank
    `shard_rank` of the ZeRO shard group, by default the fullest."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    e = DTYPE_BYTES[t.precision]
    dp = data_parallel_size(cfg, world_size)
    shard_size = p.hsdp_group_size or dp * p.context  # ZeRO shards over DP × CP
    micro = max(t.micro_batch_size, t.micro_batch_size_after_switch)
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
    recompute = t.recompute
    out = []
    for stage in range(p.pipeline):
        chunks = stage_chunks(cfg, stage)
        units = [u for layers, pre, post in chunks for u in chunk_units(cfg, layers, pre, post)]
        weights, grads, optim, largest, host = state_bytes(cfg, units, shard_size, shard_rank)
        per_mb = sum(chunk_activation(cfg, layers, pre, post, t.micro_batch_size, recompute)
                     for layers, pre, post in chunks)
        if m.position_embedding == "rope":  # cos/sin tables, one per chunk, shared by every micro-batch
            per_mb_constant = 2 * m.seq_length * m.head_dim * e * len(chunks)
        else:
            per_mb_constant = 0
        flight = in_flight(cfg, stage, micro_batches)
        activations = int(per_mb * flight) + per_mb_constant
        if defers_weight_grads(cfg, stage):
            activations += sum(queued_output_gradients(cfg, layers, post, micro) for layers, _, post in chunks) * \
                queued_backwards(cfg, stage, micro_batches)
        if t.recompute_switch_step > 0:  # the larger of the two phases
            after = dataclasses.replace(cfg, train=dataclasses.replace(
                t, recompute=t.recompute_after_switch, micro_batch_size=micro))
            activations = max(activations, estimate_activations(after, stage, dp))
        comm = comm_bytes(cfg, units, largest, e, dp)
        transient = stage_transient(cfg, stage, chunks, micro)
        out.append(StageMemory(stage, weights, grads, optim, activations, comm, per_mb, flight, host, transient,
                               muon_transient(cfg, world_size, stage), per_mb_constant))
    return out


def stage_transient(cfg: Config, stage: int, chunks: list, micro_batch: int) -> int:
    """The loss's transients on the stage whose chunk computes it (0 elsewhere): its backward's, or its forward's
    less the queued output gradients (counted in the activations, they exist only during a backward)."""
    if not any(post for _, _, post in chunks):
        return 0
    tokens = micro_batch * cfg.model.seq_length // cfg.parallel.context
    deferring = defers_weight_grads(cfg, stage)
    forward, backward = loss_transient(cfg, tokens, deferring and not cfg.model.fused_lm_head_loss)
    queued = sum(queued_output_gradients(cfg, layers, post, micro_batch) for layers, _, post in chunks) \
        if deferring else 0
    return max(forward - queued, backward, 0)


def estimate_activations(cfg: Config, stage: int, dp: int) -> int:
    t = cfg.train
    chunks = stage_chunks(cfg, stage)
    per_mb = sum(chunk_activation(cfg, layers, pre, post, t.micro_batch_size, t.recompute)
                 for layers, pre, post in chunks)
    return int(per_mb * in_flight(cfg, stage, t.global_batch_size // (t.micro_batch_size * dp)))


def comm_bytes(cfg: Config, units: list, largest_unit: int, e: int, dp: int) -> int:
    """Buffers of the collectives, at their peak: stage 0's fp32 copies of the low-precision gradients summed in
    fp32 (the rest is reduced in place), stage ≥ 2's full gradients of up to three units in reduction, stage 3's two
    gathered units (the one in use and the prefetched one) plus, under a pipeline with
    parallel.zero3_keep_last_gathered, each chunk's last unit (kept gathered while its micro-batches' backwards
    are pending), and the pipeline's activation messages."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.zero_stage == 0:
        total = FP32 * sum(times * sum(n for name, n in unit if reduces_in_fp32(name, p.fp32_reduce))
                           for unit, times in Counter(units).items()) if dp > 1 and e != FP32 else 0
    else:
        total = (3 * largest_unit if p.zero_stage >= 2 else 0) + (2 * largest_unit if p.zero_stage == 3 else 0)
        if p.zero_stage == 3 and p.zero3_keep_last_gathered and p.pipeline > 1:
            total += p.virtual_stages * largest_unit
    if p.pipeline > 1:
        local = m.seq_length // p.context // (p.tensor if p.sequence_parallel else 1)
        total += 4 * t.micro_batch_size * local * m.hidden_size * e  # send/receive of activations and gradients
    return total


# -- report --------------------------------------------------------------------------------------------
def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def node_memory() -> int:
    """Bytes of memory on this node (MemTotal of /proc/meminfo); 0 where unknown (not judged)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return 0


def snapshot_shard_bytes(cfg: Config, world_size: int) -> int:
    """One rank's memory snapshot (engine/checkpoint/memory_snapshot.py): the fp32 master and two moments of every
    element its optimizer holds (the parameters it holds at ZeRO 0 and 3, its 1/DP shard at ZeRO 1 and 2; Muon's
    one momentum buffer counted as two moments: an upper bound)."""
    p, e = cfg.parallel, DTYPE_BYTES[cfg.train.precision]
    shard = p.hsdp_group_size or data_parallel_size(cfg, world_size) * p.context
    held = max(s.parameters for s in estimate(cfg, world_size)) // e
    return 3 * FP32 * (held // shard if p.zero_stage in (1, 2) else held)


def snapshot_host_bytes(cfg: Config, world_size: int) -> int:
    """Host memory one rank's snapshots take: memory snapshots, two generations and the one being written (kept
    between snapshots as the next one's pages) of its own shard and of its partner's; checkpoint.async_save, one
    copy of its saved state (engine/checkpoint/checkpointer.save, the RNG states' few bytes aside) while the
    background write runs."""
    copies = (6 if cfg.checkpoint.memory_interval > 0 else 0) + (1 if cfg.checkpoint.async_save else 0)
    return copies * snapshot_shard_bytes(cfg, world_size) if copies else 0


def node_host_bytes(cfg: Config, world_size: int, ranks_per_node: int) -> int:
    """Host memory of one node: its ranks × the fullest rank's offloaded optimizer state and memory snapshots."""
    return ranks_per_node * (max(s.host for s in estimate(cfg, world_size)) + snapshot_host_bytes(cfg, world_size))


def fitting_fraction(cfg: Config, world_size: int, ranks_per_node: int, budget: int) -> float:
    """The largest optim.offload_fraction (to 0.01) whose node total fits `budget` bytes."""
    low, high = 0.0, cfg.optim.offload_fraction
    for _ in range(12):
        mid = (low + high) / 2
        trial = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, offload_fraction=mid))
        low, high = (mid, high) if node_host_bytes(trial, world_size, ranks_per_node) <= budget else (low, mid)
    return math.floor(low * 100) / 100


def host_problem(cfg: Config, world_size: int, ranks_per_node: int, memory: int) -> str | None:
    """One line when a node's offloaded optimizer state exceeds HOST_SHARE of its `memory` bytes (0 = not
    judged), naming optim.offload_fraction and the fraction that fits; None when it fits."""
    offload, snapshots = cfg.optim.offload_fraction > 0, cfg.checkpoint.memory_interval > 0
    need = node_host_bytes(cfg, world_size, ranks_per_node) if offload or snapshots else 0
    budget = int(HOST_SHARE * memory)
    if not memory or need <= budget:
        return None
    if not offload:  # memory snapshots alone
        return (f"checkpoint.memory_interval={cfg.checkpoint.memory_interval} keeps {gib(need)} of memory snapshots "
                f"in each node's host memory ({ranks_per_node} ranks × 3 (2 generations and the one being written) "
                f"× own + partner's shard), more than {HOST_SHARE:.0%} of its {gib(memory)}; set "
                f"checkpoint.memory_interval=0, or shard the state over more ranks (parallel.zero_stage ≥ 1, more "
                f"data-parallel ranks)")
    fits = fitting_fraction(cfg, world_size, ranks_per_node, budget)
    fix = f"set optim.offload_fraction={fits:g} or less" if fits else "turn it off (optim.offload_fraction=0)"
    with_snapshots = "".join(text for on, text in ((snapshots, " and memory snapshots (checkpoint.memory_interval)"),
                                                    (cfg.checkpoint.async_save, " and the async save's copy "
                                                     "(checkpoint.async_save)")) if on)
    return (f"optim.offload_fraction={cfg.optim.offload_fraction:g} puts {gib(need)} of optimizer state"
            f"{with_snapshots} in each node's host memory ({ranks_per_node} ranks), more than {HOST_SHARE:.0%} of its "
            f"{gib(memory)}; {fix}, or shard the state over more ranks (parallel.zero_stage ≥ 1, more data-parallel "
            f"ranks)")


def device_memory(device) -> int:
    """Bytes of memory on `device` (a torch.device) to judge the fit by; 0 on CPU (not judged)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '141 GB', '8e10' -> bytes (GB and GiB both mean 2**30, as GPU memory is quoted)."""
    units = {"": 1, "b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30, "gib": 2**30,
             "tb": 2**40, "tib": 2**40}
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise ValueError(f"memory size {text!r} is not a size like 80GB, 141GiB or 8.5e10")
    return int(value * units[unit])


def levers(cfg: Config) -> list[tuple[str, Config]]:
    """Single changes that keep the layout and the global batch, each as (override, configuration)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    options = []
    if p.zero_stage < 3:
        options.append((f"parallel.zero_stage={p.zero_stage + 1}", "parallel", {"zero_stage": p.zero_stage + 1}))
    if t.recompute != "full":
        options.append(("train.recompute=full", "train", {"recompute": "full"}))
    if p.tensor > 1 and not p.sequence_parallel:
        options.append(("parallel.sequence_parallel=true", "parallel", {"sequence_parallel": True}))
    if t.micro_batch_size > 1 and t.micro_batch_size % 2 == 0:
        options.append((f"train.micro_batch_size={t.micro_batch_size // 2}", "train",
                        {"micro_batch_size": t.micro_batch_size // 2}))
    if not m.fused_lm_head_loss:
        options.append(("model.fused_lm_head_loss=true", "model", {"fused_lm_head_loss": True}))
    return [(text, dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **change)}))
            for text, section, change in options]


def biggest_lever(cfg: Config, world_size: int) -> tuple[str, int] | None:
    """(override, bytes it saves on the fullest rank's peak) of the single change that saves most, None if none
    saves."""
    worst = max(s.peak for s in estimate(cfg, world_size))
    best = None
    for text, changed in levers(cfg):
        saved = worst - max(s.peak for s in estimate(changed, world_size))
        if saved > 0 and (best is None or saved > best[1]):
            best = (text, saved)
    return best


def report(cfg: Config, world_size: int, device_memory: int = 0, host_memory: int = 0,
           ranks_per_node: int = 1) -> str:
    """The estimate as text: one line per pipeline stage, the fit against `device_memory` (0 = not judged) and,
    when it does not fit, the biggest lever; with optim.offload_fraction, the host state of a node of
    `ranks_per_node` ranks against `host_memory` (0 = not judged)."""
    p = cfg.parallel
    dp = data_parallel_size(cfg, world_size)
    stages = estimate(cfg, world_size)
    cp = f" × CP {p.context}" if p.context > 1 else ""
    lines = [f"memory estimate per rank (TP {p.tensor}{cp} × PP {p.pipeline} × DP {dp}, ZeRO {p.zero_stage}"
             f"{f', HSDP {p.hsdp_group_size}' if p.hsdp_group_size else ''}, {cfg.train.precision}, recompute "
             f"{cfg.train.recompute}{', SP' if p.sequence_parallel else ''}):"]
    for s in stages:
        host = f" (+ {gib(s.host)} in host memory)" if s.host else ""
        lines.append(f"  stage {s.stage}: parameters {gib(s.parameters)}, gradients {gib(s.gradients)}, optimizer "
                     f"{gib(s.optimizer)}{host}, activations {gib(s.activations)} ({s.in_flight:g} × "
                     f"{gib(s.per_micro_batch)} per micro-batch), comm buffers {gib(s.comm_buffers)}: total "
                     f"{gib(s.total)}; with the loss's transients {gib(s.transient)}"
                     f"{muon_step_text(s)}: peak {gib(s.peak)}")
    worst = max(stages, key=lambda s: s.peak)
    if device_memory:
        fits = worst.peak <= device_memory
        lines.append(f"  {'fits' if fits else 'DOES NOT FIT'}: largest rank peak {gib(worst.peak)} (stage "
                     f"{worst.stage}) of {gib(device_memory)} device memory")
        if not fits:
            lever = biggest_lever(cfg, world_size)
            lines.append(f"  biggest lever: {lever[0]} saves {gib(lever[1])} on that rank" if lever else
                         "  no single setting helps: add ranks (parallel.tensor or parallel.pipeline)")
    if cfg.optim.offload_fraction > 0 or cfg.checkpoint.memory_interval > 0:
        lines.append(host_report(cfg, world_size, stages, host_memory, ranks_per_node))
    return "\n".join(lines)


def muon_step_text(s: StageMemory) -> str:
    """The report's words for Muon's step (optim.name=muon), which happens after backward has freed the
    activations."""
    if not s.optimizer_transient:
        return ""
    return f", or in Muon's step {gib(s.optimizer_transient)} beside {gib(s.total - s.activations + s.resident)}"


def ddp_offload_warning(cfg: Config, world_size: int) -> str | None:
    """One line when offload runs under DDP with more than one data-parallel rank: each rank then keeps and steps
    the whole offloaded share on its node's host (DeepSpeed offers offload with ZeRO ≥ 1 only)."""
    dp = data_parallel_size(cfg, world_size) * cfg.parallel.context
    if cfg.optim.offload_fraction <= 0 or cfg.parallel.zero_stage != 0 or dp < 2:
        return None
    return (f"optim.offload_fraction={cfg.optim.offload_fraction:g} under DDP (parallel.zero_stage=0): each of the "
            f"{dp} data-parallel ranks keeps and steps the same offloaded state on its node's host, {dp}× the host "
            f"memory and AdamW work of ZeRO-1; set parallel.zero_stage=1, which shards it over them")


def host_report(cfg: Config, world_size: int, stages: list, memory: int, ranks_per_node: int) -> str:
    snapshots = snapshot_host_bytes(cfg, world_size)
    per_rank = max(s.host for s in stages) + snapshots
    what = [f"optim.offload_fraction={cfg.optim.offload_fraction:g}"] if cfg.optim.offload_fraction > 0 else []
    if cfg.checkpoint.memory_interval > 0:
        what.append(f"memory snapshots {gib(6 * snapshot_shard_bytes(cfg, world_size))}: 3 (2 generations and the "
                    f"one being written) × own + partner's shard of {gib(snapshot_shard_bytes(cfg, world_size))}")
    if cfg.checkpoint.async_save:
        what.append(f"async save's copy {gib(snapshot_shard_bytes(cfg, world_size))}")
    line = (f"  host memory ({'; '.join(what)}): {gib(per_rank)} on the fullest "
            f"rank, {gib(per_rank * ranks_per_node)} per node of {ranks_per_node} ranks")
    if memory:
        problem = host_problem(cfg, world_size, ranks_per_node, memory)
        line += (f"\n  HOST DOES NOT FIT: {problem}" if problem else
                 f": fits {HOST_SHARE:.0%} of {gib(memory)} node memory")
    warning = ddp_offload_warning(cfg, world_size)
    return line + (f"\n  WARNING {warning}" if warning else "")
