"""Step time with the optimizer state offloaded to the host (optim.offload_fraction 0.5 and 1) against none.

One process trains the same model at each fraction, steps interleaved (one step of each per round) so that
background load hits all equally; prints the median and fastest step and optimizer-step times of each and their
ratios to fraction 0, then the host AdamW time per step and the share of it hidden behind backward
(optim.offload_overlap; ZeRO by default here: single-rank DDP has no reduction to start host steps from);
--overlap lists the overlap settings to compare at each fraction, --accum K micro-batches per step,
--step-repeats R then times the optimizer step alone R more times per variant, interleaved, on the last step's
gradients restored before each (the step after backward, without speculation: what a clipped step pays under
overlap auto; far less exposed to the other work on a shared machine than whole steps). On
CPU the "device" is the CPU too, and the host thread competes with backward for the same cores: the ratio is
the cost of the offload machinery (copies, two state homes, speculation), not of PCIe.
With --device-memory it also prints the deepest model of this width the estimate (engine/memory_estimate.py)
fits in one device's memory without and with offload.

    python tools/bench_offload.py [--hidden 256 --layers 4 --seq 256 --batch 4 --steps 10 --zero-stage 1 --clip 1]
    python tools/bench_offload.py --accum 8 --fractions 1 --overlap false,auto
    python tools/bench_offload.py --layers 2 --clip 0.01 --step-repeats 40
    python tools/bench_offload.py --hidden 2048 --layers 16 --heads 16 --kv-heads 8 --ffn 5632 --vocab 32000 \\
        --seq 2048 --batch 1 --precision bf16 --device-memory 141GB
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config.schema import from_dict, validate  # noqa: E402
from engine.memory_estimate import chunk_units, estimate, gib, parse_bytes  # noqa: E402
from engine.train import Trainer  # noqa: E402
from parallel.distributed import DistEnv  # noqa: E402

def config(args, fraction: float, run_dir: str, overlap: str = "auto"):
    return from_dict({
        "model": dict(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.heads,
                      num_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                      seq_length=args.seq),
        "train": dict(micro_batch_size=args.batch, global_batch_size=args.batch * args.accum,
                      steps=args.steps + args.warmup,
                      precision=args.precision, device=args.device, log_interval=10**6),
        "optim": dict(offload_fraction=fraction, clip_grad=args.clip, offload_overlap=overlap), "data": dict(mock=True),
        "parallel": dict(zero_stage=args.zero_stage),
        "run": dict(dir=run_dir)})


MAX_LAYERS = 4096


def deepest_fitting(cfg, memory: int) -> tuple[int, int]:
    """(layers, parameters) of the deepest model of `cfg`'s width (at most MAX_LAYERS) whose estimate fits
    `memory` bytes; (0, 0) when not even one layer does."""
    def with_layers(layers):
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))

    low, high = 0, MAX_LAYERS + 1  # fits at low (0: trivially), not at high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if estimate(with_layers(mid), 1)[0].total <= memory else (low, mid)
    return low, sum(n for unit in chunk_units(with_layers(low), low, True, True) for _, n in unit) if low else 0


def timed(trainer, seconds: list) -> None:
    """Record the wall time of each optimizer step of `trainer` in `seconds` (the step's own share)."""
    step = trainer.optimizer.step

    def timed_step(lr):
        start = time.perf_counter()
        out = step(lr)
        seconds.append(time.perf_counter() - start)
        return out

    trainer.optimizer.step = timed_step


def gradients(trainer) -> list:
    """(holder, attribute, tensor, copy) of each gradient the optimizer step reads: ZeRO units' reduced shards,
    or the parameters' .grad."""
    units = getattr(trainer.data_parallel, "units", None)
    holders = [(u, a) for u in units for a in ("grad_shard", "grad32")] if units is not None else \
        [(p, "grad") for _, p in trainer.named_params]
    return [(h, a, getattr(h, a), getattr(h, a).clone()) for h, a in holders if getattr(h, a) is not None]


def steps_alone(trainers: dict, repeats: int, device: torch.device) -> dict:
    """Variant → the seconds of `repeats` optimizer steps alone, interleaved across variants, each on the
    gradients of one more training step (restored before each; the state steps on)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    saved = {}
    for v, trainer in trainers.items():
        step = trainer.optimizer.step

        def capture(lr, v=v, trainer=trainer, step=step):
            saved[v] = (step, lr, gradients(trainer))
            return step(lr)

        trainer.optimizer.step = capture
        trainer.train_step()
        trainer.optimizer.step = step
    seconds: dict = {v: [] for v in trainers}
    for _ in range(repeats):
        for v, (step, lr, grads) in saved.items():
            for holder, attribute, tensor, copy in grads:
                setattr(holder, attribute, tensor.copy_(copy))
            sync()
            start = time.perf_counter()
            step(lr)
            sync()
            seconds[v].append(time.perf_counter() - start)
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("hidden", 256), ("layers", 4), ("heads", 8), ("kv-heads", 4), ("ffn", 688),
                          ("vocab", 8192), ("seq", 256), ("batch", 4), ("steps", 10), ("warmup", 2), ("accum", 1),
                          ("step-repeats", 0)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1)
    ap.add_argument("--clip", type=float, default=1.0, help="optim.clip_grad (a step that clips redoes its host step)")
    ap.add_argument("--fractions", default="0.5,1", help="offload fractions to time against 0")
    ap.add_argument("--overlap", default="auto", help="optim.offload_overlap settings to compare, e.g. false,auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--device-memory", default="", help="also print the deepest model that fits, e.g. 80GB")
    ap.add_argument("--fit-only", action="store_true", help="only the deepest models (no training)")
    args = ap.parse_args(argv)
    if not args.fit_only:
        time_steps(args)
    if args.device_memory:
        memory = parse_bytes(args.device_memory)
        for fraction in (0.0, 1.0):
            layers, params = deepest_fitting(config(args, fraction, "/unused"), memory)
            bound = "at least " if layers == MAX_LAYERS else ""
            print(f"deepest model fitting {gib(memory)} at offload_fraction {fraction:g}: {bound}{layers} layers, "
                  f"{params / 1e9:.2f} B parameters")
    return 0


def time_steps(args) -> None:
    """Train each variant (fraction 0, then each fraction × overlap), steps interleaved; print medians, fastest
    steps and their ratios to fraction 0."""
    env = DistEnv(0, 1, 0, torch.device(args.device), "gloo")
    variants = [(0.0, "false")] + [(float(f), o) for f in args.fractions.split(",") for o in args.overlap.split(",")]
    several = "," in args.overlap
    name = {v: f"offload_fraction {v[0]:g}" + (f", overlap {v[1]}" if v[0] and several else "") for v in variants}
    with tempfile.TemporaryDirectory() as run_dir:
        trainers = {}
        for k, (fraction, overlap) in enumerate(variants):
            cfg = config(args, fraction, str(Path(run_dir) / str(k)), overlap)
            validate(cfg, 1)
            trainers[(fraction, overlap)] = Trainer(cfg, env)
        times: dict = {v: [] for v in variants}
        optimizer_times: dict = {v: [] for v in variants}
        records: dict = {v: [] for v in variants}
        for v, trainer in trainers.items():
            timed(trainer, optimizer_times[v])
        for step in range(args.warmup + args.steps):
            for v, trainer in trainers.items():
                if env.device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                record = trainer.train_step()
                if env.device.type == "cuda":
                    torch.cuda.synchronize()
                if step >= args.warmup:
                    times[v].append(time.perf_counter() - start)
                    records[v].append(record)
        alone = steps_alone(trainers, args.step_repeats, env.device) if args.step_repeats else {}
        for trainer in trainers.values():
            trainer.loader.close()
    print(f"shape: hidden {args.hidden}, layers {args.layers}, seq {args.seq}, batch {args.batch} × {args.accum} "
          f"micro-batches, {args.precision}, {args.device}; {args.steps} steps each: median and fastest (the fastest "
          f"is the least disturbed by load)")
    base = variants[0]
    for label, series in (("step", times), ("optimizer step", {v: s[args.warmup:args.warmup + args.steps]
                                                                     for v, s in optimizer_times.items()}),
                          (f"optimizer step alone ({args.step_repeats} repeats)", alone)):
        if not series:
            continue
        median0, fastest0 = statistics.median(series[base]), min(series[base])
        for v in variants:
            median, fastest = statistics.median(series[v]), min(series[v])
            print(f"{label} at {name[v]}: median {median * 1000:.1f} ms (ratio {median / median0:.3f}), "
                  f"fastest {fastest * 1000:.1f} ms (ratio {fastest / fastest0:.3f})")
    for v in variants[1:]:
        overlapped = [r for r in records[v] if "offload_host_s" in r]
        if overlapped:
            host = sum(r["offload_host_s"] for r in overlapped)
            hidden = sum(r["offload_hidden_s"] for r in overlapped)
            redos = overlapped[-1]["offload_redos"] - records[v][0].get("offload_redos", 0)
            share = hidden / host if host else 0.0
            print(f"{name[v]}: host AdamW {host / len(overlapped) * 1000:.1f} ms/step, "
                  f"{share:.0%} of it behind backward; {redos} redos in {len(overlapped) - 1} steps")


if __name__ == "__main__":
    sys.exit(main())
