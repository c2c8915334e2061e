"""Time tools/preprocess_data.py against a plain one-document-at-a-time `tokenizers` loop.

    python tools/bench_preprocess.py --input corpus.jsonl --tokenizer-model tok/tokenizer.json
    python tools/bench_preprocess.py --input corpus.jsonl --families gpt2 llama3 metaspace

With --families, a tokenizer of each family is trained here on the corpus's first documents (no download):
GPT-2 (ByteLevel), Llama-3-style (regex Split + ByteLevel, a BOS template) and Metaspace (Llama 2 / Mistral:
"▁" for spaces, byte fallback, a BOS template). For each tokenizer, Trilith runs as a subprocess (whole-job
wall time, start-up included) and the plain loop in-process (`tokenizer.encode(text).ids` + EOD per
document); the outputs are compared token for token, then both times, the ratio and whether the workers
used the chunk cache (the tool's own summary) are printed.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from data.indexed import IndexedDataset  # noqa: E402
from tools._chunk_rules import SPLIT_PATTERNS  # noqa: E402

FAMILIES = ("gpt2", "llama3", "metaspace")
EOD = {"gpt2": "<|endoftext|>", "llama3": "<|end_of_text|>", "metaspace": "</s>"}


def build_family(family, texts, vocab_size, path):
    """Train a tokenizer.json of `family` on `texts` into `path`; returns its end-of-document token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    if family == "metaspace":
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
        # Trained on whitespace-split words, as SentencePiece does; encoded as one piece, as Llama 2's is.
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
        specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        alphabet = []
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if family == "gpt2" else
                             pre_tokenizers.Sequence([
                                 pre_tokenizers.Split(Regex(SPLIT_PATTERNS[0]), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
        specials = ["<|endoftext|>"] if family == "gpt2" else ["<|begin_of_text|>", "<|end_of_text|>"]
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if family == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    bos = {"llama3": "<|begin_of_text|>", "metaspace": "<s>"}.get(family)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(path)
    return EOD[family]


def read_texts(path, limit=None):
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line).get("text") if line.strip() else None
            if isinstance(text, str) and text.strip():
                texts.append(text)
                if limit and len(texts) == limit:
                    break
    return texts


def bench(corpus, tokenizer_path, eod_token, workers, tmp):
    """(documents, tokens, plain seconds, Trilith seconds, identical, Trilith's cache report, plain CPU seconds,
    Trilith CPU seconds: on a shared machine the CPU times say more than the wall times)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_path)
    eod = tok.token_to_id(eod_token) if eod_token else None
    prefix = os.path.join(tmp, "bench")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
           "--output-prefix", prefix, "--tokenizer-model", tokenizer_path, "--workers", str(workers), "--quiet"]
    if eod is not None:
        cmd += ["--append-eod", "--eod-token", eod_token]
    start, cpu = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    trilith = time.time() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    trilith_cpu = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    cache = done.stdout.split("; ")[-1].splitlines()[0]
    ds = IndexedDataset(prefix + "_text_document")
    start, cpu = time.time(), time.process_time()
    plain = [tok.encode(text).ids + ([eod] if eod is not None else []) for text in read_texts(corpus)]
    baseline, baseline_cpu = time.time() - start, time.process_time() - cpu
    identical = len(plain) == len(ds) and all(np.array_equal(ds[i], ids) for i, ids in enumerate(plain))
    for path in os.listdir(tmp):
        if path.startswith("bench"):
            os.remove(os.path.join(tmp, path))
    return len(plain), sum(map(len, plain)), baseline, trilith, identical, cache, baseline_cpu, trilith_cpu


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="a JSONL corpus with a 'text' key")
    p.add_argument("--tokenizer-model", help="a Hugging Face tokenizer.json")
    p.add_argument("--eod-token", default="<|endoftext|>", help="with --tokenizer-model: the token appended")
    p.add_argument("--families", nargs="+", choices=FAMILIES, help="train and time these tokenizer families")
    p.add_argument("--vocab-size", type=int, default=8000, help="--families: vocabulary size")
    p.add_argument("--train-docs", type=int, default=300, help="--families: documents to train on")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    if bool(args.tokenizer_model) == bool(args.families):
        p.error("give --tokenizer-model or --families")
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("given", args.tokenizer_model, args.eod_token)] if args.tokenizer_model else []
        for family in args.families or ():
            path = os.path.join(tmp, f"{family}.json")
            runs.append((family, path, build_family(family, read_texts(args.input, args.train_docs),
                                                    args.vocab_size, path)))
        for name, path, eod in runs:
            docs, tokens, baseline, trilith, identical, cache, baseline_cpu, trilith_cpu = bench(
                args.input, path, eod, args.workers, tmp)
            print(f"{name}: {docs:,} documents, {tokens:,} tokens; plain per-document encode {baseline:.2f} s "
                  f"({baseline_cpu:.2f} s CPU); trilith preprocess ({args.workers} workers, whole process) "
                  f"{trilith:.2f} s ({trilith_cpu:.2f} s CPU); speed-up {baseline / trilith:.2f}x "
                  f"(CPU {baseline_cpu / max(trilith_cpu, 1e-9):.2f}x); outputs identical: {identical}; {cache}",
                  flush=True)
            if not identical:
                failed.append(name)
    if failed:
        raise SystemExit(f"bench_preprocess: outputs differ for {', '.join(failed)}")


if __name__ == "__main__":
    main()
