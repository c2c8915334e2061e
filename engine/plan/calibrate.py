"""Measurements for a device profile (engine/plan/profile.py), run on every rank of a process group at once, so
that ranks sharing a machine's cores (CPU runs) are measured as they will run.

- compute: one transformer layer (engine/model.py's, at this rank's TP-local widths) forward and backward, and
  the final norm + output layer + cross-entropy, at each shape asked for;
- the same layer and output layer as a layout runs them: built from parallel/'s layers on their own tensor- and
  context-parallel groups (the world cut into such groups, all busy at once), so that they include each
  collective between its compute slices, where ranks sharing cores, or a device's kernel queue, make it cost
  more than the same collective among ranks doing nothing else;
- the optimizer: one AdamW step (kernels/adamw.py's choice) per fp32 element;
- links: all-reduce, all-gather and reduce-scatter through parallel/comm.py at a few sizes over groups of 2, 4,
  ... ranks (the world cut into such groups, all busy at once), fit as latency per ring step + seconds per byte
  on the wire;
- the engine's own cost: whole training steps (engine/train.py:Trainer.train_step) of a tiny model, data
  parallel over every rank, with one and with four micro-batches: per step and per micro-batch.
"""
from __future__ import annotations

import ctypes
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

from engine.config.schema import Config, ModelConfig, load_config
from engine.memory_estimate import estimate
from engine.model import CausalLM
from engine.observe.host_memory import reuse_freed_memory
from engine.plan.time_model import head_flops, layer_flops, predict
from engine.train import Trainer
from engine.plan.volumes import STEPS, WIRE
from kernels.adamw import adamw
from parallel import comm
from parallel.context import ContextParallel
from parallel.distributed import DistEnv
from parallel.tensor import TensorParallel, padded_vocab_size

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def local_model_config(cfg: Config) -> ModelConfig:
    """The widths one TP rank computes with: heads, KV heads (when split) and FFN divided by TP."""
    m, t = cfg.model, cfg.parallel.tensor
    return ModelConfig(hidden_size=m.hidden_size, num_layers=1, num_attention_heads=m.num_attention_heads // t,
                       num_kv_heads=m.kv_heads // t if m.kv_heads >= t else 1, kv_channels=m.head_dim,
                       ffn_hidden_size=m.ffn_hidden_size // t, vocab_size=padded_vocab_size(m.vocab_size, t) // t,
                       seq_length=m.seq_length, rope_theta=m.rope_theta)


def timed(run, repeats: int, device: torch.device) -> float:
    """Median seconds of `run()` over `repeats` calls after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def filled(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """`model` on `device` in `dtype`, every weight drawn from normal(0, 0.02) on this rank alone: the values do
    not matter to the speed, but uninitialised memory may hold denormals, which slow a CPU's matrix products,
    and the engine's own initialisation (init_weights) builds each full, unsplit tensor first."""
    model.to(device, dtype)
    for p in model.parameters():
        p.normal_(0.0, 0.02)
    return model


def forward_backward(model, inputs, labels, device, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds of `model` on `inputs` (hidden states, so backward reaches the input)."""
    def forward():
        return model(inputs, labels) if labels is not None else model(inputs)

    def both():
        out = forward()
        (out if out.dim() == 0 else out.float().square().mean()).backward()
    fwd = timed(forward, repeats, device)
    return fwd, max(timed(both, repeats, device) - fwd, 1e-9)


def measure_calls(cfg: Config, model_cfg: ModelConfig, tp: TensorParallel, cp: ContextParallel,
                  device: torch.device, repeats: int) -> tuple[list, list]:
    """([forward FLOPs, forward s, backward s] of one layer, the same of the output layer) of `model_cfg`'s
    layer and output layer built on `tp` and `cp`, at `cfg`'s shape (parallel.tensor, train.micro_batch_size,
    parallel.context give the FLOPs and the local size)."""
    dtype = DTYPES[cfg.train.precision]
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length // cfg.parallel.context
    x = torch.randn(1, tokens // (tp.size if tp.sequence_parallel else 1), model_cfg.hidden_size, device=device,
                    dtype=dtype, requires_grad=True)
    layer = filled(CausalLM(model_cfg, tp, layer_ids=[0], pre_process=False, post_process=False, cp=cp), device, dtype)
    head = filled(CausalLM(model_cfg, tp, layer_ids=[], pre_process=False, post_process=True, cp=cp), device, dtype)
    labels = torch.randint(0, model_cfg.vocab_size, (1, tokens), device=device)
    layer_row = [layer_flops(cfg)[0], *forward_backward(layer, x, None, device, repeats)]
    head_row = [head_flops(cfg), *forward_backward(head, x, labels, device, repeats)]
    return layer_row, head_row


def measure_compute(cfg: Config, device: torch.device, repeats: int = 3) -> tuple[list, list]:
    """measure_calls of the plain layer and output layer at this rank's TP-local widths, without collectives."""
    return measure_calls(cfg, local_model_config(cfg), TensorParallel(), ContextParallel(), device, repeats)


def parallel_groups(cfg: Config, world_size: int, rank: int) -> tuple[TensorParallel, ContextParallel] | None:
    """This rank's TP and CP groups of `cfg`'s sizes (with its sequence parallelism and context-attention
    strategy), for measure_calls of the whole-width layer: the world cut into blocks of TP × CP ranks (TP
    neighbours adjacent, CP ones TP apart, as parallel/topology orders them); None on ranks left over. Every
    rank creates every group, as torch.distributed requires."""
    p = cfg.parallel
    block = p.tensor * p.context
    mine = None
    for start in range(0, world_size - world_size % block, block):
        tp_groups = {r: dist.new_group(list(range(r, r + p.tensor))) for r in range(start, start + block, p.tensor)}
        cp_ranks = {i: list(range(start + i, start + block, p.tensor)) for i in range(p.tensor)}
        cp_groups = {i: dist.new_group(ranks) for i, ranks in cp_ranks.items()}
        if start <= rank < start + block:
            i = (rank - start) % p.tensor
            tp = TensorParallel(tp_groups[rank - i], p.tensor, i, p.sequence_parallel and p.tensor > 1)
            cp = ContextParallel(cp_groups[i], p.context, (rank - start) // p.tensor, p.context_attention,
                                 tuple(cp_ranks[i]))
            mine = tp, cp
    return mine


def measure_optimizer(device: torch.device, elements: int = 1 << 22, repeats: int = 3) -> float:
    """Seconds of one AdamW step per fp32 master element."""
    weight = torch.zeros(elements, device=device, requires_grad=True)
    weight.grad = torch.randn(elements, device=device)
    opt = adamw([{"params": [weight], "weight_decay": 0.1}], lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    return timed(opt.step, repeats, device) / elements


HOST = torch.device("cpu")


def measure_host(device: torch.device, elements: int = 1 << 24, repeats: int = 3) -> dict:
    """The host side of optimizer offload (engine/plan/offload_cost.py), on one thread, as the profile's fields:
    bytes/s of the fp32 <-> 16-bit casts the host does (read + written bytes, the slower direction), fused AdamW
    elements/s, and on a GPU the pinned host <-> device copy rate (the slower direction); a CPU keeps the assumed
    PCIe rate."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        master, half = torch.randn(elements), torch.empty(elements, dtype=torch.bfloat16)
        cast = min(elements * 6 / timed(lambda: half.copy_(master), repeats, HOST),
                   elements * 6 / timed(lambda: master.copy_(half), repeats, HOST))
        weight = master.clone().requires_grad_(True)
        weight.grad = torch.randn(elements)
        opt = torch.optim.AdamW([weight], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
        out = {"host_memory_bytes_per_s": cast, "host_adamw_elements_per_s": elements / timed(opt.step, repeats, HOST),
               "host_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
               "host_measured": True}
    finally:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        pinned, on_device = half.pin_memory(), half.to(device)
        out["pcie_bytes_per_s"] = min(elements * 2 / timed(lambda: on_device.copy_(pinned, non_blocking=True),
                                                           repeats, device),
                                      elements * 2 / timed(lambda: pinned.copy_(on_device, non_blocking=True),
                                                           repeats, device))
    return out


def measure_links(world_size: int, rank: int, device: torch.device, sizes: tuple, repeats: int = 3) -> list:
    """[(ring steps, wire bytes per rank, seconds)] of each collective, size and group size (2, 4, ... up to the
    world)."""
    points = []
    n = 2
    while n <= world_size:
        groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world_size - world_size % n, n)]
        mine = groups[rank // n] if rank // n < len(groups) else None
        for nbytes in sizes:
            numel = nbytes // 4
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                if mine is None:
                    continue
                flat = torch.ones(numel - numel % n, device=device)
                shard = torch.ones(flat.numel() // n, device=device)
                run = {"all_reduce": lambda: comm.all_reduce(flat, mine),
                       "all_gather": lambda: comm.all_gather_into(flat, shard, mine),
                       "reduce_scatter": lambda: comm.reduce_scatter_into(shard, flat, mine)}[op]
                dist.barrier()
                points.append((STEPS[op](n), WIRE[op](n) * flat.numel() * 4, timed(run, repeats, device)))
        dist.barrier()
        n *= 2
    return points


def fit_link(points: list) -> dict:
    """Least squares of seconds = latency × ring steps + seconds per byte × wire bytes through (steps, wire bytes,
    seconds) points; a coefficient that comes out negative is 0 and the other refit alone."""
    def alone(col: int) -> float:
        return sum(p[col] * p[2] for p in points) / max(sum(p[col] ** 2 for p in points), 1e-30)
    ss = sum(p[0] ** 2 for p in points)
    sw = sum(p[0] * p[1] for p in points)
    ww = sum(p[1] ** 2 for p in points)
    st, wt = sum(p[0] * p[2] for p in points), sum(p[1] * p[2] for p in points)
    det = ss * ww - sw * sw
    latency, per_byte = ((st * ww - wt * sw) / det, (ss * wt - sw * st) / det) if det else (-1.0, -1.0)
    if latency < 0 or per_byte < 0:
        latency, per_byte = (0.0, alone(1)) if latency < 0 <= per_byte else (alone(0), 0.0)
    return {"latency_s": max(latency, 0.0), "seconds_per_byte": max(per_byte, 0.0)}


def memory_now(device: torch.device) -> int:
    """CUDA: the allocator's peak since the last reset; CPU: the resident set (glibc keeping freed memory)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def overhead_config(micro_batches: int, world_size: int, device_type: str, run_dir: str = "") -> Config:
    """A model too small to cost anything in its layers, data parallel over `world_size` ranks, with
    `micro_batches` micro-batches per rank."""
    return load_config(None, ["model.hidden_size=32", "model.num_layers=1", "model.num_attention_heads=2",
                              "model.ffn_hidden_size=64", "model.vocab_size=256", "model.seq_length=32",
                              "train.micro_batch_size=1", f"train.global_batch_size={micro_batches * world_size}",
                              "data.mock=true", f"train.device={device_type}", f"run.dir={run_dir}"])


OVERHEAD_MICRO_BATCHES = (1, 4)


def measure_overhead(rank: int, world_size: int, device: torch.device, run_dir: str) -> tuple[list, int]:
    """([step seconds with each of OVERHEAD_MICRO_BATCHES micro-batches], bytes beyond the memory estimate) of
    whole training steps of overhead_config's model."""
    times, extra = [], 0
    if device.type == "cpu":
        reuse_freed_memory()
    for micro_batches in OVERHEAD_MICRO_BATCHES:
        cfg = overhead_config(micro_batches, world_size, device.type, run_dir)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            ctypes.CDLL(None).malloc_trim(0)
        before = memory_now(device)
        trainer = Trainer(cfg, DistEnv(rank, world_size, device=device))
        try:
            trainer.train_step()
            times.append(statistics.median(trainer.train_step()["step_time_s"] for _ in range(3)))
            extra = max(extra, memory_now(device) - before - max(s.total for s in estimate(cfg, world_size)))
        finally:
            trainer.loader.close()
        del trainer
    return times, max(extra, 0)


def engine_overhead(profile, times: list, world_size: int, device_type: str) -> tuple[float, float]:
    """(seconds per step, per micro-batch) of the engine's own work: what the measured steps of
    overhead_config's model took beyond everything `profile` (without overheads yet) already predicts for them:
    its layers, collectives and optimizer."""
    residual = [t - predict(overhead_config(m, world_size, device_type), world_size, profile, world_size).total
                for m, t in zip(OVERHEAD_MICRO_BATCHES, times)]
    (m1, r1), (m2, r2) = zip(OVERHEAD_MICRO_BATCHES, residual)
    per_micro_batch = max((r2 - r1) / (m2 - m1), 0.0)
    return max(r1 - m1 * per_micro_batch, 0.0), per_micro_batch
