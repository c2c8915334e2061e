"""Time tools/preprocess_data.py against a plain one-document-at-a-time `tokenizers` loop.

    python tools/bench_preprocess.py --input corpus.jsonl --tokenizer-model tok/tokenizer.json

Both run in this process's run on the same corpus: Trilith as a subprocess (whole-job wall time,
start-up included) and the plain loop in-process (`tokenizer.encode(text).ids` + EOD per
document). The outputs are compared token for token, then both times and the ratio are printed.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from data.indexed import IndexedDataset  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="a JSONL corpus with a 'text' key")
    p.add_argument("--tokenizer-model", required=True, help="a Hugging Face tokenizer.json")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(args.tokenizer_model)
    eod = tok.token_to_id("<|endoftext|>")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "bench")
        start = time.time()
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                        "--input", args.input, "--output-prefix", prefix, "--tokenizer-model",
                        args.tokenizer_model, "--append-eod", "--workers", str(args.workers), "--quiet"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        trilith = time.time() - start
        ds = IndexedDataset(prefix + "_text_document")
        start = time.time()
        plain = []
        with open(args.input, encoding="utf-8") as f:
            for line in f:
                text = json.loads(line).get("text") if line.strip() else None
                if isinstance(text, str) and text.strip():
                    plain.append(tok.encode(text).ids + ([eod] if eod is not None else []))
        baseline = time.time() - start
        identical = len(plain) == len(ds) and all(np.array_equal(ds[i], ids) for i, ids in enumerate(plain))
    tokens = sum(map(len, plain))
    print(f"documents {len(plain):,}, tokens {tokens:,}")
    print(f"plain per-document encode loop: {baseline:.2f} s")
    print(f"trilith preprocess ({args.workers} workers, whole process): {trilith:.2f} s")
    print(f"speed-up: {baseline / trilith:.2f}x; outputs identical: {identical}")
    if not identical:
        raise SystemExit("bench_preprocess: outputs differ")


if __name__ == "__main__":
    main()
