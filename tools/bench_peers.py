"""Trilith against PyTorch's own parallelism on the same work: tokens/s, collectives and bytes per step.

For each mode, Trilith runs through its launcher (launch/run_pretrain.sh --nproc N) and the peer as a torchrun
job of tools/peer_train.py: transformers' LlamaForCausalLM (SDPA) with the torch piece configured as torchtitan
configures it. Same shape, batch, fp32, AdamW + clipping at 1.0, constant learning rate, the same synthetic
samples (engine/mock_data.py's rule) and the same machine. On the CPU the peer gets the malloc setting
Trilith's CPU runs use (train.cpu_allocator=reuse: freed memory kept for reuse), worth ~10% to either side.

  mode    Trilith                               peer
  zero3   parallel.zero_stage=3                 FSDP2 fully_shard (embedding, each block, norm + head, root)
  ddp     parallel.zero_stage=0 (25 MB buckets) DistributedDataParallel(bucket_cap_mb=25)
  tp      parallel.tensor=N                     DTensor, torchtitan's Llama plan
  tp_sp   ... + parallel.sequence_parallel      ... + SequenceParallel norms
  pp      parallel.pipeline=N, 1F1B             torch.distributed.pipelining Schedule1F1B
  zbv     ... schedule=zbv, virtual_stages=2    ScheduleZBVZeroBubble, two stages per rank as a V
  zbi     ... schedule=zbv, virtual_stages=2    ScheduleInterleavedZeroBubble, two looped stages per rank
          (Trilith's two-chunk zero-bubble schedule against torch's; both as torchtitan sets them up)

Each side's job runs W warm-up steps (the last one under torch.profiler) and S measured steps; tokens/s = tokens
per step / median measured step time (rank 0's). Rounds interleave the sides (their order alternates per round); a
mode's ratio is the median of its per-round ratios (listed too), with a warning when they spread more than 20%.
Collectives per step count the c10d operators in the profiled step on every rank (summed); bytes are each
collective's full buffer (an all-gather's output, a reduce-scatter's input). Both sides must train: step-1 loss
within 0.3 of ln V and the last loss lower by 1% of ln V, else the tool stops with status 1 and one line.

    python tools/bench_peers.py [--modes zero3,ddp,tp,tp_sp,pp,zbv,zbi] [--rounds 3] [--hidden 256 --layers 4 ...]
        [--device cpu|cuda] [--nproc 2] [--trilith-set KEY=VALUE ...] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("zero3", "ddp", "tp", "tp_sp", "pp", "zbv", "zbi")
LOSS_TOLERANCE = 0.3  # step-1 loss must be this close to ln V (uniform predictions)
MIN_FALL = 0.01  # and the last loss lower by this fraction of ln V: more than an untrained model's batch noise
SPREAD_WARNING = 0.2  # per-round ratios further apart than this fraction of their median are flagged
ELEMENT_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
                 "bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2}


class BenchError(RuntimeError):
    """A side that failed or did not train; the message is the tool's one line."""


def layout(mode: str, nproc: int, batch: int) -> tuple[dict, int]:
    """Trilith's parallel section for `mode` and its micro-batch size: one micro-batch per step per
    data-parallel rank, except the pipeline's micro-batches of one sequence (the peer's n_microbatches)."""
    if mode == "zero3":
        return {"zero_stage": 3}, batch // nproc
    if mode == "ddp":
        return {"zero_stage": 0, "bucket_mb": 25.0}, batch // nproc
    if mode in ("tp", "tp_sp"):
        return {"tensor": nproc, "sequence_parallel": mode == "tp_sp"}, batch
    if mode == "pp":
        return {"pipeline": nproc, "schedule": "1f1b"}, 1
    return {"pipeline": nproc, "schedule": "zbv", "virtual_stages": 2}, 1


def trilith_config(args, mode: str, run_dir: Path) -> dict:
    parallel, micro = layout(mode, args.nproc, args.batch)
    return {
        "model": {"hidden_size": args.hidden, "num_layers": args.layers, "num_attention_heads": args.heads,
                  "num_kv_heads": args.kv_heads, "ffn_hidden_size": args.ffn, "vocab_size": args.vocab,
                  "seq_length": args.seq, "rope_theta": 10000.0, "norm_eps": 1e-5},
        "train": {"micro_batch_size": micro, "global_batch_size": args.batch, "steps": args.warmup + args.steps,
                  "seed": args.seed, "precision": "fp32", "device": args.device},
        "optim": {"lr": args.lr, "warmup_steps": 0, "schedule": "constant", "clip_grad": 1.0,
                  "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
        "parallel": parallel,
        "data": {"mock": True},
        "run": {"dir": str(run_dir), "profile_steps": [args.warmup, args.warmup]},
    }


def run_job(args, cmd: list[str], log: Path, what: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.setdefault("TRILITH_PYTHON", sys.executable)  # both sides on this interpreter
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))  # both sides alike
    timeout = args.job_timeout
    with log.open("w") as out:
        try:
            done = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{what} ran past --job-timeout {timeout:.0f} s; its output is in {log}") from None
    if done.returncode:
        raise BenchError(f"{what} failed with status {done.returncode}; its output is in {log}")


def run_trilith(args, mode: str, job_dir: Path) -> dict:
    job_dir.mkdir(parents=True)
    config = job_dir / "config.yaml"
    config.write_text(json.dumps(trilith_config(args, mode, job_dir / "run")))  # JSON is YAML
    run_job(args, ["bash", str(ROOT / "launch/run_pretrain.sh"), "--nproc", str(args.nproc), "--config", str(config),
                   *args.trilith_set], job_dir / "log.txt", f"Trilith {mode}")
    records = [json.loads(line) for line in (job_dir / "run" / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    records = [r for r in records if "step_time_s" in r and "loss" in r]
    return {"losses": [r["loss"] for r in records],
            "step_seconds": [r["step_time_s"] for r in records if r["step"] > args.warmup],
            **collectives(job_dir / "run" / "profile")}


def run_peer(args, mode: str, job_dir: Path) -> dict:
    job_dir.mkdir(parents=True)
    shape = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in
             ("hidden", "layers", "heads", "kv-heads", "ffn", "vocab", "seq", "batch", "warmup", "steps", "seed",
              "lr", "device")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           str(ROOT / "tools/peer_train.py"), f"--mode={mode}", f"--out={job_dir}",
           f"--micro-batches={args.batch}", *shape]  # the pipeline's: one sequence each, as Trilith's
    if args.device == "cpu":  # the allocator setting Trilith's CPU runs use, so that only the parallelism differs
        cmd.append("--reuse-freed-memory")
    run_job(args, cmd, job_dir / "log.txt", f"peer {mode}")
    ranks = [json.loads((job_dir / f"rank_{r}.json").read_text()) for r in range(args.nproc)]
    reporting = [r["losses"] for r in ranks if r["losses"]]  # data-parallel ranks each know their share's loss
    losses = [statistics.fmean(step) for step in zip(*reporting)]
    return {"losses": losses, "step_seconds": ranks[0]["step_seconds"][args.warmup:],
            **collectives(job_dir / "profile")}


def collectives(profile_dir: Path) -> dict:
    """c10d operators (one per collective call, whatever issued it) and their bytes in the profiled step,
    summed over the ranks' traces under `profile_dir` (rank_K/trace.json)."""
    count = nbytes = 0
    ops: dict = {}
    traces = sorted(profile_dir.glob("rank_*/trace.json"))
    if not traces:
        raise BenchError(f"no profiler trace under {profile_dir}; the profiled step did not finish")
    for trace in traces:
        for event in json.loads(trace.read_text()).get("traceEvents", []):
            if event.get("cat") != "cpu_op" or not str(event.get("name", "")).startswith("c10d::"):
                continue
            count += 1
            nbytes += buffer_bytes(event.get("args", {}))
            op = event["name"].removeprefix("c10d::").strip("_")
            ops[op] = ops.get(op, 0) + 1
    return {"collectives": count, "bytes": nbytes, "ops": ops}


def buffer_bytes(event_args: dict) -> int:
    """The largest tensor among a c10d operator's inputs; a tensor list's dtype is not recorded, so its
    elements count as fp32 (the benchmark's dtype)."""
    best = 0
    for dims, kind in zip(event_args.get("Input Dims", []), event_args.get("Input type", [])):
        shapes = dims if kind == "TensorList" else [dims]
        for shape in shapes:
            if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
                best = max(best, math.prod(shape) * ELEMENT_BYTES.get("float" if kind == "TensorList" else kind, 4))
    return best


def check_trains(side: str, mode: str, losses: list[float], vocab: int) -> None:
    uniform = math.log(vocab)
    if len(losses) < 2:
        raise BenchError(f"{side} {mode}: {len(losses)} loss readings, need at least 2 steps to see training")
    first, last = losses[0], losses[-1]
    if not (abs(first - uniform) <= LOSS_TOLERANCE and last <= first - MIN_FALL * uniform):
        raise BenchError(f"{side} {mode} did not train: step-1 loss {first:.3f} (ln V = {uniform:.3f}, allowed "
                         f"±{LOSS_TOLERANCE}), last loss {last:.3f} (must be at least {MIN_FALL * uniform:.3f} lower)")


def tokens_per_s(result: dict, tokens: int, side: str, mode: str) -> float:
    if not result["step_seconds"]:
        raise BenchError(f"{side} {mode}: no measured steps (--steps must be at least 1)")
    return tokens / statistics.median(result["step_seconds"])


def measure(args) -> dict:
    """{mode: [(trilith result, peer result), ...] per round}, each result with tokens_per_s added."""
    runs: dict = {m: [] for m in args.modes}
    tokens = args.batch * args.seq
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_peers_", dir=args.workdir))
    for rnd in range(args.rounds):
        for mode in args.modes:
            sides = {}
            order = ("trilith", "peer") if rnd % 2 == 0 else ("peer", "trilith")
            for side in order:
                job = work / f"r{rnd}_{mode}_{side}"
                result = (run_trilith if side == "trilith" else run_peer)(args, mode, job)
                check_trains("Trilith" if side == "trilith" else "peer", mode, result["losses"], args.vocab)
                result["tokens_per_s"] = tokens_per_s(result, tokens, side, mode)
                sides[side] = result
                print(f"round {rnd + 1} {mode:<6} {side:<8} {result['tokens_per_s']:>10,.0f} tok/s  "
                      f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}  "
                      f"{result['collectives']} collectives, {result['bytes'] / 1e6:.2f} MB "
                      f"({', '.join(f'{op} {n}' for op, n in sorted(result['ops'].items()))})", flush=True)
            runs[mode].append((sides["trilith"], sides["peer"]))
    if not args.workdir:  # kept when a side failed: the message names its log there
        shutil.rmtree(work)
    return runs


def table(runs: dict) -> tuple[str, list[str]]:
    """The markdown table and the warnings about rounds that disagree."""
    lines = ["| mode | Trilith tok/s | peer tok/s | ratio | collectives/step Trilith | peer | MB/step Trilith | peer "
             "| per-round ratios |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    warnings = []
    for mode, pairs in runs.items():
        ratios = [t["tokens_per_s"] / p["tokens_per_s"] for t, p in pairs]
        ratio = statistics.median(ratios)
        if len(ratios) > 1 and (max(ratios) - min(ratios)) / ratio > SPREAD_WARNING:
            warnings.append(f"warning: {mode} per-round ratios {', '.join(f'{r:.2f}' for r in ratios)} spread more "
                            f"than {SPREAD_WARNING:.0%}; the machine's load changed between rounds")
        ours = statistics.median(t["tokens_per_s"] for t, _ in pairs)
        peer = statistics.median(p["tokens_per_s"] for _, p in pairs)
        t_last, p_last = pairs[-1]
        lines.append(f"| {mode} | {ours:,.0f} | {peer:,.0f} | {ratio:.2f}× | {t_last['collectives']} | "
                     f"{p_last['collectives']} | {t_last['bytes'] / 1e6:.2f} | {p_last['bytes'] / 1e6:.2f} | "
                     f"{', '.join(f'{r:.2f}' for r in ratios)} |")
    return "\n".join(lines), warnings


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ",".join(MODES))
    ap.add_argument("--rounds", type=int, default=3)
    for name, default in (("hidden", 256), ("layers", 4), ("heads", 8), ("kv-heads", 8), ("ffn", 688),
                          ("vocab", 8192), ("seq", 256), ("batch", 8), ("warmup", 2), ("steps", 5),
                          ("seed", 1234), ("nproc", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo, cuda: nccl")
    ap.add_argument("--job-timeout", type=float, default=900.0, help="seconds one side's job may take")
    ap.add_argument("--trilith-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a configuration override for Trilith's side, e.g. parallel.stage_balance=compute "
                         "(repeatable; the peer has no counterpart)")
    ap.add_argument("--workdir", default=None, help="keep the jobs' run directories and logs here (by default a "
                    "temporary directory, removed after a successful run)")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    problems = ([f"--modes: unknown {', '.join(unknown)}; choose from {','.join(MODES)}"] if unknown else []) + \
        ([f"--batch {args.batch} must be a multiple of --nproc {args.nproc}"] if args.batch % args.nproc else []) + \
        ([f"--warmup {args.warmup} must be at least 1 (the last warm-up step is profiled)"] if args.warmup < 1
         else []) + (["--rounds and --steps must be at least 1"] if min(args.rounds, args.steps) < 1 else []) + \
        [f"--trilith-set {item!r} is not KEY=VALUE" for item in args.trilith_set if "=" not in item]
    if not args.modes or problems:
        ap.error(problems[0] if problems else "--modes is empty")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"shape: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, FFN {args.ffn}, "
          f"vocab {args.vocab}, seq {args.seq}, global batch {args.batch} ({args.batch * args.seq} tokens/step), "
          f"fp32, {args.nproc} ranks on {args.device} ({'nccl' if args.device == 'cuda' else 'gloo'}), "
          f"{args.warmup} warm-up + {args.steps} measured steps, {args.rounds} rounds"
          + (f"; Trilith with {' '.join(args.trilith_set)}" if args.trilith_set else ""), flush=True)
    try:
        runs = measure(args)
    except BenchError as exc:
        print(f"bench_peers: {exc}", file=sys.stderr)
        return 1
    text, warnings = table(runs)
    print(text)
    print("collectives and MB per step: every rank's c10d operators in the profiled step, added up; "
          "tok/s: medians over rounds, ratio: median of the per-round ratios")
    for line in warnings:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
