"""Kernel benchmark: train a ~1B Llama shape with every attention / norm backend and recompute mode.

    python tools/bench_gpu.py                 # one GPU, ~1.2B Llama-3.2-1B shape, seq 4096, bf16 (~5 min on H200)
    python tools/bench_gpu.py --tiny          # tiny shape; automatic without CUDA (CI proves the script runs)
    python tools/bench_gpu.py --attention flash --norm apex --recompute none --compile
    python tools/bench_gpu.py --attention flash --norm apex --loss chunked fused   # fused output layer + loss

Each configuration builds the model and the engine's optimizer (fp32 masters, AdamW kernel `auto`), runs
`--warmup` steps, then times `--steps` optimizer steps of `--accum` micro-batches and prints one table
row: tokens/s, TFLOP/s, MFU (6N + 12·L·H·Q·T FLOPs per token, against 989 TFLOP/s dense bf16 per GPU),
peak memory, and the speed ratio to the plain-PyTorch path (reference attention, torch norm, no
recompute, eager; RoPE/SwiGLU nodes and the chunked loss are the same in every row). A backend that is not installed is listed as skipped; an out-of-memory configuration is
listed as OOM. Speed is only printed, never asserted.

`--profile K` then profiles two more steps of every configuration and prints where the time goes: the
fraction of wall time the GPU is busy, kernel time by kind (matmul, attention, compiled elementwise,
optimizer, other) and the K costliest kernels (on CPU: operators).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
import sys
from collections import defaultdict
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config.schema import ModelConfig, OptimConfig  # noqa: E402
from engine.model import CausalLM, num_parameters  # noqa: E402
from engine.observe.metrics import H100_BF16_PEAK_FLOPS, flops_per_token  # noqa: E402
from engine.optim.replicated import MixedPrecisionAdamW  # noqa: E402
from kernels.attention import flash_available  # noqa: E402
from kernels.norm import apex_available  # noqa: E402
from parallel.random import seed_all  # noqa: E402
from parallel.topology import single_process  # noqa: E402

LLAMA_1B = ModelConfig(hidden_size=2048, num_layers=16, num_attention_heads=32, num_kv_heads=8, ffn_hidden_size=8192,
                       vocab_size=128256, seq_length=4096, rope_theta=500000.0, tie_embeddings=True)
TINY = ModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                   vocab_size=256, seq_length=32)
HEADER = ("attention", "norm", "recompute", "compile", "loss", "tokens/s", "TFLOP/s", "MFU", "peak GiB", "vs plain")


@dataclasses.dataclass
class Case:
    attention: str
    norm: str
    recompute: str
    compile: bool
    loss: str = "chunked"  # chunked: output layer, then chunked cross-entropy; fused: model.fused_lm_head_loss

    def skip_reason(self, device: torch.device) -> str | None:
        if self.attention == "flash" and not (flash_available() and device.type == "cuda"):
            return "flash-attn not installed / no CUDA"
        if self.attention == "cudnn" and device.type != "cuda":
            return "cuDNN attention needs CUDA"
        if self.norm == "apex" and not (apex_available() and device.type == "cuda"):
            return "apex not installed / no CUDA"
        if self.compile and device.type != "cuda":
            return "compile is benchmarked on CUDA only"
        return None


def build(cfg: ModelConfig, case: Case, device: torch.device, dtype: torch.dtype):
    cfg = dataclasses.replace(cfg, attention_backend=case.attention, norm_backend=case.norm,
                              fused_lm_head_loss=case.loss == "fused")
    with torch.device(device):
        model = CausalLM(cfg)
    with torch.no_grad():  # random weights drawn on the device: benchmark speed does not depend on them
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.to(dtype)
    model.set_recompute(case.recompute)
    if case.compile:
        model.compile_blocks()
    optimizer = MixedPrecisionAdamW(list(model.named_parameters()), OptimConfig(), single_process(),
                                    "bf16" if dtype == torch.bfloat16 else "fp32")
    return model, optimizer


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(cfg, case, args, device, dtype) -> dict:
    model, optimizer = build(cfg, case, device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.accum, args.micro_batch, cfg.seq_length + 1), generator=gen,
                           device=device)

    def step():
        for mb in tokens:
            loss = model(mb[:, :-1], mb[:, 1:])
            (loss / args.accum).backward()
        optimizer.step(1e-4)
        optimizer.zero_grad()

    for _ in range(args.warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    elapsed = time.perf_counter() - start
    tokens_per_s = args.steps * args.accum * args.micro_batch * cfg.seq_length / elapsed
    flops = tokens_per_s * flops_per_token(num_parameters(cfg), cfg.num_layers, cfg.hidden_size, cfg.seq_length)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"tokens_per_s": tokens_per_s, "tflops": flops / 1e12,
            "mfu": flops / H100_BF16_PEAK_FLOPS if device.type == "cuda" else None, "peak_gib": peak,
            "profile": profile_report(step, device, args.profile) if args.profile else None}


KERNEL_KINDS = [("attention", re.compile(r"flash|fmha|cudnn|sdpa|attention", re.I)),
                ("matmul", re.compile(r"gemm|matmul|cutlass|xmma|nvjet|cublas|wgmma|aten::(add|b)?mm$", re.I)),
                ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
                ("compiled elementwise", re.compile(r"^triton_")),
                ("other", re.compile(""))]


def kernel_kind(name: str) -> str:
    return next(kind for kind, pattern in KERNEL_KINDS if pattern.search(name))


def profile_report(step, device, top: int) -> str:
    """Two profiled steps: busy fraction, time per kernel kind and the `top` costliest kernels, as text."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            step()
        sync(device)
    wall_us = (time.perf_counter() - start) * 1e6
    per_name = defaultdict(float)
    if device.type == "cuda":
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                per_name[event.name] += event.time_range.elapsed_us()
    else:
        for average in prof.key_averages():
            per_name[average.key] += average.self_cpu_time_total
    busy = sum(per_name.values())
    by_kind = defaultdict(float)
    for name, us in per_name.items():
        by_kind[kernel_kind(name)] += us
    what = "GPU kernels" if device.type == "cuda" else "CPU operators (self time)"
    lines = [f"  profile of 2 steps: {what} busy {100 * busy / wall_us:.1f}% of {wall_us / 1e3:.1f} ms; "
             + ", ".join(f"{kind} {100 * by_kind[kind] / busy:.1f}%" for kind, _ in KERNEL_KINDS)]
    for name, us in sorted(per_name.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"  {100 * us / busy:5.1f}%  {us / 2e3:8.2f} ms/step  {name[:100]}")
    return "\n".join(lines)


def cases(args) -> list[Case]:
    product = list(itertools.product(args.attention, args.norm, args.recompute, args.loss))
    grid = [Case(a, n, r, False, loss) for a, n, r, loss in product]
    if args.compile:
        grid += [Case(a, n, r, True, loss) for a, n, r, loss in product]
    plain = Case("reference", "torch", "none", False)
    return [plain] + [c for c in grid if c != plain]


def fmt_row(values) -> str:
    return "| " + " | ".join(str(v) for v in values) + " |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shape (automatic without CUDA)")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per configuration")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--accum", type=int, default=None, help="micro-batches per step")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--attention", nargs="+", default=["reference", "sdpa", "cudnn", "flash"],
                        help="sdpa: torch's kernel order; cudnn: SDPA with cuDNN first (auto's pick on Hopper)")
    parser.add_argument("--norm", nargs="+", default=["torch", "apex"])
    parser.add_argument("--recompute", nargs="+", default=["none", "selective", "full"])
    parser.add_argument("--loss", nargs="+", default=["chunked"], choices=["chunked", "fused"],
                        help="output layer + loss: chunked cross-entropy after the logits, or fused (no logits kept)")
    parser.add_argument("--compile", action="store_true", help="also every configuration with compiled blocks")
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="also profile 2 steps per configuration and print the K costliest kernels")
    parser.add_argument("--json", help="write the rows to this file as JSON")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    cfg = TINY if tiny else LLAMA_1B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.steps = args.steps or (2 if tiny else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 3)
    args.accum = args.accum or (2 if tiny else 4)
    if device.type == "cpu":
        torch.set_num_threads(1)
    seed_all(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {name}, {'tiny' if tiny else '~1B Llama'} shape: {num_parameters(cfg) / 1e6:.1f}M parameters, "
          f"seq {cfg.seq_length}, {str(dtype).removeprefix('torch.')}, {args.accum}×{args.micro_batch} sequences "
          f"per step, {args.steps} timed steps after {args.warmup}")
    print(fmt_row(HEADER))
    print(fmt_row(["---"] * len(HEADER)))
    rows, plain_speed = [], None
    for case in cases(args):
        label = [case.attention, case.norm, case.recompute, "yes" if case.compile else "no", case.loss]
        reason = case.skip_reason(device)
        if reason:
            print(fmt_row(label + [f"skipped: {reason}"] + [""] * 4), flush=True)
            continue
        try:
            result = run_case(cfg, case, args, device, dtype)
        except torch.cuda.OutOfMemoryError:
            result = None
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if result is None:
            print(fmt_row(label + ["OOM"] + [""] * 4), flush=True)
            continue
        if case == Case("reference", "torch", "none", False):
            plain_speed = result["tokens_per_s"]
        ratio = f"{result['tokens_per_s'] / plain_speed:.2f}x" if plain_speed else "-"
        mfu = f"{100 * result['mfu']:.1f}%" if result["mfu"] is not None else "-"
        peak = f"{result['peak_gib']:.1f}" if result["peak_gib"] is not None else "-"
        print(fmt_row(label + [f"{result['tokens_per_s']:,.0f}", f"{result['tflops']:.2f}", mfu, peak, ratio]),
              flush=True)
        if result["profile"]:
            print(result["profile"], flush=True)
        rows.append({**dataclasses.asdict(case), **result})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
