"""One rank of a large job, simulated in this process: torch.distributed on the fake backend at the real world
size and rank (every collective returns at once, moving nothing), the Trainer built as the run builds it (the
topology and every process group, the model chunks, data parallelism and optimizer) with its tensors on the
meta device, and one training step, every collective of both recorded (parallel/comm.py).

What the simulation changes in the configuration (`dry_config`), none of it a collective: synthetic tokens
(data.mock; the shards and tokenizer are the cluster's), no torch.compile (it would trace meta tensors, and
compiles the same collectives), no checkpoint to resume (checkpoint.load: the shapes come from model.*), no
evaluation. Where the step reads a value back on the host, parallel/meta_values.py stands in for it.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from engine.config.schema import Config, validate
from engine.dry_run.fast_meta import FastMeta
from engine.dry_run.memory import held_bytes
from engine.train import Trainer
from parallel import comm
from parallel.distributed import DistEnv

BACKEND = "cpu:fake,meta:fake"  # the fake backend for the host's small tensors and for the meta device


def dry_config(cfg: Config, world_size: int) -> Config:
    """`cfg` as the simulation runs it (module docstring), validated for `world_size`."""
    d, t = cfg.data, cfg.train
    documents = d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss
    data = dataclasses.replace(d, mock=True, paths=[], stages=[], local_cache_dir="",
                               eod_token_id=d.eod_token_id if d.eod_token_id >= 0 or not documents else 0)
    train = dataclasses.replace(t, compile=False, eval_interval=0, eval_per_dataset=False, eval_tasks=[],
                                diary_prompts=[])
    out = dataclasses.replace(cfg, data=data, train=train, checkpoint=dataclasses.replace(cfg.checkpoint, load=""),
                              run=dataclasses.replace(cfg.run, dir=f"{cfg.run.dir}/dry_run"))
    validate(out, world_size)
    return out


def warm_up() -> None:
    """What the first meta initialisation imports (its normal_ reaches torch._dynamo: seconds), done once in
    the process that forks the ranks instead of once in each."""
    torch.empty(1, device="meta").normal_()


def communicators() -> int:
    """Process groups this rank belongs to (each an NCCL communicator on a GPU), the world's included."""
    return len(dist.distributed_c10d._world.pg_map)


def event_row(e: comm.CommEvent) -> tuple:
    return (e.op, e.ranks, e.dtype, e.count, e.shape, e.peer, e.batch, e.group)


def simulate(cfg: Config, world_size: int, rank: int) -> dict:
    """Build rank `rank` of `world_size` and run its first training step; its record (engine/dry_run/report.py
    reads it). `cfg` is a dry_config. Call in a fresh process: the fake process group is this process's."""
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    comm.register_group(dist.group.WORLD, "world")
    env = DistEnv(rank, world_size, device=torch.device("meta"), backend="fake")
    start = time.perf_counter()
    with comm.RECORD.capture() as events:
        with torch.device("meta"):  # factories without a device (the model's parameters) allocate nothing
            trainer = Trainer(cfg, env)
        built = time.perf_counter() - start
        setup = len(events)
        measured = {}
        zero_grad = trainer.optimizer.zero_grad

        def measure_then_zero():  # the gradients as the optimizer took them, its state after its first step
            measured.update(held_bytes(trainer))
            zero_grad()
        trainer.optimizer.zero_grad = measure_then_zero
        with FastMeta():
            trainer.train_step()
    topo = trainer.topo
    return {"rank": rank, "coords": {"tp": topo.tp_rank, "cp": topo.cp_rank, "pp": topo.pp_rank, "dp": topo.dp_rank},
            "events": [event_row(e) for e in events], "setup_events": setup, "memory": measured,
            "communicators": communicators(), "build_s": built, "step_s": time.perf_counter() - start - built}
