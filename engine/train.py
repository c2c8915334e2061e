"""The training loop: `python -m engine.train --config FILE [section.key=value ...]`.

Runs as one plain process, or as one rank of many when started by launch/run_pretrain.sh (or torchrun).
Global batch = micro batch × accumulation steps × data-parallel size; each step reads exactly one global
batch, accumulates over its micro-batches, synchronises gradients and takes one optimizer step.
"""
from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

from data.documents import document_ids, loss_mask, positions_within_documents
from data.eod import eod_id_from_tokenizer
from engine.batch_ramp import global_batch, lr_position, samples_after
from engine.checkpoint.checkpointer import Checkpointer
from engine.checkpoint.files import CheckpointError
from engine.checkpoint.hf_weights import fill_model_from_hf
from engine.checkpoint.light_snapshot import LightSnapshots
from engine.checkpoint.save_schedule import SaveSchedule
from engine.checkpoint.snapshot_recovery import recover
from engine.checkpoint.snapshot_writer import MemorySnapshots
from engine.config.schema import (Config, ConfigError, DataConfig, data_parallel_size, load_config, save_config,
                                  validate)
from engine.data_cache import localize_data
from engine.data_parallel import build_data_parallel
from engine.data_stages import DataStages
from engine.evaluate.tasks import InRunTasks
from engine.fault_inject import FaultInjector
from engine.evaluate.validation import evaluation_due, validation_loss
from engine.optim.lr_schedule import lr_at
from engine.mock_data import MockBatchLoader
from engine.model import CausalLM, num_parameters
from engine.observe import replica_check
from engine.observe.diary import Diary
from engine.observe.health import HealthMonitor
from engine.observe.host_memory import reuse_freed_memory
from engine.observe.metrics import H100_BF16_PEAK_FLOPS, MetricsLog, flops_per_token, peak_memory_gb
from engine.observe.monitor import NonFiniteTraining, TrainingMonitor
from engine.observe.profiling import StepProfiler
from engine.observe.replica_check import ReplicaMismatch
from engine.observe.rollback import LossGuard
from engine.observe.step_probes import StepProbes
from engine.observe.stragglers import StepTimer, work_of
from engine.observe.trackers import Trackers
from engine.recompute_switch import RecomputeSwitch
from engine.run_lock import hold_run_dir
from engine.stage_balance import chunk_layers
from engine.stop import StopControl, StopRun, exit_status, final_failure
from parallel import comm, heartbeat, nccl_semantics
from parallel.context import ContextParallel
from parallel.device import DeviceUnavailable
from parallel.distributed import DistEnv, describe_failure, exit_now, init_distributed, shutdown
from parallel.meta_values import host_values
from parallel.micro_batch import MicroBatch
from parallel.p2p import PipelineComm
from parallel.pipeline_schedules import forward_backward_no_pipeline, forward_backward_pipeline
from parallel.placement import describe_placement, placement_warnings
from parallel.random import seed_all
from parallel.stage_layers import chunk_roles, stage_layer_ids
from parallel.tensor import TensorParallel
from parallel.topology import Layout, Topology

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger("trilith")


def build_split_datasets(cfg: Config) -> dict | None:
    """The train/valid/test datasets of data.paths (None for synthetic data), long enough for train.steps
    and, when evaluating, for train.eval_iters global batches of validation."""
    if cfg.data.mock:
        return None
    if cfg.data.stages:  # every stage's blend end to end; validation of the first stage
        return DataStages(cfg).datasets(0)
    from data.loader import build_datasets
    t = cfg.train
    num_samples = {"train": samples_after(t, t.steps)}
    if t.eval_interval > 0:
        num_samples["valid"] = t.eval_iters * t.global_batch_size
    try:
        return build_datasets(cfg.data.paths, cfg.model.seq_length, t.seed, split=cfg.data.split,
                              num_samples=num_samples, cache_dir=cfg.data.cache_dir or None)
    except (OSError, ValueError) as exc:  # missing or malformed shards: the message names the file
        raise ConfigError(f"data.paths: {exc}") from exc


def build_dataset_validation_sets(cfg: Config) -> dict:
    """{dataset name: its own validation split} for each prefix of data.paths (train.eval_per_dataset): the
    same documents the blend validates on, measured per domain. The name is the prefix's file name."""
    from data.loader import build_datasets
    from data.paths import parse_paths
    t = cfg.train
    out = {}
    for _, prefix in parse_paths(cfg.data.paths):
        name = os.path.basename(prefix)
        name = name if name not in out else f"{name}#{len(out)}"
        try:
            valid = build_datasets([prefix], cfg.model.seq_length, t.seed, split=cfg.data.split,
                                   num_samples={"valid": t.eval_iters * t.global_batch_size},
                                   cache_dir=cfg.data.cache_dir or None)["valid"]
        except (OSError, ValueError) as exc:
            raise ConfigError(f"data.paths: {exc}") from exc
        if valid is None:
            raise ConfigError(f"train.eval_per_dataset: data.split={cfg.data.split!r} leaves no validation documents "
                              f"in {prefix}; give the valid split a larger share or set train.eval_per_dataset=false")
        out[name] = {"train": None, "valid": valid, "test": None}
    return out


def build_loader(cfg: Config, topo: Topology, consumed_samples: int, datasets: dict | None = None,
                 split: str = "train", micro_batch_size: int = 0):
    """This rank's loader of `split`, starting at global sample `consumed_samples`, in micro-batches of
    `micro_batch_size` (0: train.micro_batch_size; it changes at train.recompute_switch_step)."""
    t = cfg.train
    micro = micro_batch_size or t.micro_batch_size
    if cfg.data.mock:  # held-out synthetic samples: the same rule from other starting points (another seed)
        seed = t.seed if split == "train" else t.seed + 1
        return MockBatchLoader(cfg.model.vocab_size, cfg.model.seq_length, micro,
                               global_batch(t) if split == "train" else t.global_batch_size,
                               topo.dp_rank, topo.dp_size, consumed_samples, seed=seed)
    from data.loader import DistributedBatchLoader
    datasets = datasets or build_split_datasets(cfg)
    if datasets[split] is None:
        raise ConfigError(f"data.split={cfg.data.split!r} leaves no documents for the {split} split of data.paths; "
                          f"give it a share (e.g. \"98,2,0\")" + (" or set train.eval_interval=0"
                                                                  if split == "valid" else ""))
    return DistributedBatchLoader(datasets[split], micro,
                                  global_batch(t) if split == "train" else t.global_batch_size, topo.dp_rank,
                                  topo.dp_size, consumed_samples=consumed_samples, seed=t.seed,
                                  prefetch=2 if split == "train" else 0)


def resolve_eod_id(cfg: Config) -> int | None:
    """The end-of-document id when documents are treated separately (data.reset_* / eod_mask_loss), else None."""
    d = cfg.data
    if not (d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss):
        return None
    if d.eod_token_id >= 0:
        return d.eod_token_id
    try:
        return eod_id_from_tokenizer(d.tokenizer)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


def build_model_chunks(cfg: Config, topo: Topology, tp: TensorParallel,
                       cp: ContextParallel | None = None) -> list[CausalLM]:
    """This rank's model chunks: the whole model, one pipeline stage, or its v interleaved chunks."""
    if topo.pp_size == 1:
        return [CausalLM(cfg.model, tp, cp=cp)]
    v, v_shape = cfg.parallel.virtual_stages, cfg.parallel.schedule == "zbv"
    layer_ids = stage_layer_ids(cfg.model.num_layers, topo.pp_size, v, chunk_layers(cfg), v_shape)[topo.pp_rank]
    chunks = []
    for j in range(v):
        pre, post = chunk_roles(topo.pp_rank, topo.pp_size, v, j, v_shape)
        chunks.append(CausalLM(cfg.model, tp, layer_ids=layer_ids[j], pre_process=pre, post_process=post, cp=cp))
        chunks[-1].v_placement = v_shape  # read by forward_only_pipeline
    return chunks


def with_document_extras(tokens: torch.Tensor, eod_id: int | None, data: DataConfig,
                         context: ContextParallel | None = None) -> MicroBatch:
    """The token batch [b, s + 1] with the document extras that data.reset_* / eod_mask_loss ask for, cut
    into this rank's chunks by the model's forward under context parallelism (`context`)."""
    if eod_id is None:
        return MicroBatch(tokens, context=context)
    inputs = tokens[:, :-1]
    docs = document_ids(inputs, eod_id)
    return MicroBatch(tokens, segment_ids=docs if data.reset_attention_mask else None,
                      position_ids=positions_within_documents(docs) if data.reset_position_ids else None,
                      loss_mask=loss_mask(inputs, eod_id) if data.eod_mask_loss else None, context=context)


def check_token_ids(micro_batches: list, vocab_size: int) -> None:
    """On the loader's host tensors, before the copy: read on the device, each bound would stall the host
    until the copy lands (.numpy() refuses a device tensor, so this cannot regress unseen)."""
    largest = max(int(mb.numpy().max()) for mb in micro_batches)
    if largest >= vocab_size:
        raise ConfigError(f"the data holds token id {largest} but model.vocab_size={vocab_size}; "
                          f"set model.vocab_size to at least the tokenizer's vocabulary ({largest + 1}+)")
    smallest = min(int(mb.numpy().min()) for mb in micro_batches)
    if smallest < 0:  # a signed shard dtype can hold them; the embedding would read out of bounds
        raise ConfigError(f"the data holds token id {smallest}; token ids are never negative, so a shard in "
                          f"data.paths is damaged: regenerate it with tools/preprocess_data.py")


def gather_losses(micro_losses: torch.Tensor, topo: Topology) -> tuple[torch.Tensor, object]:
    """[dp, m]: every data-parallel rank's micro-batch losses, so that a non-finite loss is traced to its rank
    and samples (one small all-reduce, as for the mean alone), and the all-reduce's handle (None when there
    is nothing to wait for), to be waited for after the optimizer step, which it overlaps."""
    out = torch.zeros(topo.dp_size, len(micro_losses), device=micro_losses.device)
    out[topo.dp_rank] = micro_losses
    return out, comm.all_reduce(out, topo.dp_group, async_op=True)


def step_record(trainer: Trainer, losses_by_rank: torch.Tensor, lr: float, grad_norm: float, skipped: bool,
                elapsed: float, data_wait: float) -> dict:
    """The step's loss, optimizer and throughput readings."""
    loader, seq, device = trainer.loader, trainer.cfg.model.seq_length, trainer.env.device
    tokens = loader.global_batch_size * seq  # this step's (train.batch_size_ramp)
    record = {"step": trainer.step, "loss": losses_by_rank.mean().item(), "lr": lr, "grad_norm": grad_norm,
              "skipped": skipped, "loss_scale": trainer.optimizer.scaler.scale, "tokens_per_s": tokens / elapsed,
              "consumed_samples": loader.consumed_samples, "global_batch_size": loader.global_batch_size,
              "consumed_tokens": loader.consumed_samples * seq, "step_time_s": elapsed, "data_wait_s": data_wait,
              "peak_memory_gb": peak_memory_gb(device)}
    if device.type == "cuda":
        record["mfu"] = tokens * trainer.flops_per_token / elapsed / (H100_BF16_PEAK_FLOPS * trainer.env.world_size)
    return record


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv):
        fill_model_from_hf(cfg)  # checkpoint.load names a Hugging Face directory: its architecture
        self.cfg, self.env = cfg, env
        p = cfg.parallel
        self.topo = Topology(Layout.for_world(env.world_size, p.tensor, p.pipeline, p.rank_order, p.context),
                             env.rank)
        seed_all(cfg.train.seed, self.topo.tp_rank, self.topo.pp_rank, self.topo.cp_rank)
        self.tp = TensorParallel.from_topology(self.topo, p.sequence_parallel)
        self.cp = ContextParallel.from_topology(self.topo, p.context_attention)
        self.dtype = DTYPES[cfg.train.precision]
        self.chunks = build_model_chunks(cfg, self.topo, self.tp, self.cp)
        for chunk in self.chunks:
            chunk.init_weights(cfg.train.seed)
            chunk.to(device=env.device, dtype=self.dtype)
            if cfg.train.compile:
                chunk.compile_blocks()
        self.named_params = [(n, prm) for c in self.chunks for n, prm in c.named_parameters()]
        # zero_stage 0: bucketed DDP + replicated AdamW; 1-3: sharded units + sharded AdamW
        self.data_parallel, self.optimizer = build_data_parallel(cfg, self.topo, self.tp, self.chunks,
                                                                 self.named_params, self.dtype)
        # Resume (own run.dir/checkpoints/latest, else checkpoint.load) before the loader: it starts at the
        # restored global data position.
        self.checkpointer = Checkpointer(cfg, self.topo, self.named_params, self.optimizer)
        self.faults = FaultInjector(cfg.run.inject_fault, env.rank, cfg.run.dir)  # test-only
        # checkpoint.memory_interval: snapshots in node-local shared memory and a partner's; a restart resumes from
        # the newest complete one when it is newer than the disk checkpoint (engine/checkpoint/snapshot_recovery.py)
        self.memory = MemorySnapshots(self.checkpointer, self.faults) if cfg.checkpoint.memory_interval > 0 else None
        resumed = recover(self.checkpointer, self.memory)
        self.step = resumed["step"] if resumed else 0
        heartbeat.set_step(self.step)
        self.recompute_switch = RecomputeSwitch.of(cfg.train)
        self.micro_batch_size = cfg.train.micro_batch_size
        cfg, self.local_cache = localize_data(cfg, env)  # data.local_cache_dir: read this node's copy of the shards
        self.cfg = cfg
        self.stages = DataStages(cfg) if cfg.data.stages else None  # data.stages: one blend per stage
        self.datasets = self.stages.datasets(self.step) if self.stages else build_split_datasets(cfg)
        if cfg.train.eval_interval > 0:  # a missing validation split fails now, not at the first evaluation
            build_loader(cfg, self.topo, 0, self.datasets, split="valid")
        self.validation_sets = (self.stages.validation_sets(self.step) if self.stages else
                                build_dataset_validation_sets(cfg) if cfg.train.eval_per_dataset else {})
        self.loader = build_loader(cfg, self.topo, resumed["consumed_samples"] if resumed else 0, self.datasets)
        self.pipe = PipelineComm.for_model(self.topo, cfg.model, cfg.train.micro_batch_size, p.sequence_parallel,
                                           self.dtype, env.device) if self.topo.pp_size > 1 else None
        self.schedule_trace = None  # a parallel.pipeline_schedules.ScheduleTrace to record the schedule
        self.eod_id = resolve_eod_id(cfg)
        self.micro_batch = functools.partial(with_document_extras, eod_id=self.eod_id, data=cfg.data,
                                             context=self.cp if self.cp.size > 1 else None)
        self.monitor = TrainingMonitor(cfg, Path(cfg.run.dir), env.rank, self.topo.dp_size, log.warning)
        self.probes = StepProbes(self.monitor, self.chunks, cfg.model.num_layers, self.topo.tp_rank, env.device,
                                 self.micro_batch)
        self.profiler = StepProfiler(cfg.run, env.rank, env.device, log.info)  # run.profile_steps
        self.step_timer = StepTimer(cfg.run, env.rank, env.world_size, env.device, env.nodes,
                                    log.warning, work_of(self.chunks))  # run.timing_interval: stragglers
        self.tasks = InRunTasks(cfg, self.topo, self.chunks, self.dtype, env.device)  # train.eval_tasks
        self.diary = Diary(cfg, env.rank, self.dtype)  # train.diary_prompts, at each save, on rank 0's CPU
        self.light_snapshots = LightSnapshots(self.checkpointer)  # checkpoint.light_interval
        self.saves = SaveSchedule(cfg.checkpoint, cfg.train.steps, self.checkpointer, self.light_snapshots,
                                  self.diary, env.device)
        self.loss_guard = LossGuard(cfg, Path(cfg.run.dir), env.rank, log.warning, resumed)
        self.checkpointer.extra_metadata = self.loss_guard.metadata
        self.flops_per_token = flops_per_token(num_parameters(cfg.model), cfg.model.num_layers,
                                               cfg.model.hidden_size, cfg.model.seq_length)
        self.check_replicas()  # the seed (or the checkpoint just loaded) gave every copy the same values

    def check_replicas(self) -> None:
        """Stop every rank if a replicated parameter's bits differ between the ranks that hold it."""
        if self.env.world_size > 1:
            self.optimizer.wait_writes()  # offloaded parameters' write-backs may still be in flight
            sets = replica_check.replica_sets(self.named_params, self.data_parallel, self.topo,
                                              self.cfg.parallel.zero_stage)
            replica_check.check_replicas(sets, self.step, self.env.rank, self.env.device)

    @property
    def consumed_samples(self) -> int:
        return self.loader.consumed_samples

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        """Gradients of the step's mean loss; returns each micro-batch's loss [m] (on every pipeline stage).
        `micro_batches`: this rank's share of the global batch, as MicroBatches or token tensors [b, s + 1]."""
        for chunk in self.chunks:
            chunk.train()
        micro_batches = [mb if isinstance(mb, MicroBatch) else self.micro_batch(mb) for mb in micro_batches]
        if self.pipe is None:
            return forward_backward_no_pipeline(self.chunks[0], micro_batches, self.optimizer.scaler.scale)
        # tied embedding gradients are summed over the embedding group by data_parallel.finish_gradients()
        return forward_backward_pipeline(self.cfg.parallel.schedule, self.chunks, micro_batches, self.pipe,
                                         self.optimizer.scaler.scale, self.schedule_trace,
                                         self.cfg.parallel.defer_weight_grads)

    def evaluate(self, datasets: dict | None = None) -> float:
        """Validation loss on the run's validation split, or on that of `datasets` (engine/evaluate/validation.py)."""
        loader = build_loader(self.cfg, self.topo, 0, datasets or self.datasets, split="valid",
                              micro_batch_size=self.micro_batch_size)
        return validation_loss(self.chunks, self.pipe, loader, self.cfg.train.eval_iters, self.micro_batch, self.topo,
                               self.env.device)

    def train_step(self) -> dict:
        """One optimizer step on the next global batch: read it, forward and backward, reduce the gradients,
        clip and step, record. Returns the step's record for metrics.jsonl."""
        self.profiler.step_begins(self.step + 1)
        self.step_timer.step_begins(self.step + 1)
        start, window_start = time.perf_counter(), self.consumed_samples

        micro_batches, data_wait = self.next_micro_batches()
        lr = lr_at(*lr_position(self.cfg.train, self.step, self.consumed_samples), self.cfg.optim)
        self.optimizer.begin_step(lr)  # offloaded optimizer steps may start during backward
        self.data_parallel.start_step(len(micro_batches))  # gradients are reduced on the last micro-batch
        micro_losses = self.forward_backward(micro_batches)
        self.data_parallel.finish_gradients()
        self.probes.gradients(self.step + 1, self.data_parallel)  # before the optimizer consumes them
        losses_by_rank, summing = gather_losses(micro_losses, self.topo)  # overlaps the optimizer step
        with self.step_timer.optimizer():
            grad_norm, skipped = self.optimizer.step(lr)
            self.optimizer.zero_grad()
        if summing is not None:
            summing.wait()
        losses_by_rank = host_values(losses_by_rank)  # read by the record and the monitors below
        self.step += 1
        elapsed = time.perf_counter() - start

        heartbeat.set_step(self.step)
        record = step_record(self, losses_by_rank, lr, grad_norm, skipped, elapsed, data_wait)
        record.update(self.optimizer.offload_readings())
        record.update(self.probes.readings(self.step, record, losses_by_rank, window_start, self.micro_batch_size,
                                           self.describe_sample, micro_batches[0].tokens, self.pipe))
        record.update(self.loss_guard.observe(self.step, record["loss"], "nonfinite_samples" in record,
                                              losses_by_rank, window_start, self.micro_batch_size,
                                              self.describe_sample))
        record.update(self.step_timer.step_ends(self.step, elapsed, data_wait))
        self.profiler.step_ends(self.step)
        nccl_semantics.assert_drained(f"step {self.step}")
        return record

    def next_micro_batches(self) -> tuple[list, float]:
        """This rank's micro-batches of the next global batch, checked and given their document extras on the
        host, then copied to the device; and the seconds training waited for them (the loader prefetches).
        From train.recompute_switch_step on, the recompute mode and micro-batch size
        switch: same global batch and data order, fewer and larger micro-batches, so the gradient is unchanged."""
        mode, micro = self.recompute_switch.at(self.step + 1)
        for chunk in self.chunks:
            chunk.set_recompute(mode)
        if micro != self.micro_batch_size:
            self.micro_batch_size = micro
            self.loader.close()  # its prefetch thread would otherwise keep running, holding batches
            self.loader = build_loader(self.cfg, self.topo, self.consumed_samples, self.datasets,
                                       micro_batch_size=micro)
            if self.pipe is not None:  # the stages exchange activations of the new micro-batch shape
                self.pipe = PipelineComm.for_model(self.topo, self.cfg.model, micro,
                                                   self.cfg.parallel.sequence_parallel, self.dtype, self.env.device)
        start = time.perf_counter()
        with comm.named_range("data wait"):
            host = self.loader.next_global_batch()
        waited = time.perf_counter() - start
        check_token_ids(host, self.cfg.model.vocab_size)
        return [self.micro_batch(tokens).to(self.env.device) for tokens in host], waited

    def describe_sample(self, index: int) -> dict:
        """Global training sample `index`: its tokens and, for real data, where each piece comes from."""
        if self.datasets is None:
            return {"sample": index, "tokens": self.loader.sample(index).tolist()}
        from data.loader import sample_provenance
        dataset = self.datasets["train"]
        return {"sample": index, "tokens": dataset[index % len(dataset)].tolist(),
                "pieces": sample_provenance(dataset, index)}

    def roll_back(self) -> dict:
        """Reload the newest checkpoint before the first bad step; the loader goes on where it stands, so the
        samples read since are skipped (engine/observe/rollback.py). Returns the event for metrics.jsonl."""
        self.checkpointer.wait()
        path = self.loss_guard.target(self.checkpointer)
        meta = self.checkpointer.load(path)
        event = self.loss_guard.rolled_back(self.step, meta, path, self.consumed_samples)
        self.step = meta["step"]
        heartbeat.set_step(self.step)
        self.checkpointer.extra_metadata = self.loss_guard.metadata
        self.save_checkpoint()  # the same step again, now recording where the data goes on
        return event

    def save_checkpoint(self) -> Path:
        """Save the full training state now (blocks only for the snapshot under checkpoint.async_save)."""
        return self.saves.save(self.step, self.consumed_samples)

    def train(self, metrics: MetricsLog, control: StopControl | None = None) -> list[dict]:
        history = []
        try:
            gpu, stop = control.check(self.step) if control else (None, 0)
            while self.step < self.cfg.train.steps and not stop:
                record = self.train_step()
                if self.local_cache:  # once per start: how long this node took to copy (or verify) the shards
                    record["local_cache"], self.local_cache = self.local_cache, {}
                if self.loss_guard.rollback_due:
                    record["rollback"] = self.roll_back()
                    history.append(record)
                    metrics.write(record)
                    continue
                interval = self.cfg.run.replica_check_interval
                if interval and self.step % interval == 0:
                    self.check_replicas()
                evaluated = evaluation_due(self.step, self.cfg.train)
                if evaluated:
                    if self.stages:  # validation follows the stage that trained this step
                        self.datasets, self.validation_sets = (self.stages.datasets(self.step),
                                                               self.stages.validation_sets(self.step))
                    record["eval_loss"] = self.evaluate()
                    record["eval_ppl"] = math.exp(min(record["eval_loss"], 100.0))
                    if self.validation_sets:
                        record["eval_loss_by_dataset"] = {name: self.evaluate(sets)
                                                          for name, sets in self.validation_sets.items()}
                if self.tasks.due(self.step):
                    record.update(self.tasks.evaluate())
                    evaluated = True
                gpu, stop = control.check(self.step) if control else (None, 0)
                if gpu is not None:
                    record["gpu"] = gpu
                copies = self.checkpointer.uploader and self.checkpointer.uploader.changed_status()
                if copies:  # checkpoint.mirrors: what each location holds, when that changed
                    record["checkpoint_copies"] = copies
                history.append(record)
                if self.memory is not None:
                    self.memory.progress(self.step)
                if (self.step % self.cfg.train.log_interval == 0 or self.step == self.cfg.train.steps or stop
                        or evaluated or "local_cache" in record or "rank_times" in record
                        or "checkpoint_copies" in record):
                    metrics.write(record)
                self.faults.step_ends(self.step, self.memory)
                if stop:  # preemption or GPU health: save now, whatever the interval says
                    self.save_checkpoint()
                elif self.saves.after_step(self.step, self.consumed_samples):
                    log.info(f"checkpoint.exit_after={self.cfg.checkpoint.exit_after}: stopping after step "
                             f"{self.step}")
                    break
                if self.memory is not None and self.memory.due(self.step):
                    self.memory.save(self.step, self.consumed_samples)
                    self.faults.after_snapshot(self.step, self.memory)
            self.checkpointer.wait()
            if self.memory is not None:
                self.memory.wait()
            self.diary.wait()  # the background generation of the last save's diary entries
        except (ConfigError, NonFiniteTraining, ReplicaMismatch):  # every rank stops, for the reason it prints
            raise
        except Exception as exc:
            if self.env.world_size > 1:  # a dead or hung peer: say who we are and where we waited
                print(describe_failure(exc, self.env, self.step), file=sys.stderr, flush=True)
                print(f"trilith: rank {self.env.rank}: {heartbeat.peer_report(self.env.world_size, self.env.rank)}",
                      file=sys.stderr, flush=True)
            raise
        if stop:
            control.barrier()
            log.info(control.message(stop, self.step))
            raise StopRun(stop, control.message(stop, self.step), control.unhealthy_nodes)
        return history


def setup_run_dir(cfg: Config, rank: int) -> Path:
    run_dir = Path(cfg.run.dir)
    if rank == 0:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    return run_dir


def configure_logging(run_dir: Path, rank: int) -> None:
    handlers: list[logging.Handler] = []
    if rank == 0:
        handlers = [logging.StreamHandler(sys.stdout), logging.FileHandler(run_dir / "logs" / "train.log")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", handlers=handlers or
                        [logging.NullHandler()], force=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Trilith pretraining", prog="python -m engine.train")
    parser.add_argument("--config", required=True, help="YAML run configuration")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. optim.lr=3e-4")
    return parser.parse_args(argv)


def run(cfg: Config, env: DistEnv) -> list[dict]:
    fill_model_from_hf(cfg)
    validate(cfg, env.world_size)
    run_dir = setup_run_dir(cfg, env.rank)
    configure_logging(run_dir, env.rank)
    dp = data_parallel_size(cfg, env.world_size)
    context = f" × CP {cfg.parallel.context}" if cfg.parallel.context > 1 else ""  # named only when in use
    log.info(f"Trilith: {env.world_size} ranks = TP {cfg.parallel.tensor}{context} × PP {cfg.parallel.pipeline} × "
             f"DP {dp} on {env.device} ({env.backend}{'; ' + env.device_note if env.device_note else ''}); model "
             f"{num_parameters(cfg.model) / 1e6:.2f}M parameters")
    if env.world_size > 1 and env.nodes:
        log.info(f"placement: {describe_placement(list(env.nodes))}")
        p = cfg.parallel
        block_key = "parallel.hsdp_group_size" if p.hsdp_group_size else "parallel.hierarchical_node_size"
        layout = Layout(tp=p.tensor, pp=p.pipeline, dp=dp, order=p.rank_order, cp=p.context)
        for warning in placement_warnings(layout, list(env.nodes), p.hsdp_group_size or p.hierarchical_node_size,
                                          block_key):
            log.warning(f"WARNING: {warning}")
    if cfg.parallel.pipeline > 1:
        log.info(f"pipeline: layers per chunk {chunk_layers(cfg)} (parallel."
                 f"{'stage_layers' if cfg.parallel.stage_layers else 'stage_balance=' + cfg.parallel.stage_balance})")
    if env.device.type == "cpu" and cfg.train.cpu_allocator == "reuse":
        log.info(reuse_freed_memory())
    trainer = Trainer(cfg, env)
    metrics = MetricsLog(run_dir, enabled=env.rank == 0, console=log.info,
                         trackers=Trackers(cfg, run_dir, trainer.step, env.rank == 0, log.warning))
    control = StopControl(env, HealthMonitor(cfg.run, run_dir, console=log.info) if env.local_rank == 0 else None)
    try:
        return trainer.train(metrics, control)
    finally:
        trainer.checkpointer.wait()  # also on errors: never exit with a background save half-written
        if trainer.memory is not None:
            trainer.memory.settle()
        # A prefetch thread still reading when the interpreter exits (after a configuration error found in
        # the first batch, say) aborted the process ("terminate called without an active exception").
        trainer.loader.close()
        copies = trainer.checkpointer.finish_uploads()  # checkpoint.upload_wait_s for copies still in flight
        if trainer.checkpointer.uploader:
            metrics.event({"step": trainer.step, "checkpoint_copies": trainer.checkpointer.uploader.status()})
        metrics.close()
        control.restore()
        if copies:
            log.info(copies)  # the run's last line: where its final checkpoint is


def main(argv=None) -> int:
    args = parse_args(argv)
    clean = False
    try:
        cfg = load_config(args.config, args.overrides)
        env = init_distributed(cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_minutes)
        with hold_run_dir(cfg.run.dir, env):  # one training per run.dir (engine/run_lock.py)
            run(cfg, env)
        clean = True
    except (ConfigError, DeviceUnavailable) as exc:
        print(f"trilith: configuration error: {exc}", file=sys.stderr)
        return final_failure(2)
    except CheckpointError as exc:  # names the file and the fix; nothing was overwritten
        print(f"trilith: checkpoint error: {exc}", file=sys.stderr)
        return final_failure(1)
    except NonFiniteTraining as exc:
        print(f"trilith: stopped: {exc}", file=sys.stderr)
        return final_failure(1)
    except ReplicaMismatch as exc:
        print(f"trilith: replicas differ: {exc}", file=sys.stderr)
        clean = True  # every rank stopped here after the same all-reduce: leave the process group together
        return final_failure(1)
    except StopRun as stop:  # preemption or GPU health: checkpointed, exit code tells the launcher why
        clean = True
        return exit_status(stop.code, stop.unhealthy_nodes)
    finally:
        shutdown(clean)
    return 0


if __name__ == "__main__":
    exit_now(main())
