"""Tokens/s of Trilith's single-process training step against transformers' LlamaForCausalLM.

Same shape, dtype, optimizer (AdamW, clip 1.0), batch and machine, measured in the same run with the two
steps interleaved so background load hits both equally. Prints both throughputs and the ratio.

    python tools/bench_train.py [--hidden 256 --layers 4 --heads 8 --kv-heads 4 --seq 256 --batch 4 --steps 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config.schema import ModelConfig, OptimConfig  # noqa: E402
from engine.model import CausalLM  # noqa: E402
from engine.optim.replicated import MixedPrecisionAdamW  # noqa: E402
from parallel.topology import single_process  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_hf(cfg: ModelConfig, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.kv_heads,
                         max_position_embeddings=cfg.seq_length, rope_theta=cfg.rope_theta,
                         rms_norm_eps=cfg.norm_eps, attn_implementation="sdpa")
    return LlamaForCausalLM(hf_cfg).to(dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)

    cfg = ModelConfig(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.heads,
                      num_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                      seq_length=args.seq)
    ours = CausalLM(cfg)
    ours.init_weights(0)
    ours.to(device=device, dtype=dtype).train()
    opt_cfg = OptimConfig(lr=1e-4, clip_grad=1.0)
    ours_opt = MixedPrecisionAdamW(list(ours.named_parameters()), opt_cfg, single_process(), args.dtype)
    hf = build_hf(cfg, dtype).to(device).train()
    hf.load_state_dict(ours.state_dict())
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def ours_step():
        ours(inputs, labels).backward()
        ours_opt.step(1e-4)
        ours_opt.zero_grad()

    def hf_step():
        logits = hf(input_ids=inputs).logits
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), labels.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)

    times = {"trilith": [], "transformers": []}
    for i in range(args.warmup + args.steps):
        for name, step in (("trilith", ours_step), ("transformers", hf_step)):
            sync()
            start = time.perf_counter()
            step()
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    tokens_per_step = args.batch * args.seq
    rate = {k: tokens_per_step / statistics.median(v) for k, v in times.items()}
    print(f"shape: hidden {args.hidden}, layers {args.layers}, heads {args.heads}/{args.kv_heads} kv, seq {args.seq}, "
          f"batch {args.batch}, {args.dtype} on {device}")
    print(f"trilith       {rate['trilith']:>12,.0f} tokens/s")
    print(f"transformers  {rate['transformers']:>12,.0f} tokens/s")
    print(f"ratio trilith/transformers: {rate['trilith'] / rate['transformers']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
