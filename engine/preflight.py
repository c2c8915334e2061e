"""Pre-flight: the run's own configuration, scaled down, for ~100 steps before the big run.

    launch/run_pretrain.sh --preflight [--nproc N | sbatch/srun/mpirun as usual] --config FILE [overrides]

Same launcher, parallel layout, precision, optimizer, schedule shape and data (a slice of it: the first
steps × global-batch samples) as the real run; only the model is shrunk (head dimension 16, the fewest
layers and heads the layout allows) and the step count cut. Run on fewer ranks than the real run (a 64-GPU
recipe with --nproc 8), settings sized for its world are scaled to the pre-flight's or turned off, each
with a line saying so (scale_to_world). Checks, reported as PASS/FAIL lines on rank 0:
finite loss and gradient norm, gradient norm neither vanishing nor exploding relative to the first step,
loss falling, memory (max over ranks) not growing from the early steps to the last ones, and a
checkpoint.load that is a readable, verified checkpoint (the shrunk model never loads it). A run that
switches recomputation and micro batch mid-run (`train.recompute_switch_step`) switches half-way through
the pre-flight, and memory is judged after the switch: that is the setting most of the run uses. Exit
status 0 when every check passes, 1 otherwise (2 for configuration errors, like training). Before any step, an
`optim.offload_fraction` whose host state (engine/memory_estimate.py, at the pre-flight's world size: no less
than the real run's per rank when that has more data-parallel ranks) would not fit the smallest node's memory
is refused as a configuration error, in one line naming the fraction that fits.
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.hf_weights import fill_model_from_hf
from engine.checkpoint.load_check import check_load
from engine.config.schema import Config, ConfigError, data_parallel_size, load_config, validate
from engine.memory_estimate import ddp_offload_warning, device_memory, host_problem, node_memory, report
from engine.observe.rank_sniff import sniff
from engine.plan.offload_pays import offload_warning
from engine.plan.planner import warning as layout_warning
from engine.plan.profile import default_profile, load_profile
from engine.stop import final_failure
from engine.train import Trainer, configure_logging, log, setup_run_dir
from parallel import comm
from parallel.device import DeviceUnavailable
from parallel.distributed import DistEnv, exit_now, init_distributed, shutdown, world_group

STEPS = 100
VANISHING_RATIO = 1e-3  # gradient norm below this fraction of the first step's
EXPLODING_RATIO = 100.0  # ... or above this multiple of it
MEMORY_SLACK_MB, MEMORY_SLACK_FRACTION = 32.0, 0.10  # allowed growth from the early to the late steps


def scale_to_world(cfg: Config, world_size: int) -> list[str]:
    """Scale in place the settings sized for the real run's world to the one of `world_size` ranks, or turn
    them off: the context-parallel size when TP × CP × PP outgrows the world, the global batch (a few
    micro-batches per rank, as the pre-flight's slice of data), the groups of data-parallel ranks, the batch
    ramp. One line for each setting changed that the user set."""
    p, t, notes = cfg.parallel, cfg.train, []
    room = world_size // (p.tensor * p.pipeline)  # ranks per TP × PP slot, for CP × DP
    if world_size % (p.tensor * p.pipeline) == 0 and room % p.context:
        # CP only divides activations (weights and their gradients are whole on every CP rank), so a smaller
        # one checks the same code on fewer ranks; TP and PP change the model's split and stay as they are
        scaled = math.gcd(p.context, room)
        notes.append(f"parallel.context={p.context} → {scaled}: the pre-flight's {world_size} ranks hold TP "
                     f"{p.tensor} × PP {p.pipeline} × CP {scaled} at most")
        p.context = scaled
    dp = data_parallel_size(cfg, world_size)
    for key in ("hierarchical_node_size", "hsdp_group_size"):
        size = getattr(p, key)
        if size and (dp * p.context) % size:  # the groups split DP × CP
            scaled = math.gcd(size, dp * p.context)  # the largest group that divides both: the same blocks, fewer ranks
            scaled = scaled if scaled > 1 else 0
            setattr(p, key, scaled)
            notes.append(f"parallel.{key}={size} → {scaled or '0 (off)'}: the pre-flight's data-parallel "
                         f"{'× context-parallel ' if p.context > 1 else ''}size is {dp * p.context}")
    real_batch = t.global_batch_size
    micro = math.lcm(t.micro_batch_size, t.micro_batch_size_after_switch or 1)
    t.global_batch_size = micro * dp * (p.pipeline if p.pipeline > 1 else 2)
    if t.batch_size_ramp:
        notes.append(f"train.batch_size_ramp={t.batch_size_ramp} → off: it ramps to the real run's global batch "
                     f"of {real_batch}, the pre-flight's is {t.global_batch_size}")
        t.batch_size_ramp = []
    return notes


def preflight_config(cfg: Config, world_size: int, steps: int) -> tuple[Config, Config, list[str]]:
    """The real run's configuration with its world-sized settings scaled to `world_size` ranks
    (scale_to_world), the shrunk one the pre-flight trains, both validated at that world size, and the lines
    saying what scale_to_world changed."""
    real = copy.deepcopy(cfg)
    notes = scale_to_world(real, world_size)
    validate(real, world_size)
    small = shrink(cfg, world_size, steps)
    validate(small, world_size)
    return real, small, notes


def shrink(cfg: Config, world_size: int, steps: int) -> Config:
    """The run's config with a tiny model of the same family and layout, trained for `steps` steps on
    `world_size` ranks."""
    small = copy.deepcopy(cfg)
    m, p, t = small.model, small.parallel, small.train
    t.micro_batch_size = min(t.micro_batch_size, 4)
    t.micro_batch_size_after_switch = min(t.micro_batch_size_after_switch, 4)
    scale_to_world(small, world_size)  # first: it may lower parallel.context, which heads and sequence follow
    per_rank = max(1, 4 // p.tensor)  # query heads per TP rank; alltoall scatters them over CP
    heads = p.tensor * (math.lcm(per_rank, p.context) if p.context_attention == "alltoall" else per_rank)
    kv = math.gcd(cfg.model.kv_heads, heads)
    m.num_attention_heads, m.num_kv_heads, m.hidden_size = heads, kv, 16 * heads
    m.ffn_hidden_size = 32 * heads
    m.num_layers = max(2, p.pipeline * p.virtual_stages)
    p.stage_layers = []  # the user's split was for the full depth; the shrunk model splits evenly
    # the sequence splits over TP (sequence parallelism), into 2c chunks (CP), and with both, each chunk over TP
    unit = math.lcm(p.tensor, 2 * p.context if p.context > 1 else 1, p.context * p.tensor if p.sequence_parallel else 1)
    seq_cap = max(unit, 64 // unit * unit)
    m.seq_length = min(m.seq_length, seq_cap) if m.seq_length % unit == 0 else seq_cap
    if t.recompute_switch_step > 0:
        t.recompute_switch_step = max(1, steps // 2)
    t.steps, t.log_interval = steps, max(1, steps // 10)
    small.optim.warmup_steps = min(small.optim.warmup_steps, steps // 10)
    small.checkpoint.interval = 0
    small.run.profile_steps = []  # the real run's steps to profile; the pre-flight may stop before them
    small.run.rollback_after = 0  # it needs checkpoints, and the pre-flight saves none
    small.run.dir = str(Path(cfg.run.dir) / "preflight")
    # the shrunk model cannot load the real run's checkpoint (check_load judges it) and copies nothing
    small.checkpoint.load, small.checkpoint.mirrors, small.checkpoint.mirror_dir = "", [], ""
    return small


def load_verdict(cfg: Config, env: DistEnv) -> list[tuple[bool, str]]:
    """checkpoint.load, when set, is a readable and verified checkpoint: rank 0 checks it for every rank
    (engine/checkpoint/load_check.py)."""
    if not cfg.checkpoint.load:
        return []
    ok, text = True, ""
    if env.rank == 0:
        try:
            text = check_load(cfg.checkpoint.load)
        except CheckpointError as exc:
            ok, text = False, f"checkpoint.load={cfg.checkpoint.load}: {exc}"
    if env.world_size > 1:
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=env.device)
        comm.broadcast(flag, src=0, group=world_group())
        ok = bool(flag.item())
    return [(ok, text)]


def layout_advice(cfg: Config, world_size: int, device: torch.device, gpus_per_node: int) -> str | None:
    """The planner's warning (engine/plan/planner.py) when the run's layout is predicted more than 1.3× slower
    than the fastest one that fits the device, from the shipped profile of this device type."""
    return layout_warning(cfg, world_size, layout_profile(cfg, device), device_memory(device), gpus_per_node)


def layout_profile(cfg: Config, device: torch.device):
    """The shipped device profile of this device type and the run's precision."""
    return load_profile(default_profile(device.type, cfg.train.precision))


def memory_mb(device: torch.device) -> float:
    """Memory in use now (not the peak): CUDA tensors, or this process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def memory_growth(series: list[float]) -> float:
    """MB grown from the early steps (after optimizer state exists) to the last ones, medians of 10 steps."""
    window = max(1, min(10, len(series) // 4))
    early = statistics.median(series[window:2 * window] or series[:window])
    return statistics.median(series[-window:]) - early


def verdicts(history: list[dict], growth_mb: float, base_mb: float) -> list[tuple[bool, str]]:
    losses = [r["loss"] for r in history]
    taken = [r for r in history if not r["skipped"]]
    norms = [r["grad_norm"] for r in taken]
    bad = [r["step"] for r in history if not math.isfinite(r["loss"])] + \
          [r["step"] for r in taken if not math.isfinite(r["grad_norm"])]
    out = [(not bad and bool(taken), "loss and grad norm finite on every step" if not bad and taken else
            f"NaN/Inf at steps {bad[:5]}" if bad else "every step was skipped (overflow)")]
    if norms and not bad:
        first, low, high = norms[0], min(norms), max(norms)
        out.append((low >= VANISHING_RATIO * first, f"grad norm not vanishing: min {low:.3g} vs first {first:.3g} "
                    f"(limit ×{VANISHING_RATIO:g})"))
        out.append((high <= EXPLODING_RATIO * first, f"grad norm not exploding: max {high:.3g} vs first {first:.3g} "
                    f"(limit ×{EXPLODING_RATIO:g})"))
    if not bad:
        k = max(1, len(losses) // 10)
        start, end = sum(losses[:k]) / k, sum(losses[-k:]) / k
        out.append((end < start, f"loss falls: {start:.4f} → {end:.4f} (means of first/last {k} steps)"))
    limit = MEMORY_SLACK_MB + MEMORY_SLACK_FRACTION * base_mb
    out.append((growth_mb <= limit, f"memory steady: grew {growth_mb:.1f} MB after warm-up (limit {limit:.1f} MB)"))
    return out


def check_host_memory(real: Config, env: DistEnv) -> tuple[int, int]:
    """Refuse (ConfigError) offloaded optimizer state that would not fit the smallest node; returns the ranks
    per node and the node memory it was judged with."""
    ranks = max(Counter(env.nodes).values()) if env.nodes else 1
    smallest = torch.tensor([node_memory()], dtype=torch.float64, device=env.device)
    comm.all_reduce(smallest, world_group(), op=dist.ReduceOp.MIN)
    problem = host_problem(real, env.world_size, ranks, int(smallest.item()))
    if problem:
        raise ConfigError(problem)
    return ranks, int(smallest.item())


def preflight(cfg: Config, env: DistEnv, steps: int = STEPS) -> bool:
    fill_model_from_hf(cfg)  # a Hugging Face checkpoint.load: the shrunk model is of its family
    real, small, notes = preflight_config(cfg, env.world_size, steps)
    ranks_per_node, host_memory = check_host_memory(real, env)
    run_dir = setup_run_dir(small, env.rank)
    configure_logging(run_dir, env.rank)
    for note in notes:
        log.info(f"pre-flight: {note}")
    log.info(f"the real run's {report(real, env.world_size, device_memory(env.device), host_memory, ranks_per_node)}")
    if env.rank == 0:  # the planner's advice: a warning, not a check (its model is a prediction)
        advice = layout_advice(real, env.world_size, env.device, ranks_per_node)
        if advice:
            log.warning(f"pre-flight: WARNING {advice}")
        for offload_advice in (ddp_offload_warning(real, env.world_size),
                               offload_warning(real, env.world_size, layout_profile(real, env.device), ranks_per_node)):
            if offload_advice:
                log.warning(f"pre-flight: WARNING {offload_advice}")
    m = small.model
    cp = f" × CP {small.parallel.context}" if small.parallel.context > 1 else ""
    log.info(f"pre-flight: {env.world_size} ranks, TP {small.parallel.tensor}{cp} × PP {small.parallel.pipeline}, "
             f"model {m.num_layers}×{m.hidden_size} (heads {m.num_attention_heads}/{m.num_kv_heads}), seq "
             f"{m.seq_length}, global batch {small.train.global_batch_size}, {steps} steps, {small.train.precision}"
             + (f", recompute switch at step {small.train.recompute_switch_step}"
                if small.train.recompute_switch_step > 0 else ""))
    sniffed = sniff(env.device)  # engine/observe/rank_sniff.py: the same matmul and all-reduce timed on every rank
    loadable = load_verdict(cfg, env)
    trainer = Trainer(small, env)
    history, memory = [], []
    try:
        for _ in range(steps):
            record = trainer.train_step()
            history.append(record)
            memory.append(memory_mb(env.device))
            if trainer.step % small.train.log_interval == 0:
                log.info(f"pre-flight step {trainer.step}: loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3g}")
    finally:
        trainer.loader.close()  # no prefetch thread left reading at exit
    if small.train.recompute_switch_step > 0:  # the micro batch changed at the switch: judge the phase after it
        memory = memory[small.train.recompute_switch_step:]
    numbers = torch.tensor([memory_growth(memory), memory[0]], dtype=torch.float64, device=env.device)
    comm.all_reduce(numbers, world_group(), op=dist.ReduceOp.MAX)  # the worst rank decides
    checks = verdicts(history, numbers[0].item(), numbers[1].item()) + sniffed + loadable
    passed = all(ok for ok, _ in checks)
    log.info("pre-flight report:\n" + "\n".join(f"  {'PASS' if ok else 'FAIL'}  {text}" for ok, text in checks)
             + f"\nPRE-FLIGHT {'PASSED' if passed else 'FAILED'}")
    return passed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Trilith pre-flight check", prog="python -m engine.preflight")
    parser.add_argument("--config", required=True, help="the YAML configuration of the real run")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps to run (default {STEPS})")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, as for training")
    args = parser.parse_args(argv)
    clean = False
    try:
        cfg = load_config(args.config, args.overrides)
        env = init_distributed(cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_minutes)
        passed = preflight(cfg, env, args.steps)
        clean = True
        return 0 if passed else final_failure(1)
    except (ConfigError, DeviceUnavailable) as exc:
        print(f"trilith: configuration error: {exc}", file=sys.stderr)
        return final_failure(2)
    except CheckpointError as exc:  # an unreadable Hugging Face checkpoint.load, whose family the model takes
        print(f"trilith: checkpoint error: {exc}", file=sys.stderr)
        return final_failure(1)
    finally:
        shutdown(clean)


if __name__ == "__main__":
    exit_now(main())
