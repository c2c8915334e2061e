"""The PyTorch-native peer of tools/bench_peers.py: transformers' LlamaForCausalLM (SDPA) trained with torch's own
parallelism, each piece configured the way torchtitan configures it. One torchrun job per mode:

  zero3  FSDP2 `fully_shard`: the embedding, each block, norm + output together, then the root
  ddp    `DistributedDataParallel`, 25 MB buckets
  tp     DTensor tensor parallelism with torchtitan's Llama plan, loss parallel, no sequence parallelism
  tp_sp  the same plan with `SequenceParallel` norms and sequence-sharded activations between blocks
  pp     `torch.distributed.pipelining`, two stages split by hand, `Schedule1F1B`
  zbv    the same, two stages per rank placed as a V (rank r: stages r and 2N−1−r), `ScheduleZBVZeroBubble`
  zbi    two stages per rank looped (rank r: stages r and N+r), `ScheduleInterleavedZeroBubble`
  (zbv, zbi as torchtitan's pipeline_module_split and build_pipeline_schedule set them up: the loss divided
  by the micro-batch count, scale_grads=False)

Data follows Trilith's synthetic rule (engine/mock_data.py) sample for sample, re-implemented here so that the
peer runs without Trilith. Each rank writes OUT/rank_K.json (its per-step losses where it knows them, and step
seconds) and OUT/profile/rank_K/trace.json, a torch.profiler trace of the last warm-up step.

    torchrun --nproc-per-node 2 tools/peer_train.py --mode tp_sp --out DIR [--hidden 256 ...]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

MODES = ("zero3", "ddp", "tp", "tp_sp", "pp", "zbv", "zbi")
ZERO_BUBBLE = {"zbv": "ScheduleZBVZeroBubble", "zbi": "ScheduleInterleavedZeroBubble"}
STRIDE, SEED_MULTIPLIER = 7, 1_000_003  # engine/mock_data.py's rule


def sample(seed: int, index: int, vocab: int, seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * SEED_MULTIPLIER + index)
    start = torch.randint(0, vocab, (1,), generator=gen)
    return (start + STRIDE * torch.arange(seq + 1)) % vocab


def batch(args, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This data-parallel rank's share of the global batch of `step` (0-based), as Trilith's loader splits it."""
    per_rank = args.batch // dp_size
    first = step * args.batch + dp_rank * per_rank
    return torch.stack([sample(args.seed, first + i, args.vocab, args.seq) for i in range(per_rank)])


class Llama(nn.Module):
    """A run of LlamaForCausalLM's pieces: embedding (first stage), blocks, norm and output (last stage).

    The rotary tables are computed here for the full sequence, not from the input's length, because under
    sequence parallelism a block's input holds only this rank's part of the sequence; attention_mask None makes
    transformers' SDPA attention causal."""

    def __init__(self, hf, layers: range, first: bool, last: bool, seq: int):
        super().__init__()
        self.embed = hf.model.embed_tokens if first else None
        self.layers = nn.ModuleList(hf.model.layers[i] for i in layers)
        self.norm = hf.model.norm if last else None
        self.output = hf.lm_head if last else None
        self.rotary = hf.model.rotary_emb
        self.register_buffer("positions", torch.arange(seq)[None], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        cos_sin = self.rotary(h, self.positions)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_embeddings=cos_sin)
        return self.output(self.norm(h)) if self.output is not None else h


def build_hf(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=args.seq, rope_theta=args.rope_theta, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def apply_tp(model: Llama, mesh, sequence_parallel: bool) -> None:
    """torchtitan's `apply_tp` for Llama: q/k/v and gate/up column-wise, o/down row-wise, embedding row-wise,
    output column-wise into a vocabulary-sharded loss; with sequence parallelism the norms shard the sequence
    and each attention / MLP gathers it on entry and reduce-scatters it on exit."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    between = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
    })
    for block in model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=between),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            plan.update({
                "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                # transformers passes the attention's input by keyword
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, mesh, plan)


def apply_fsdp(model: Llama, mesh) -> None:
    """torchtitan's `apply_fsdp` without mixed precision: norm + output stay gathered after forward, since
    backward needs them first."""
    from torch.distributed.fsdp import fully_shard
    fully_shard(model.embed, mesh=mesh, reshard_after_forward=True)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard([model.norm, model.output], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)


def clip_gradients(params: list, max_norm: float, pp_group=None) -> None:
    """torchtitan's clip_grad_norm_: the global norm over sharded (DTensor) and plain gradients and, under
    pipelining, over the stages."""
    grads = [p.grad for p in params if p.grad is not None]
    groups = [[g for g in grads if isinstance(g, DTensor)], [g for g in grads if not isinstance(g, DTensor)]]
    square = torch.zeros((), device=grads[0].device)
    for group in groups:
        if group:
            norm = torch.nn.utils.get_total_norm(group, foreach=True)
            square = square + (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    if pp_group is not None:
        dist.all_reduce(square, group=pp_group)
    total = square.sqrt()
    for kind in (DTensor, torch.Tensor):
        chosen = [p for p in params if p.grad is not None and isinstance(p.grad, DTensor) == (kind is DTensor)]
        if chosen:
            torch.nn.utils.clip_grads_with_norm_(chosen, max_norm, total, foreach=True)


def loss_of(logits, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class Trainer:
    """One mode's model, optimizer and step. `step(tokens)` returns the step's loss on this rank, or None where
    the rank cannot know it (pipeline stages before the last)."""

    def __init__(self, args, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh
        self.args, self.device = args, device
        world, rank = dist.get_world_size(), dist.get_rank()
        self.mesh = init_device_mesh(device.type, (world,))
        hf = build_hf(args)
        mode, layers = args.mode, args.layers
        self.dp_rank, self.dp_size, self.pp_group, self.schedule = 0, 1, None, None
        self.stage_ids = []
        if mode == "pp":
            self.stage_ids = [rank]
        elif mode in ZERO_BUBBLE:
            self.stage_ids = [rank, 2 * world - 1 - rank] if mode == "zbv" else [rank, world + rank]
        if self.stage_ids:
            # Trilith's even split: the earlier stages take the remainder
            n = world * (1 if mode == "pp" else 2)
            bounds = [sum(layers // n + (i < layers % n) for i in range(k)) for k in range(n + 1)]
            self.parts = [Llama(hf, range(bounds[s], bounds[s + 1]), s == 0, s == n - 1, args.seq).to(device)
                          for s in self.stage_ids]
            self.model = self.parts[0] if mode == "pp" else nn.ModuleList(self.parts)
        else:
            self.model = Llama(hf, range(layers), True, True, args.seq).to(device)
        if mode in ("zero3", "ddp"):
            self.dp_rank, self.dp_size = rank, world
        if mode == "zero3":
            apply_fsdp(self.model, self.mesh)
        elif mode == "ddp":
            self.model = nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=25)
        elif mode in ("tp", "tp_sp"):
            apply_tp(self.model, self.mesh, mode == "tp_sp")
        elif mode == "pp":
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B
            self.pp_group = dist.group.WORLD
            stage = PipelineStage(self.model, rank, world, device)
            self.schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=loss_of)
        elif mode in ZERO_BUBBLE:
            from torch.distributed import pipelining
            self.pp_group = dist.group.WORLD
            stages = [pipelining.PipelineStage(part, s, 2 * world, device) for s, part in zip(self.stage_ids,
                                                                                                self.parts)]
            self.schedule = getattr(pipelining, ZERO_BUBBLE[mode])(
                stages, n_microbatches=args.micro_batches, scale_grads=False,
                loss_fn=lambda logits, labels: loss_of(logits, labels) / args.micro_batches)
        self.params = list(self.model.parameters())
        # the fused kernel takes one kind of tensor per group: plain TP leaves the norms undistributed
        groups = [[p for p in self.params if isinstance(p, DTensor) == sharded] for sharded in (True, False)]
        self.optimizer = torch.optim.AdamW([{"params": g} for g in groups if g], lr=args.lr, betas=(0.9, 0.95),
                                           eps=1e-8, weight_decay=0.1, fused=True)

    def step(self, tokens: torch.Tensor) -> float | None:
        inputs, labels = tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)
        loss = None
        if self.schedule is not None:
            world = dist.get_world_size()
            stages = world if self.args.mode == "pp" else 2 * world
            first, last = 0 in self.stage_ids, stages - 1 in self.stage_ids  # under the V both on rank 0
            losses: list = []
            self.schedule.step(*([inputs] if first else []),
                               **({"target": labels, "losses": losses} if last else {}))
            if last:
                loss = torch.stack(losses).mean() * (1 if self.args.mode == "pp" else self.args.micro_batches)
        elif self.args.mode in ("tp", "tp_sp"):
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                loss = loss_of(self.model(inputs), labels)
                loss.backward()
        else:
            loss = loss_of(self.model(inputs), labels)
            loss.backward()
        clip_gradients(self.params, self.args.clip, self.pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return None if loss is None else loss.detach().item()


def reuse_freed_memory() -> None:
    """glibc keeps freed memory for the next step (mmap and trim thresholds 1 GiB), as Trilith's CPU runs do
    (train.cpu_allocator=reuse, engine/observe/host_memory.py): the comparison is of the parallelism, not the allocator."""
    if platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--out", required=True)
    for name, default in (("hidden", 256), ("layers", 4), ("heads", 8), ("kv-heads", 8), ("ffn", 688),
                          ("vocab", 8192), ("seq", 256), ("batch", 8), ("micro-batches", 8), ("warmup", 2),
                          ("steps", 5), ("seed", 1234)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--reuse-freed-memory", action="store_true", help="glibc malloc keeps freed memory (CPU)")
    args = ap.parse_args(argv)
    if args.reuse_freed_memory:
        reuse_freed_memory()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    trainer = Trainer(args, device)
    out = Path(args.out)
    losses, seconds = [], []
    for step in range(args.warmup + args.steps):
        profiling = step == args.warmup - 1
        prof = None
        if profiling:
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            prof.start()
        start = time.perf_counter()
        loss = trainer.step(batch(args, step, trainer.dp_rank, trainer.dp_size))
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if prof is not None:
            prof.stop()
            (out / "profile" / f"rank_{rank}").mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(out / "profile" / f"rank_{rank}" / "trace.json"))
        if loss is not None:
            losses.append(loss)
    (out / f"rank_{rank}.json").write_text(json.dumps({"losses": losses, "step_seconds": seconds}))
    dist.barrier()  # no rank closes its connections while a peer's gloo threads still use them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    # Skip the interpreter's teardown: torch's C++ destructors there can abort a finished rank whose gloo
    # transport threads are still winding down ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
