"""Trace training samples back to the raw corpus: which documents, which source file and line, what text.

    python tools/trace_sample.py --run-dir demo_out/run --sample 1234          # one global sample
    python tools/trace_sample.py --run-dir demo_out/run --step 17              # every sample of step 17
    python tools/trace_sample.py --run-dir demo_out/run --sample 1234 --json   # machine-readable

The run directory's config.yaml gives the datasets, sequence length, seed, split and batch sizes, so the
samples are rebuilt exactly as the run read them (global step k reads samples [(k-1)·G, k·G) with G the
global batch). For each sample it prints every document piece (dataset, document, token offset and
count), the source file and line that preprocess_data recorded (the raw line when the corpus went through
curate_data), the start of that record's text, and the sample's own tokens decoded with data.tokenizer.
The report that the training monitor writes for a NaN step (run.dir/nonfinite/) names these indices.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.offline.corpus_io import CorpusError, iter_records, parse_record  # noqa: E402
from engine.batch_ramp import samples_after  # noqa: E402
from engine.config.schema import ConfigError, load_config  # noqa: E402
from engine.train import build_split_datasets  # noqa: E402

PREVIEW_CHARS = 200
NAME_FIELDS = ("path", "url", "id", "title")  # a raw record's own name for itself, when it has one


def source_record(path: str, line: int) -> dict | None:
    """The record at 1-based `line` (row for Parquet/Arrow) of a corpus file, or None if it is gone."""
    if not Path(path).is_file():
        return None
    for _, number, payload in iter_records([path], ["text"], all_fields=True):
        if number == line:
            return parse_record(payload)
        if number > line:
            break
    return None


def describe(dataset, index: int, decode) -> dict:
    from data.loader import sample_provenance
    pieces = sample_provenance(dataset, index)
    for piece in pieces:
        record = source_record(piece["source_file"], piece["line"]) if piece["source_file"] else None
        record = record if isinstance(record, dict) else {}
        text = record.get("text")
        piece["source_text"] = text[:PREVIEW_CHARS] if isinstance(text, str) else None
        piece["source_name"] = next((str(record[k]) for k in NAME_FIELDS if k in record), None)
    tokens = dataset[index % len(dataset)].tolist()
    return {"sample": index, "pieces": pieces, "tokens": len(tokens),
            "text": decode(tokens)[:PREVIEW_CHARS] if decode else None}


def tokenizer_decoder(path: str):
    """tokens -> text with data.tokenizer (tokenizer.json or SentencePiece .model), or None without one."""
    if not path or not Path(path).is_file():
        return None
    if path.endswith(".model"):
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=path)
        return lambda ids: sp.decode(ids)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(path)
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def print_sample(info: dict) -> None:
    print(f"sample {info['sample']} ({info['tokens']} tokens)")
    for p in info["pieces"]:
        where = f"{p['source_file']} line {p['line']}" if p["source_file"] else "no provenance map"
        print(f"  document {p['document']} of {p['dataset']}, tokens {p['token_offset']}..."
              f"{p['token_offset'] + p['num_tokens']}: {where}")
        if p["source_name"] is not None:
            print(f"    record: {p['source_name']}")
        if p["source_text"] is not None:
            print(f"    source: {p['source_text']!r}")
    if info["text"] is not None:
        print(f"  as trained: {info['text']!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, help="the run's directory (run.dir), holding config.yaml")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--sample", type=int, nargs="+", help="global sample indices")
    what.add_argument("--step", type=int, help="every sample of this training step (1-based)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per sample")
    args = ap.parse_args(argv)
    config = Path(args.run_dir) / "config.yaml"
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        raise SystemExit(f"trace_sample: {exc} (the run directory's config.yaml is written when a run starts)")
    if cfg.data.mock:
        raise SystemExit(f"trace_sample: {config} trains on synthetic tokens (data.mock=true): nothing to trace")
    if args.step is not None and args.step < 1:
        raise SystemExit(f"trace_sample: --step {args.step} must be at least 1")
    # a step's samples, also while train.batch_size_ramp grows the batch
    indices = args.sample if args.sample is not None else range(samples_after(cfg.train, args.step - 1),
                                                                samples_after(cfg.train, args.step))
    try:
        dataset = build_split_datasets(cfg)["train"]
    except ConfigError as exc:
        raise SystemExit(f"trace_sample: {exc}")
    decode = tokenizer_decoder(cfg.data.tokenizer)
    for index in indices:
        if index < 0:
            raise SystemExit(f"trace_sample: sample {index} is negative")
        try:
            info = describe(dataset, index, decode)
        except CorpusError as exc:  # the raw file behind the sample is damaged: named, not a traceback
            raise SystemExit(f"trace_sample: {exc}")
        if args.json:
            print(json.dumps(info, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
        else:
            print_sample(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
