"""Continue prompts with a Trilith checkpoint (full or light, saved at any layout) or a Hugging Face directory.

    python tools/generate.py --model runs/x/checkpoints --prompt "def " --max-new-tokens 48
    python tools/generate.py --model demo_out/hf --prompt "import " --temperature 0.8 --top-p 0.95 --seed 3

The weights are assembled into one whole model on this process (engine/checkpoint/model_source.py) and continued
with a KV cache (engine/evaluate/generate.py, what the training diary uses): each new token costs one position's
forward. Generation stops at --max-new-tokens, at the end-of-document token, or at the model's length.
Prints one JSON object per prompt: {"prompt", "text", "tokens"}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.checkpoint.files import CheckpointError  # noqa: E402
from engine.checkpoint.model_source import ModelSource, load_single_model  # noqa: E402
from engine.evaluate.generate import Sampling, generate  # noqa: E402
from engine.evaluate.text_tokenizer import TextTokenizer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/generate.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint, checkpoints directory or Hugging Face directory")
    ap.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    ap.add_argument("--tokenizer", default="", help="tokenizer.json (default: the model's own)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--no-cache", action="store_true", help="recompute the whole sequence per token (checks)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    try:
        sampling.check()
        source = ModelSource(args.model)
        try:
            tokenizer = TextTokenizer(args.tokenizer or source.tokenizer, "--tokenizer")
            eod = source.eod_id
            model = load_single_model(source, args.device, DTYPES[args.dtype])
        finally:
            source.close()
        for prompt in args.prompt:
            new = generate(model, tokenizer.encode(prompt), sampling, eod, use_cache=not args.no_cache)
            print(json.dumps({"prompt": prompt, "text": tokenizer.decode(new), "tokens": new}))
    except (ValueError, CheckpointError) as exc:  # bad sampling values, tokenizer or model directory
        print(f"generate: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
