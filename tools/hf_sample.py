"""Load an exported Hugging Face directory with transformers and print a short generated sample.

    python tools/hf_sample.py --model-dir demo_out/hf --prompt "def main(" --max-new-tokens 40
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=True, top_k=20, temperature=0.8,
                             pad_token_id=tokenizer.pad_token_id or 0)
    print("---- sample " + "-" * 50)
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    print("-" * 62)
    return 0


if __name__ == "__main__":
    sys.exit(main())
