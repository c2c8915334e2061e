"""Typed run configuration: YAML file + dotted command-line overrides, validated before anything starts.

    cfg = load_config("launch/configs/demo.yaml", ["optim.lr=3e-4", "parallel.tensor=2"])
    validate(cfg, world_size=8)

Unknown keys are rejected with the nearest valid name; impossible layouts and batch sizes are rejected
with the numbers and the fix in the message. Every number is checked against its bounds
(engine/config/ranges.py) and the YAML is read with a bound on alias expansion (engine/config/yaml_file.py);
whatever the input, the outcome is a Config or one ConfigError line.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from data.split import parse_split
from data.stages import stages_problem
from engine.batch_ramp import ramp_problem
from engine.config.ranges import INT64_MAX, range_problem
from engine.config.yaml_file import YAMLInputError, load_yaml
from kernels.rope import rope_scaling_problem


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key, the numbers and the fix."""


@dataclass
class ModelConfig:
    """The decoder-only Llama: its shape, position encoding, initialisation, dropout and kernel choices."""

    hidden_size: int = 256  # model width
    num_layers: int = 4  # transformer blocks
    num_attention_heads: int = 8  # query heads
    num_kv_heads: int = 0  # key/value heads (grouped-query attention); 0 = same as num_attention_heads
    ffn_hidden_size: int = 688  # SwiGLU inner width
    vocab_size: int = 8192  # vocabulary; padded to a multiple of TP inside, the padding never reaches the softmax
    seq_length: int = 256  # training sequence length in tokens
    rope_theta: float = 10000.0  # RoPE base (e.g. 500000 for long context)
    # RoPE context extension {rope_type: linear | llama3 | yarn, parameters} (kernels/rope.py); {} = none
    rope_scaling: dict = field(default_factory=dict)
    kv_channels: int = 0  # dimension of each attention head; 0 = hidden_size / num_attention_heads
    attention_bias: bool = False  # biases on the q/k/v projections (Qwen2); o_proj never has one
    max_position_embeddings: int = 0  # the context the model is made for (Hugging Face export); 0 = seq_length
    hf_model_type: str = ""  # Hugging Face family to export as: llama | mistral | qwen2; "" = by the features used
    position_embedding: str = "rope"  # rotary embeddings (rope) or ALiBi attention biases (alibi)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # share the input embedding and the output layer
    init_std: float = 0.02  # standard deviation of the normal initialisation
    deepnorm_init: bool = False  # scale v/o/ffn init by (8 L)^-1/4 (DeepNet) for stability without clipping
    attention_dropout: float = 0.0  # dropout on the attention probabilities
    hidden_dropout: float = 0.0  # dropout on the embedding output and on each residual branch
    attention_backend: str = "auto"  # auto: in bf16/fp16 on CUDA cudnn (Hopper, plain causal attention), else
        # flash-attn when installed, else sdpa; sdpa on CPU (kernels/attention.select_backend); under
        # parallel.context_attention=ring, reference also sends every ring block through the reference path
    attention_window: int = 0  # sliding-window attention: tokens each query sees (itself included); 0 = all
    norm_backend: str = "auto"  # auto: apex's fused RMSNorm on CUDA when installed, else PyTorch
    loss_chunk_tokens: int = 4096  # cross-entropy rows per fp32 chunk, so full fp32 logits never exist
        # (kernels/cross_entropy.py); 0 = one chunk
    fused_lm_head_loss: bool = False  # output layer + loss per token chunk: logits never held whole (+1 matmul)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


@dataclass
class ParallelConfig:
    """How the ranks share the work: the TP × CP × PP × DP layout, pipeline schedule and data-parallel sharding."""

    tensor: int = 1  # tensor-parallel size
    pipeline: int = 1  # pipeline-parallel size; data-parallel size = world size / (tensor × context × pipeline)
    context: int = 1  # context-parallel size c: each rank holds 2 of 2c chunks of every sequence (chunks i and
        # 2c-1-i, balancing causal work); gradients are reduced over DP × CP (parallel/context.py)
    context_attention: str = "allgather"  # with context > 1: allgather = keys and values gathered over CP;
        # ring = K/V blocks passed around the CP ring; alltoall = Ulysses (heads scattered, sequence gathered)
    sequence_parallel: bool = False  # shard norms and dropout over the sequence within the TP group
    zero_stage: int = 0  # 0 bucketed DDP, 1 + optimizer state sharded, 2 + gradients, 3 + parameters (FSDP)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    schedule: str = "1f1b"  # pipeline schedule (parallel/pipeline_schedules.py); zb-h1 = 1F1B with weight gradients
        # filling the cool-down, zbv = zero-bubble V, two chunks per rank (virtual_stages=2), rank 0 holding the
        # first and last (parallel/zero_bubble_plan.py); both with zero_stage 0 or 1
    stage_layers: list[int] = field(default_factory=list)  # layers per pipeline chunk in chunk order, e.g.
        # [3, 3, 2, 2]; empty = split by parallel.stage_balance
    stage_balance: str = "layers"  # without stage_layers: layers = even layer counts (earlier chunks take the
        # remainder); compute = even estimated compute, the output layer counted on the last chunk
        # (engine/stage_balance.py)
    defer_weight_grads: bool = True  # gpipe/1f1b with zero_stage 0, 1 or 3: where a stage would then only wait (cool-down),
        # it sends a backward's input gradient before computing its weight gradients; bit-identical, shorter steps,
        # one backward's output gradients held longer (docs/parallelism.md)
    rank_order: str = "tp-dp-pp"  # fastest-varying dimension first: TP ranks adjacent by default; CP, when not
        # named (e.g. tp-cp-dp-pp), comes right after TP
    backend: str = "auto"  # collective backend; auto = nccl with CUDA, else gloo
    timeout_minutes: float = 10.0  # collective timeout: a dead or hung rank ends the job instead of hanging it
    bucket_mb: float = 25.0  # zero_stage 0: size of each gradient all-reduce bucket (MB)
    embedding_row_exchange: bool = True  # zero_stage 0: send only the input-embedding rows the step read,
        # when that moves fewer bytes than all-reducing the table (parallel/embedding_rows.py; untied only)
    unit_process_groups: bool = False  # zero_stage >= 1: the units' collectives on their own DP communicators,
        # so one unit's reduce-scatter does not queue behind another's gather
    unit_group_count: int = 4  # with unit_process_groups: that many DP communicators, shared by the units
        # round-robin (each is a real NCCL communicator: memory and start-up time per rank)
    zero3_keep_last_gathered: bool = True  # zero_stage 3: the unit run last in forward (final norm + LM head)
        # stays gathered until its backward instead of being freed and gathered again (pipeline: +1 unit per chunk)
    zero3_embedding_rows: bool = True  # zero_stage 3: look the input embedding's rows up from the shards and send
        # back only their gradients, when that moves fewer bytes than gathering the table (parallel/embedding_shards.py)
    hsdp_group_size: int = 0  # shard within groups of this many DP (× CP) ranks, replicate across them; 0 = plain
    hierarchical_node_size: int = 0  # reduce inside groups of this many DP (× CP) ranks first, then across; 0 = flat
    fp32_reduce: list = field(default_factory=list)  # parameter-name substrings whose gradients are reduced in
        # fp32 under bf16/fp16, besides norm weights


@dataclass
class TrainConfig:
    """The step: batch sizes, run length, precision, recomputation, compilation and validation."""

    micro_batch_size: int = 4  # sequences per micro-batch per data-parallel rank
    global_batch_size: int = 16  # sequences per optimizer step = micro batch × accumulation steps × DP size
    steps: int = 100  # optimizer steps
    seed: int = 1234  # one seed for initialisation, data order and dropout
    precision: str = "fp32"  # compute dtype; bf16/fp16 keep fp32 master weights, fp16 adds dynamic loss scaling
    log_interval: int = 1  # steps between records in the console and metrics.jsonl
    device: str = "auto"  # auto = cuda when available, else cpu
    cpu_allocator: str = "reuse"  # on the CPU, reuse = glibc keeps freed memory for the next step (no page
        # faults on fresh pages, engine/observe/host_memory.py); default = leave malloc alone
    recompute: str = "none"  # activation recomputation per block: selective = attention core, full = whole block
    recompute_switch_step: int = 0  # from this step on use recompute_after_switch (0 = never switch)
    recompute_after_switch: str = "full"  # recompute mode from train.recompute_switch_step on
    micro_batch_size_after_switch: int = 0  # micro batch from the switch step on (0 = unchanged); the global
        # batch and the data order stay the same
    compile: bool = False  # torch.compile each transformer block and the cross-entropy's per-chunk kernels
    eval_interval: int = 0  # steps between validation losses (and at the last step); 0 = no evaluation
    eval_iters: int = 10  # global batches of the validation split per evaluation (the same ones each time)
    eval_per_dataset: bool = False  # also each data.paths dataset's own validation loss (eval_loss_by_dataset)
    batch_size_ramp: list[int] = field(default_factory=list)  # [start, increment, ramp_samples]: the global batch
        # starts at start and grows by increment each ramp_samples / ((global_batch_size - start) / increment)
        # samples (Megatron's --rampup-batch-size); the LR schedule then counts samples (engine/batch_ramp.py)
    eval_tasks: list = field(default_factory=list)  # multiple-choice task files (JSONL: context, choices, gold)
        # scored as lm-evaluation-harness does; logged as <task>/acc, <task>/acc_norm (engine/evaluate/tasks.py)
    eval_tasks_interval: int = 0  # steps between task evaluations (and at the last step); 0 = never
    eval_window: int = 0  # most tokens a task request is scored with (longer ones lose their start, as
        # lm-evaluation-harness truncates); 0 = model.seq_length. Each request costs only its own length
    diary_prompts: list = field(default_factory=list)  # prompts continued at every checkpoint save into
        # run.dir/diary.jsonl (engine/observe/diary.py); needs data.tokenizer
    diary_max_tokens: int = 32  # new tokens per diary continuation (fewer at the end-of-document token)
    diary_sample: bool = False  # also a sampled continuation (temperature 0.8, top-p 0.95, seed train.seed + step)


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon for the blocks' matrices: docs/training.md), gradient clipping and the
    learning-rate schedule (engine/optim/lr_schedule.py)."""

    name: str = "adamw"  # adamw for every parameter; muon = Muon for the blocks' 2-D weights (q, k, v, o, gate, up,
        # down), AdamW (lr, weight_decay, beta1, beta2, eps below) for embeddings, output layer, norms, biases
    lr: float = 3e-4  # peak learning rate (under optim.name=muon: the AdamW parameters')
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    warmup_steps: int = 10  # linear warm-up steps
    schedule: str = "cosine"  # after warm-up; wsd = warmup-stable-decay, two_phase = cosine, then linear
    weight_decay: float = 0.1  # decoupled AdamW decay (not applied to norm weights or 1-D parameters)
    clip_grad: float = 1.0  # global gradient-norm clip; 0 = off
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    decay_fraction: float = 0.2  # wsd: last fraction of steps that decays; two_phase: the linear tail
    implementation: str = "auto"  # AdamW kernel (kernels/adamw.py); auto = torch fused, on CUDA or CPU
    offload_fraction: float = 0.0  # share of each rank's fp32 masters + Adam moments kept and stepped in host
        # memory, in whole tensors (engine/optim/offload.py, docs/offload.md); 0 = none, 1 = all
    offload_overlap: str = "auto"  # step each offloaded piece on a host thread as soon as its gradients are
        # reduced during backward, speculatively, redone from its host gradient when the step clips
        # (engine/optim/offload_overlap.py); true/false = always/never; auto = where the time model predicts it
        # pays (engine/plan/offload_pays.py), on a step only when the previous finite step did not clip (a clipped
        # step discards the speculation: early training clips almost always)
    offload_threads: int = 0  # intra-op threads of the host step's worker thread; 0 = the node's cores over its
        # local ranks (LOCAL_WORLD_SIZE), minus one for the rank's autograd and loader threads, at least one
    # Muon (engine/optim/muon.py), torch.optim.Muon's options and defaults; its learning rate follows the schedule
    muon_lr: float = 1e-3  # Muon's peak learning rate (scaled by the schedule as optim.lr is)
    muon_weight_decay: float = 0.1  # decoupled: each step the matrix is scaled by 1 - lr × weight_decay
    muon_momentum: float = 0.95  # momentum buffer decay, B ← momentum·B + (1 - momentum)·g (torch's lerp)
    muon_nesterov: bool = True  # orthogonalise g + momentum·(B - g) instead of B
    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])  # (a, b, c) of
        # the quintic Newton–Schulz iteration X ← aX + (bA + cA²)X, A = XXᵀ
    muon_eps: float = 1e-7  # Newton–Schulz: X is first divided by max(‖X‖_F, eps)
    muon_ns_steps: int = 5  # Newton–Schulz iterations
    muon_adjust_lr_fn: str = "original"  # update scale per matrix [A, B]: original = sqrt(max(1, A/B)) (torch's
        # None), match_rms_adamw = 0.2·sqrt(max(A, B)) (Moonlight: reuse AdamW's lr and weight decay)
    muon_ns_dtype: str = "bf16"  # the Newton–Schulz iteration's dtype: bf16 as torch, or fp32


@dataclass
class DataConfig:
    """What training reads: token shards from tools/preprocess_data.py (or synthetic tokens), split and packing."""

    paths: list = field(default_factory=list)  # dataset prefixes, optionally weighted: ["0.6", "a", "0.4", "b"];
        # a prefix may be s3://bucket/dir/name, fetched and verified through data.local_cache_dir (docs/data.md)
    tokenizer: str = ""  # tokenizer.json (or SentencePiece .model) used for samples and HF export
    mock: bool = False  # deterministic random tokens instead of files (tests, benchmarks)
    split: str = "98,2,0"  # train,valid,test weights, split by document
    cache_dir: str = ""  # where sample-index arrays are cached; "" = index-cache/ beside the first dataset
    # Documents packed into one sample (data/documents.py): keep attention/positions inside each document,
    # and skip the loss after an end-of-document token. Megatron-LM's switches of the same names.
    reset_attention_mask: bool = False  # tokens never attend to earlier documents packed in the same sample
    reset_position_ids: bool = False  # RoPE positions restart at 0 after each end-of-document token
    eod_mask_loss: bool = False  # no loss where the input token is end-of-document
    eod_token_id: int = -1  # end-of-document id of the three switches above; -1 = data.tokenizer's own (data/eod.py)
    stages: list[dict] = field(default_factory=list)  # data-mixture stages instead of data.paths:
        # [{until_step: 900, paths: ["0.8", web, "0.2", code]}, {until_step: 1000, paths: [...]}]; each stage
        # trains until its until_step, the last ≥ train.steps (engine/data_stages.py)
    local_cache_dir: str = ""  # node-local directory: one rank per node copies the shards read there first,
        # checksum-verified, and reuses an intact copy on restart (data/local_cache.py); "" = read in place;
        # needed for s3:// entries of data.paths


@dataclass
class CheckpointConfig:
    """When checkpoints are saved, which are kept, where they are copied and how they are loaded."""

    interval: int = 0  # steps between checkpoints, and the last step is saved too; 0 = off
    interval_minutes: float = 0.0  # also save when this much wall time has passed since the last save; 0 = off
    keep: int = 3  # newest checkpoints kept
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this, forever (0 = off)
    load: str = ""  # a checkpoint (or checkpoints) directory, or an s3://bucket/prefix of one, to start from
        # when run.dir has none
    mirrors: list = field(default_factory=list)  # more locations that receive a SHA-256-verified copy of every
        # checkpoint in the background, in order: directories and s3://bucket/prefix URLs, each optionally
        # ?keep=N&keep_every=M (docs/checkpoints.md); a run whose run.dir lost its checkpoints resumes from them
    mirror_dir: str = ""  # the older spelling of one checkpoint.mirrors directory (read as its first entry)
    upload_wait_s: float = 120.0  # at the end of the run or a preemption stop, seconds to wait for copies still
        # in flight to the mirrors before exiting (what did not finish is named)
    upload_retries: int = 3  # retries of a failed copy to one location, after 1, 2, 4, ... × upload_backoff_s
    upload_backoff_s: float = 2.0  # seconds before the first retry of a failed copy
    upload_part_mb: int = 64  # S3 multipart part size; memory per upload is about upload_threads × this
    upload_threads: int = 4  # S3 parts uploaded in parallel per location
    async_save: bool = False  # snapshot to host memory, write in a background thread
    verify: bool = True  # check every file's SHA-256 before loading (sizes are always checked)
    fallback: bool = False  # on a corrupt checkpoint, restore the next location's verified copy (a mirror's)
        # or load the previous intact one instead of stopping
    exit_after: int = 0  # save and stop after this step (scheduled stops, resume drills); 0 = off
    light_interval: int = 0  # steps between light snapshots (bf16 weights only, run.dir/light_checkpoints; never
        # resumed from; engine/checkpoint/light_snapshot.py); 0 = off
    light_keep: int = 3  # newest light snapshots kept
    memory_interval: int = 0  # steps between memory snapshots: each rank's training state in node-local shared
        # memory (memory_dir) and a copy on a partner rank of the next node, two generations kept; a restart
        # resumes from the newest complete one when newer than the disk checkpoint (docs/checkpoints.md); 0 = off
    memory_dir: str = "/dev/shm/trilith"  # where memory snapshots live, one directory per node name and run


@dataclass
class RunConfig:
    """The run directory, and the health checks that warn about a run or stop it."""

    dir: str = "runs/default"  # run directory: config.yaml, metrics.jsonl, logs/, checkpoints/
    inject_fault: str = ""  # test only: a fault to inject, once per step and run.dir: KIND@step=N,rank=R with KIND
        # kill, hang, kill_during_snapshot, kill_during_transfer, corrupt_snapshot or lose_node; KIND@every=N,rank=R
        # at every multiple of N, KIND@random=N,rank=R at one step drawn from 1..N (engine/fault_inject.py,
        # docs/launching.md); "" = none
    health_interval: int = 100  # steps between GPU health readings (NVML; also at step 0); 0 = off
    max_ecc_errors_per_hour: int = 5  # more new ECC errors than this on one GPU within an hour stops the run
    max_gpu_temperature: int = 0  # °C above which the run stops; 0 = no temperature limit
    # Training health (engine/observe/monitor.py)
    grad_norm_alarm: float = 2.0  # warn when the global gradient norm exceeds this; 0 = off
    max_nonfinite_steps: int = 20  # stop after this many consecutive NaN/Inf (skipped) steps; 0 = never
    monitor_interval: int = 0  # steps between attention-entropy and per-head gradient-variance readings; 0 = off
    attention_entropy_min: float = 0.0  # warn when a layer's mean attention entropy (nats) is below; 0 = off
    attention_entropy_max: float = 0.0  # warn when a layer's mean attention entropy (nats) is above; 0 = off
    head_grad_variance_alarm: float = 5.0  # warn when a layer's max/min per-head gradient variance exceeds; 0 = off
    max_memory_fragmentation: float = 0.3  # CUDA: 1 - peak allocated/reserved above which cached blocks are freed
    replica_check_interval: int = 1000  # steps between checks that replicated parameters agree bit for bit
        # across ranks (also at start); 0 = at start only (parallel/replicas.py)
    # Loss spikes and rollback (engine/observe/rollback.py)
    spike_window: int = 100  # sound steps whose loss mean and std judge a spike; the span rollback_after counts
    spike_zscore: float = 6.0  # a loss this many std above the window's mean is a spike (logged); 0 = off
    rollback_after: int = 0  # this many spikes or non-finite steps within spike_window reload the last checkpoint
        # before the first of them and skip the samples read since; 0 = never roll back
    # Trackers (engine/observe/trackers.py): every metrics.jsonl record, sent by rank 0; packages from the trackers extra
    tensorboard_dir: str = ""  # TensorBoard event files go here (torch.utils.tensorboard); "" = off
    wandb_project: str = ""  # Weights & Biases project; "" = off
    wandb_mode: str = "online"  # online | offline (a local run directory, `wandb sync` later) | disabled
    wandb_name: str = ""  # W&B run name; "" = the name of run.dir
    wandb_tags: list = field(default_factory=list)  # W&B run tags, e.g. [llama, 1b]
    profile_steps: list[int] = field(default_factory=list)  # [a, b]: torch.profiler trace of steps a..b per rank
        # in run.dir/profile/rank_K/ (engine/observe/profiling.py; tools/profile_summary.py); [] = off
    timing_interval: int = 100  # steps between gathers of every rank's step time split (data wait, compute,
        # communication wait, optimizer) into that step's record, naming stragglers (engine/observe/stragglers.py); 0 = off
    straggler_threshold: float = 1.2  # a rank busy (step less communication wait) longer than this × the median
        # of the ranks doing the same work, or × its own recent median, is logged with its host as a straggler


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)


CHOICES = {
    ("model", "position_embedding"): ("rope", "alibi"),
    ("model", "attention_backend"): ("auto", "flash", "cudnn", "sdpa", "reference"),
    ("model", "norm_backend"): ("auto", "apex", "torch"),
    ("model", "hf_model_type"): ("", "llama", "mistral", "qwen2"),
    ("train", "recompute"): ("none", "selective", "full"),
    ("train", "recompute_after_switch"): ("none", "selective", "full"),
    ("optim", "implementation"): ("auto", "apex", "fused", "foreach"),
    ("optim", "offload_overlap"): ("auto", "true", "false"),
    ("parallel", "schedule"): ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv"),
    ("parallel", "stage_balance"): ("layers", "compute"),
    ("parallel", "backend"): ("auto", "gloo", "nccl"),
    ("train", "precision"): ("fp32", "bf16", "fp16"),
    ("train", "device"): ("auto", "cpu", "cuda"),
    ("train", "cpu_allocator"): ("reuse", "default"),
    ("optim", "schedule"): ("cosine", "linear", "constant", "wsd", "two_phase"),
    ("optim", "name"): ("adamw", "muon"),
    ("optim", "muon_adjust_lr_fn"): ("original", "match_rms_adamw"),
    ("optim", "muon_ns_dtype"): ("bf16", "fp32"),
    ("run", "wandb_mode"): ("online", "offline", "disabled"),
    ("parallel", "rank_order"): tuple("-".join(order) for dims in (("tp", "dp", "pp"), ("tp", "cp", "dp", "pp"))
                                      for order in itertools.permutations(dims)),
    ("parallel", "context_attention"): ("allgather", "ring", "alltoall"),
}


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_ranges(cfg: Config) -> None:
    """Every number within its bounds (engine/config/ranges.py); from_dict and validate both ask."""
    problem = range_problem(cfg)
    if problem:
        raise ConfigError(problem)


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(sorted(valid))}."


def _coerce(value, typ, where: str):
    """Convert a YAML value to the dataclass field's type, refusing lossy conversions."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {_show(value)}")
    if typ in (int, float) and isinstance(value, str) and _looks_numeric(value):
        value = float(value)  # a file's 3e-4 is a string to PyYAML, as on the command line
    if typ is int:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where}: expected an integer, got {_show(value)}")
        return int(value)
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_show(value)}")
        if isinstance(value, int) and abs(value) > INT64_MAX:
            raise ConfigError(f"{where}={_show(value)} must be a finite number")
        return float(value)
    if typ is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {_show(value)}")
        return str(value)
    if typ == list[float]:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of numbers like [3.4445, -4.775, 2.0315], got {_show(value)}")
        return [_coerce(v, float, f"{where}[{i}]") for i, v in enumerate(value)]
    if typ == list[int]:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of integers like [3, 3, 2, 2], got {_show(value)}")
        return [_coerce(v, int, f"{where}[{i}]") for i, v in enumerate(value)]
    if typ == list[dict]:
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{where}: expected a list of mappings like [{{until_step: 900, paths: [a]}}], "
                              f"got {_show(value)}")
        return [dict(v) for v in value]
    if typ is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping like {{rope_type: linear, factor: 2.0}}, "
                              f"got {_show(value)}")
        return dict(value)
    if typ is list:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {_show(value)}")
        return [_coerce(v, str, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"unsupported config type {typ} at {where}")


def from_dict(raw: dict) -> Config:
    cfg = Config()
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a mapping of sections, got {type(raw).__name__}")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for section, values in raw.items():
        if not isinstance(section, str):
            raise ConfigError(f"config key {_show(section)} is not a section name; use one of {', '.join(sections)}")
        if section not in sections:
            raise ConfigError(f"unknown config section {_show(section)}.{_suggest(section, list(sections))}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{section}' must be a mapping, got {_show(values)}")
        target = getattr(cfg, section)
        hints = typing.get_type_hints(type(target))
        valid = [f.name for f in dataclasses.fields(target)]
        for key, value in values.items():
            if not isinstance(key, str):
                raise ConfigError(f"config key {_show(key)} in section '{section}' is not a name.{_suggest('', valid)}")
            if key not in valid:
                raise ConfigError(f"unknown config key {_show(section + '.' + key)}.{_suggest(key, valid)}")
            choices = CHOICES.get((section, key))
            if isinstance(value, bool) and choices and "true" in choices:  # a YAML true/false among named choices
                value = str(value).lower()
            value = _coerce(value, hints[key], f"{section}.{key}")
            if choices and value not in choices:
                close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
                raise ConfigError(f"{section}.{key}={_show(value)} is not one of {', '.join(choices)}"
                                  + (f"; did you mean '{close[0]}'?" if close else ""))
            setattr(target, key, value)
    check_ranges(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` overrides; values are parsed as YAML (so 3e-4, true, [a, b] work)."""
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {_show(item)} must look like section.key=value, e.g. optim.lr=3e-4")
        dotted, text = item.split("=", 1)
        section, key = dotted.split(".", 1)
        try:
            value = load_yaml(text) if text != "" else ""
        except YAMLInputError as exc:
            raise ConfigError(f"override {_show(item)}: the value is not valid YAML ({exc}); quote or fix it") from exc
        if isinstance(value, str) and _looks_numeric(value):
            value = float(value)
        if raw.get(section) is None:
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise ConfigError(f"config section '{section}' must be a mapping, got {_show(raw[section])}; "
                              f"cannot apply override {_show(item)}")
        raw[section][key] = value
    return raw


def _looks_numeric(text: str) -> bool:
    # PyYAML reads "3e-4" (no dot) as a string; accept it as the number the user meant.
    try:
        float(text)
        return True
    except ValueError:
        return False


MAX_CONFIG_BYTES = 4 << 20  # a configuration is a few KB; anything this large is the wrong file


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    raw: dict = {}
    if path:
        raw = _read_config_file(Path(path))
    return from_dict(apply_overrides(raw, overrides or []))


def _read_config_file(path: Path) -> dict:
    if not path.is_file():
        state = "is not a regular file" if path.exists() else "does not exist"
        raise ConfigError(f"config file {path} {state}; pass an existing YAML file with --config")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is over {MAX_CONFIG_BYTES >> 20} MiB; pass the YAML configuration")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                          f"{exc.start}); save it as UTF-8") from exc
    try:
        raw = load_yaml(text)
    except YAMLInputError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections (model:, train:, ...), got "
                          f"{type(raw).__name__}")
    return raw


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def data_parallel_size(cfg: Config, world_size: int) -> int:
    p = cfg.parallel
    model_parallel = p.tensor * p.context * p.pipeline
    if world_size % model_parallel:
        keys, sizes = ("tensor", "context", "pipeline"), (p.tensor, p.context, p.pipeline)
        shown = [(k, n) for k, n in zip(keys, sizes) if k != "context" or n > 1]  # CP named only when in use
        raise ConfigError(
            f"world size {world_size} is not divisible by {' × '.join(f'parallel.{k}' for k, _ in shown)} = "
            f"{'×'.join(str(n) for _, n in shown)} = {model_parallel}; "
            f"use a world size that is a multiple of {model_parallel} or change the layout")
    return world_size // model_parallel


def validate(cfg: Config, world_size: int) -> None:
    """Reject impossible combinations before any process group or tensor is made."""
    check_ranges(cfg)
    from engine.fault_inject import parse  # it imports this module
    parse(cfg.run.inject_fault)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.hidden_size % m.num_attention_heads and not m.kv_channels:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                          f"{m.num_attention_heads}; pick a head count that divides it")
    if m.num_attention_heads % m.kv_heads:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                          f"model.num_kv_heads={m.kv_heads}; grouped-query attention needs whole groups")
    if m.position_embedding == "rope" and m.head_dim % 2:
        raise ConfigError(f"RoPE needs an even head dimension, got hidden_size/heads = {m.head_dim}")
    problem = rope_scaling_problem(m.rope_scaling)
    if problem:
        raise ConfigError(f"model.rope_scaling: {problem}")
    if m.num_attention_heads % p.tensor:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                          f"parallel.tensor={p.tensor}; use a tensor-parallel size that divides the head count")
    if m.kv_heads % p.tensor and p.tensor % m.kv_heads:
        raise ConfigError(f"model.num_kv_heads={m.kv_heads} and parallel.tensor={p.tensor}: one must divide the "
                          f"other (KV heads are split when there are at least TP of them, else replicated)")
    if m.ffn_hidden_size % p.tensor:
        raise ConfigError(f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel.tensor={p.tensor}")
    if p.sequence_parallel and m.seq_length % p.tensor:
        raise ConfigError(f"sequence parallelism splits model.seq_length={m.seq_length} over parallel.tensor="
                          f"{p.tensor} ranks; choose a sequence length divisible by {p.tensor}")
    chunks = p.pipeline * p.virtual_stages
    if m.num_layers < chunks:
        raise ConfigError(f"model.num_layers={m.num_layers} is fewer than parallel.pipeline × virtual_stages = "
                          f"{p.pipeline}×{p.virtual_stages} = {chunks} model chunks; each chunk needs a layer")
    if p.schedule == "zbv" and p.pipeline > 1 and p.virtual_stages != 2:
        raise ConfigError(f"parallel.schedule=zbv places two model chunks per rank as a V; set "
                          f"parallel.virtual_stages=2 (got {p.virtual_stages})")
    if p.virtual_stages > 1 and p.schedule not in ("interleaved", "zbv"):
        raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} needs parallel.schedule=interleaved "
                          f"(or zbv with 2)")
    if p.schedule in ("zb-h1", "zbv") and p.pipeline > 1 and p.zero_stage >= 2:
        raise ConfigError(f"parallel.schedule={p.schedule} with parallel.zero_stage={p.zero_stage}: the schedule "
                          f"holds several micro-batches' weight gradients between their B and W slots, which ZeRO-2/3 "
                          f"reduce as each backward ends (it would take one gradient buffer per micro-batch in "
                          f"flight); use parallel.zero_stage 0 or 1, or parallel.schedule=1f1b")
    if p.virtual_stages > 1 and p.pipeline == 1:
        raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} needs parallel.pipeline > 1 (virtual "
                          f"stages are extra model chunks per pipeline rank)")
    if p.schedule == "interleaved" and p.pipeline > 1 and p.virtual_stages < 2:
        raise ConfigError("parallel.schedule=interleaved needs parallel.virtual_stages ≥ 2 model chunks per "
                          "rank; with one chunk per rank use parallel.schedule=1f1b")
    if p.stage_layers and (len(p.stage_layers) != chunks or sum(p.stage_layers) != m.num_layers
                           or min(p.stage_layers) < 1):
        raise ConfigError(f"parallel.stage_layers={p.stage_layers} must list layers for each of parallel.pipeline × "
                          f"virtual_stages = {p.pipeline}×{p.virtual_stages} = {chunks} chunks (in chunk order), "
                          f"each at least 1, summing to model.num_layers={m.num_layers}")
    validate_context(cfg)
    validate_optimizer(cfg)
    if cfg.optim.offload_fraction > 0 and cfg.optim.implementation == "apex":
        raise ConfigError(f"optim.offload_fraction={cfg.optim.offload_fraction} steps host memory, which apex's "
                          f"GPU-only FusedAdam cannot; use optim.implementation=auto (torch's fused kernel)")
    dp = data_parallel_size(cfg, world_size)
    validate_data_parallel(p, dp * p.context)  # the groups they split are DP × CP
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size × "
            f"data-parallel size = {t.micro_batch_size}×{dp} = {per_step}; use a multiple of {per_step}")
    micro_batches = t.global_batch_size // per_step
    problem = ramp_problem(t, dp, p.pipeline if p.schedule == "interleaved" and p.pipeline > 1 else 1)
    if problem:
        raise ConfigError(problem)
    if t.micro_batch_size_after_switch:
        after = t.micro_batch_size_after_switch * dp
        if t.global_batch_size % after:
            raise ConfigError(
                f"train.micro_batch_size_after_switch={t.micro_batch_size_after_switch}: train.global_batch_size="
                f"{t.global_batch_size} must be divisible by it × data-parallel size {dp}; use a divisor of "
                f"{t.global_batch_size // dp}")
        if p.schedule == "interleaved" and p.pipeline > 1 and (t.global_batch_size // after) % p.pipeline:
            raise ConfigError(f"train.micro_batch_size_after_switch={t.micro_batch_size_after_switch} leaves "
                              f"{t.global_batch_size // after} micro-batches, not a multiple of parallel.pipeline="
                              f"{p.pipeline} as the interleaved schedule needs")
        if t.recompute_switch_step < 1:
            raise ConfigError("train.micro_batch_size_after_switch needs train.recompute_switch_step ≥ 1 "
                              "(the step at which the micro batch changes)")
    if (t.eval_tasks or t.diary_prompts) and not cfg.data.tokenizer:
        raise ConfigError("train.eval_tasks and train.diary_prompts need data.tokenizer (a tokenizer.json) to turn "
                          "text into tokens and back")
    if t.eval_tasks and t.eval_tasks_interval == 0:
        raise ConfigError("train.eval_tasks needs train.eval_tasks_interval > 0 (steps between task evaluations)")
    context = m.max_position_embeddings or m.seq_length
    if t.eval_window > context:
        raise ConfigError(f"train.eval_window={t.eval_window} is longer than the model's context ({context}: "
                          f"model.max_position_embeddings, else model.seq_length); set at most {context}, or 0 for "
                          f"model.seq_length")
    if t.eval_per_dataset and (t.eval_interval == 0 or cfg.data.mock):
        raise ConfigError("train.eval_per_dataset=true needs train.eval_interval > 0 and data.paths (not data.mock)")
    if p.schedule == "interleaved" and p.pipeline > 1 and micro_batches % p.pipeline:
        raise ConfigError(f"the interleaved schedule needs the number of micro-batches ({micro_batches} = "
                          f"global_batch_size / (micro_batch_size × dp)) to be a multiple of parallel.pipeline="
                          f"{p.pipeline}")
    d = cfg.data
    try:
        parse_split(d.split)
    except ValueError as exc:
        raise ConfigError(f"data.split: {exc}") from exc
    if (d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss) and d.eod_token_id < 0 and not d.tokenizer:
        raise ConfigError("data.reset_attention_mask / reset_position_ids / eod_mask_loss need the end-of-document "
                          "token: set data.tokenizer (its eos_token is used) or data.eod_token_id")
    if d.eod_token_id >= m.vocab_size:
        raise ConfigError(f"data.eod_token_id={d.eod_token_id} is outside model.vocab_size={m.vocab_size}")
    if d.reset_position_ids and m.position_embedding != "rope":
        raise ConfigError("data.reset_position_ids needs model.position_embedding=rope (ALiBi has no positions; "
                          "use data.reset_attention_mask to keep documents apart)")
    problem = stages_problem(d.stages, d.paths, d.mock, t.steps)
    if problem:
        raise ConfigError(problem)
    if not cfg.data.mock and not cfg.data.paths and not d.stages:
        raise ConfigError("data.paths is empty: give dataset prefixes made by tools/preprocess_data.py, "
                          "or set data.mock=true for synthetic tokens")
    problem = remote_data_problem(d)
    if problem:
        raise ConfigError(problem)
    r = cfg.run
    if r.attention_entropy_max and r.attention_entropy_max <= r.attention_entropy_min:
        raise ConfigError(f"run.attention_entropy_max={r.attention_entropy_max} must exceed "
                          f"run.attention_entropy_min={r.attention_entropy_min} (0 = no upper bound)")
    if r.profile_steps and (len(r.profile_steps) != 2 or not 1 <= r.profile_steps[0] <= r.profile_steps[1]):
        raise ConfigError(f"run.profile_steps={r.profile_steps} must be [first, last] steps to profile, "
                          f"1 ≤ first ≤ last (e.g. [10, 12]), or [] for none")
    if r.profile_steps and r.profile_steps[1] > t.steps:
        raise ConfigError(f"run.profile_steps={r.profile_steps} ends after the run's last step, train.steps="
                          f"{t.steps}: no trace would be written; profile steps within the run")
    if r.rollback_after > r.spike_window:
        raise ConfigError(f"run.rollback_after={r.rollback_after} bad steps can never fall within run.spike_window="
                          f"{r.spike_window} steps; lower it or widen the window (0 = never roll back)")
    for entry in cfg.checkpoint.mirrors:
        problem = mirror_problem(entry)
        if problem:
            raise ConfigError(f"checkpoint.mirrors entry {_show(entry)}: {problem}")
    if r.rollback_after and not (cfg.checkpoint.interval or cfg.checkpoint.interval_minutes):
        raise ConfigError(f"run.rollback_after={r.rollback_after} reloads a checkpoint, but none is saved; set "
                          f"checkpoint.interval (or checkpoint.interval_minutes), or run.rollback_after=0")


def remote_data_problem(d: DataConfig) -> str | None:
    """s3:// entries of data.paths (or a stage's paths) are read through the node-local cache (data/s3_shards.py)
    and must name a bucket and a dataset."""
    entries = [str(p) for p in ([d.paths] if isinstance(d.paths, str) else d.paths)]
    entries += [str(p) for stage in d.stages if isinstance(stage, dict) for p in stage.get("paths") or []]
    for entry in (e[e.index("s3://"):] for e in entries if "s3://" in e):
        bucket, _, key = entry[len("s3://"):].partition("/")
        if not bucket or not key.strip("/"):
            return f"data.paths entry {entry!r} names no bucket and dataset; write s3://BUCKET/DIR/NAME for the " \
                   f"objects DIR/NAME.idx and DIR/NAME.bin"
        if not d.local_cache_dir:
            return f"data.paths entry {entry!r} is read through the node-local cache; set data.local_cache_dir " \
                   f"to a local directory (e.g. /tmp/trilith-shards)"
    return None


def mirror_problem(entry: str) -> str | None:
    """What is wrong with a checkpoint.mirrors entry's form (engine/checkpoint/locations.py reads it)."""
    path, _, query = entry.partition("?")
    options = urllib.parse.parse_qs(query)
    if not path:
        return "it names no directory or s3:// URL"
    if path.startswith("s3://") and not path[len("s3://"):].split("/")[0]:
        return "it names no bucket; write s3://BUCKET/PREFIX"
    if "://" in path and not path.startswith("s3://"):
        return "only directories and s3://bucket/prefix URLs are locations"
    if (query and not options) or set(options) - {"keep", "keep_every"} or \
            not all(v[-1].isdigit() for v in options.values()):
        return "after '?' only keep=N and keep_every=M (whole numbers) are understood"
    if "keep" in options and int(options["keep"][-1]) < 1:
        return "keep=N must be at least 1"
    return None


def validate_optimizer(cfg: Config) -> None:
    """Muon's options, and what it cannot serve yet, refused by name."""
    o = cfg.optim
    if o.name != "muon":
        return
    if len(o.muon_ns_coefficients) != 3:
        raise ConfigError(f"optim.muon_ns_coefficients={o.muon_ns_coefficients} must be three numbers (a, b, c), "
                          f"e.g. [3.4445, -4.775, 2.0315]")
    if o.lr == 0:
        raise ConfigError("optim.lr=0.0 under optim.name=muon: Muon's learning rate follows optim.lr's schedule "
                          "(optim.muon_lr × lr / optim.lr); set optim.lr > 0")
    if o.offload_fraction > 0:
        raise ConfigError(f"optim.name=muon does not offload its state yet (optim.offload_fraction="
                          f"{o.offload_fraction}); set optim.offload_fraction=0 or optim.name=adamw")


def validate_context(cfg: Config) -> None:
    """Context parallelism: the sequence must split into 2c equal chunks (and alltoall's heads over c)."""
    m, p = cfg.model, cfg.parallel
    c = p.context
    if c == 1:
        return
    if m.seq_length % (2 * c):
        raise ConfigError(f"parallel.context={c} splits model.seq_length={m.seq_length} into 2×{c} = {2 * c} chunks; "
                          f"choose a sequence length divisible by {2 * c}")
    if p.sequence_parallel and m.seq_length % (c * p.tensor):
        raise ConfigError(f"parallel.context={c} with sequence parallelism splits each rank's {m.seq_length // c} "
                          f"tokens over parallel.tensor={p.tensor} ranks; choose model.seq_length divisible by "
                          f"{c * p.tensor}")
    if p.context_attention == "alltoall" and (m.num_attention_heads // p.tensor) % c:
        raise ConfigError(f"parallel.context_attention=alltoall scatters the {m.num_attention_heads // p.tensor} query "
                          f"heads per tensor-parallel rank over parallel.context={c} ranks; use a context size that "
                          f"divides them, or parallel.context_attention=allgather or ring")


def validate_data_parallel(p: ParallelConfig, dp: int) -> None:
    """`dp`: the ranks gradients are reduced over, data-parallel × context-parallel."""
    for key, k in (("hsdp_group_size", p.hsdp_group_size), ("hierarchical_node_size", p.hierarchical_node_size)):
        if k and dp % k:
            what = "data-parallel size" if p.context == 1 else "data-parallel × context-parallel size"
            raise ConfigError(f"parallel.{key}={k} must divide the {what} {dp} (0 turns it off)")
    if p.hsdp_group_size and p.zero_stage == 0:
        raise ConfigError(f"parallel.hsdp_group_size={p.hsdp_group_size} shards within groups, which needs "
                          f"parallel.zero_stage 1, 2 or 3 (got 0)")
    if p.hsdp_group_size and p.hierarchical_node_size:
        raise ConfigError("parallel.hsdp_group_size and parallel.hierarchical_node_size cannot both be set: "
                          "HSDP already reduces inside the group first; set one of them to 0")
    if p.unit_process_groups and (p.zero_stage == 0 or p.hsdp_group_size or p.hierarchical_node_size):
        raise ConfigError("parallel.unit_process_groups=true needs parallel.zero_stage 1, 2 or 3 with plain "
                          "(not hybrid or hierarchical) sharding; set hsdp_group_size=0 hierarchical_node_size=0")
