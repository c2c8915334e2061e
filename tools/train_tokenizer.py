"""Train a tokenizer for Trilith: byte-level BPE (`tokenizers`, default) or SentencePiece.

    python tools/train_tokenizer.py --input corpus.jsonl --output-dir tok --vocab-size 32000

Special tokens <|endoftext|> (end of document) and <|pad|> come first, then --reserved-tokens
control slots <|reserved_0|>... . A held-out sample (--holdout-fraction) is kept out of training
and used to report compression (UTF-8 bytes per token) and the unknown-token rate. With --hit-terms
FILE (one domain term per line: product names, abbreviations, idioms), it also reports the token hit
rate, the share of those terms that became one token (as a word inside text, i.e. after a space, or
on its own; healthy above 85%), and the terms that were split.
Writes <output-dir>/tokenizer.json + tokenizer_config.json (BPE: eos_token <|endoftext|>, pad_token <|pad|>)
or tokenizer.model (SentencePiece: eos <|endoftext|>, pad <|pad|>, unk <unk>, no bos), and report.json.
"""
import argparse
import fnmatch
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from data.offline.corpus_io import (CorpusError, RecordError, expand_inputs, extract_texts, iter_records,  # noqa: E402
                              refuse_overwriting)

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
# C0/C1 control characters except tab, newline and carriage return, which carry layout.
CONTROL_PATTERN = "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]"


def parse_source_weights(items):
    weights = []
    for item in items or []:
        pattern, sep, value = item.rpartition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not pattern or weight < 0:
            raise ValueError(f"--source-weights entry {item!r} should be PATTERN=WEIGHT with a "
                             f"non-negative weight, e.g. 'web/*=0.55'")
        weights.append((pattern, weight))
    return weights


def source_weight(path, weights):
    for pattern, weight in weights:
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(os.path.basename(path), pattern):
            return weight
    return 1.0


OUTPUT_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tokenizer.vocab", "report.json")


def collect(args):
    """(training texts, held-out texts, skipped count), sampled per the weights and byte budget."""
    files = expand_inputs(args.input)
    refuse_overwriting([os.path.join(args.output_dir, name) for name in OUTPUT_FILES], files)
    weights = parse_source_weights(args.source_weights)
    rng = np.random.RandomState(args.seed)
    train, holdout, skipped = [], [], 0
    for file_index, _, payload in iter_records(files, [args.json_key]):
        try:
            (text,) = extract_texts(payload, [args.json_key])
        except RecordError:
            skipped += 1
            continue
        if rng.random_sample() < args.holdout_fraction:
            holdout.append(text)
            continue
        w = source_weight(files[file_index], weights)
        # Weight w keeps floor(w) copies plus one more with probability frac(w).
        copies = int(w) + (rng.random_sample() < w - int(w))
        train.extend([text] * copies)
    if args.max_train_bytes:
        order = rng.permutation(len(train))
        kept, budget = [], args.max_train_bytes
        for i in order:
            if budget <= 0:
                break
            kept.append(train[i])
            budget -= len(train[i])
        train = kept
    if not train:
        raise SystemExit("train_tokenizer: no training text left; check --input, --json-key, "
                         "--source-weights and --holdout-fraction")
    return train, holdout, skipped


def special_tokens(reserved):
    return SPECIAL_TOKENS + [f"<|reserved_{i}|>" for i in range(reserved)]


def train_bpe(args, texts):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    norms = ([normalizers.NFKC()] if args.nfkc else []) + (
        [normalizers.Replace(Regex(CONTROL_PATTERN), "")] if args.strip_control else [])
    if norms:
        tok.normalizer = normalizers.Sequence(norms)
    # Byte-level with the GPT-2 regex and no prefix space: never an unknown token, and the
    # configuration preprocess_data.py's exact chunk cache accepts.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                                  special_tokens=special_tokens(args.reserved_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    path = os.path.join(args.output_dir, "tokenizer.json")
    tok.save(path)
    # Declares the roles, so preprocessing, training and export read the end of document from the tokenizer
    # itself (data/eod.py), and transformers 4 and 5 load the directory as it is.
    with open(os.path.join(args.output_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": SPECIAL_TOKENS[0],
                   "pad_token": SPECIAL_TOKENS[1], "unk_token": None, "clean_up_tokenization_spaces": False},
                  f, indent=2)
    return path, lambda batch: [e.ids for e in tok.encode_batch(batch)], None


def train_sentencepiece(args, texts):
    import sentencepiece as spm
    import re
    strip = re.compile(CONTROL_PATTERN) if args.strip_control else None

    def lines():
        # SentencePiece learns from sentences; lines are the natural unit of both prose and code.
        for text in texts:
            for line in (strip.sub("", text) if strip else text).splitlines():
                if line.strip():
                    yield line[:4096]

    prefix = os.path.join(args.output_dir, "tokenizer")
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines(), model_prefix=prefix, vocab_size=args.vocab_size,
        model_type=args.type.split("-")[1], character_coverage=args.character_coverage,
        normalization_rule_name="nfkc" if args.nfkc else "identity", byte_fallback=True,
        unk_id=0, bos_id=-1, eos_id=1, pad_id=2, eos_piece=SPECIAL_TOKENS[0], pad_piece=SPECIAL_TOKENS[1],
        user_defined_symbols=special_tokens(args.reserved_tokens)[2:], remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, minloglevel=2,
        input_sentence_size=2_000_000, shuffle_input_sentence=True, num_threads=os.cpu_count() or 1)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    return prefix + ".model", lambda batch: sp.encode(list(batch)), sp.unk_id()


def evaluate(encode, texts, unk_id):
    if not texts:
        return {"holdout_documents": 0}
    ids = encode(texts)
    tokens = sum(len(x) for x in ids)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    unknown = sum(int(np.count_nonzero(np.asarray(x) == unk_id)) for x in ids) if unk_id is not None else 0
    return {"holdout_documents": len(texts), "holdout_bytes": nbytes, "holdout_tokens": tokens,
            "bytes_per_token": nbytes / max(tokens, 1), "unknown_token_rate": unknown / max(tokens, 1)}


def read_terms(path):
    """Domain terms, one per line; blank lines and lines starting with # are ignored."""
    try:
        with open(path, encoding="utf-8") as f:
            terms = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except OSError as e:
        raise ValueError(f"--hit-terms {path}: {e.strerror}") from None
    if not terms:
        raise ValueError(f"--hit-terms {path} holds no terms (one per line)")
    return terms


def term_hits(encode, terms, shown=20):
    """Token hit rate of `terms`: a term hits when it is one token after a space (as inside running text)
    or on its own; the first `shown` misses are listed with their token counts."""
    spaced, bare = encode([" " + t for t in terms]), encode(terms)
    hits = [min(len(a), len(b)) == 1 for a, b in zip(spaced, bare)]
    misses = [{"term": t, "tokens": min(len(a), len(b))} for t, a, b, hit in zip(terms, spaced, bare, hits)
              if not hit]
    return {"hit_terms": len(terms), "token_hit_rate": sum(hits) / len(terms), "term_misses": misses[:shown]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSONL, JSONL.zst or Parquet: files, dirs, globs")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--type", choices=["bpe", "sp-unigram", "sp-bpe"], default="bpe",
                   help="byte-level BPE (tokenizers) or SentencePiece unigram / BPE")
    p.add_argument("--json-key", default="text")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--min-frequency", type=int, default=2, help="BPE: minimum pair frequency to merge")
    p.add_argument("--nfkc", action="store_true", help="NFKC-normalize text (also at encode time)")
    p.add_argument("--strip-control", action="store_true", help="remove control characters except \\t\\n\\r")
    p.add_argument("--reserved-tokens", type=int, default=0, help="number of <|reserved_i|> slots")
    p.add_argument("--source-weights", nargs="*", metavar="PATTERN=WEIGHT",
                   help="sample weight for files matching a glob (default 1), e.g. 'code/*=2'")
    p.add_argument("--holdout-fraction", type=float, default=0.02)
    p.add_argument("--max-train-bytes", type=int, default=None,
                   help="train on a random sample of about this many characters")
    p.add_argument("--character-coverage", type=float, default=0.9995, help="SentencePiece only")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hit-terms", help="file of domain terms (one per line) for the token hit rate")
    args = p.parse_args(argv)
    if args.vocab_size < 260 and args.type == "bpe":
        p.error("--vocab-size must be at least 260 for byte-level BPE (256 bytes + specials)")
    if not 0 <= args.holdout_fraction < 1:
        p.error("--holdout-fraction must be in [0, 1)")
    if args.reserved_tokens < 0:
        p.error("--reserved-tokens must be non-negative")
    start = time.time()
    try:
        train, holdout, skipped = collect(args)
        terms = read_terms(args.hit_terms) if args.hit_terms else []
    except (FileNotFoundError, ValueError, CorpusError) as e:
        p.error(str(e))
    os.makedirs(args.output_dir, exist_ok=True)
    trainer = train_bpe if args.type == "bpe" else train_sentencepiece
    try:
        path, encode, unk_id = trainer(args, train)
    except RuntimeError as e:  # SentencePiece reports bad settings (e.g. vocab too small) this way
        raise SystemExit(f"train_tokenizer: {e}")
    report = {"tokenizer": path, "type": args.type, "vocab_size": args.vocab_size,
              "train_documents": len(train), "skipped_records": skipped,
              "train_seconds": round(time.time() - start, 2), **evaluate(encode, holdout, unk_id),
              **(term_hits(encode, terms) if terms else {})}
    with open(os.path.join(args.output_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(f"tokenizer: {path} ({args.type}, vocab {args.vocab_size}) trained on {len(train)} documents "
          f"in {report['train_seconds']} s")
    if holdout:
        print(f"held-out: {report['holdout_documents']} documents, {report['bytes_per_token']:.2f} "
              f"bytes/token, unknown-token rate {report['unknown_token_rate']:.4%}")
    if terms:
        split = ", ".join(f"{m['term']!r} ({m['tokens']} tokens)" for m in report["term_misses"][:8])
        print(f"token hit rate: {report['token_hit_rate']:.1%} of {len(terms)} terms are one token"
              + (f"; split: {split}" if split else ""))


if __name__ == "__main__":
    main()
