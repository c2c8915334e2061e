"""Corpus -> tokenized MMIDIDX shards (`<prefix>_<key>_document.bin/.idx`), Megatron-LM compatible.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/tokenizer.json \\
        --append-eod --workers 2 [--compression zstd]
    python tools/preprocess_data.py merge --inputs a_text_document b_text_document \\
        --output-prefix all_text_document [--compression zstd|none]

`--compression zstd` writes the tokens as zstd-compressed Arrow blocks (`.arrow` instead of `.bin`, same
`.idx`; see data/indexed.py); `merge` of a single input converts a dataset between the two kinds.

`--append-eod` ends every document with the tokenizer's own `eos_token` (its tokenizer_config.json, or a
SentencePiece model's eos id): the id Megatron-LM appends. `--eod-token TOKEN_OR_ID` chooses another; use the
same id as `data.eod_token_id` in training if you do (data/eod.py).

Flag names follow Megatron-LM's tools/preprocess_data.py. Bad records are skipped, counted by
reason and written to a rejects file (`--strict` stops at the first one). Outputs appear only when
complete, with a provenance map (`.prov.npz`) from document index to source file and line: the raw
file and line named by a record's `source_file`/`source_line` (as tools/curate_data.py writes them),
else the input file's own.

On a cluster: N array tasks (`--num-shards N`, the task's index from `--shard-index` or
$SLURM_ARRAY_TASK_ID), then `--num-shards N --merge-shards`: the single-process dataset, byte for byte;
launch/run_data_job.sh submits both (data/offline/shards.py).
"""
import argparse
import collections
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from data.indexed import (COMPRESSIONS, DEFAULT_BLOCK_TOKENS, IndexedDataset, IndexedDatasetBuilder,  # noqa: E402
                          compressed_path, dataset_paths, token_dtype, token_files)
from data.provenance import merge_provenance, write_provenance  # noqa: E402
from data.offline.corpus_io import (REJECT_REASONS, CorpusError, RecordError, add_input_arguments,  # noqa: E402
                              expand_inputs, iter_records, parse_record, record_origin, record_texts,
                              refuse_overwriting, shard_ranges)
from data.offline.encoder import eod_token_id, load_encoder, tokenizer_spec  # noqa: E402
from data.offline.workers import WorkerDied, batched, ordered_map  # noqa: E402
from data.offline.shards import (add_shard_arguments, all_markers, describe_inputs, finished, resolve_shard,  # noqa: E402
                           settings, shard_name, write_marker)

REPORT_FIRST = 5  # rejects printed with file:line; all of them go to the rejects file
# A worker task ends at --batch-size documents or this many input bytes: many short documents share a task's
# hand-over cost, and long ones are not copied between processes in blocks of megabytes.
TASK_BYTES = 1 << 20

_worker = {}
# (spec, use_cache, use_engine, use_context_cuts) -> the encoder main() loaded: forked workers start from it,
# unparsed again
_loaded = {}


def _init_worker(spec, keys, use_cache, eod_id, use_engine=True, use_context_cuts=False):
    options = (use_cache, use_engine, use_context_cuts)
    encoder = _loaded.get((spec, *options))
    _worker.update(encoder=load_encoder(spec, *options) if encoder is None else encoder, keys=keys, eod=eod_id)


def _payload_bytes(record):
    payload = record[2]
    return len(payload) if isinstance(payload, bytes) else 0


def _encode_task(records):
    """Parse and tokenize one batch of records; returns tokens per key, kept sources and rejects.

    A kept source is (input file index, line), or (raw file name, line) for a curated record."""
    keys, encoder, eod = _worker["keys"], _worker["encoder"], _worker["eod"]
    kept, rejects, texts, nbytes = [], [], [[] for _ in keys], 0
    for file_index, line, payload in records:
        nbytes += len(payload) if isinstance(payload, bytes) else 0
        try:
            record = parse_record(payload)
            values = record_texts(record, keys)
        except RecordError as e:
            rejects.append((file_index, line, e.reason, str(e)))
            continue
        kept.append(record_origin(record) or (file_index, line))
        for column, text in zip(texts, values):
            column.append(text)
    per_key = [encoder.encode_flat(column, eod) for column in texts]
    return kept, rejects, per_key, nbytes, encoder.cache_reason, encoder.engine_reason if encoder.cached else None


class _Progress:
    """One status line on stderr: documents, tokens and input bytes, each per second."""

    def __init__(self, quiet):
        self.quiet, self.start, self.last = quiet, time.time(), 0.0
        self.tty = sys.stderr.isatty()

    def update(self, docs, tokens, nbytes, force=False):
        now = time.time()
        if self.quiet or (not force and now - self.last < (0.5 if self.tty else 10.0)):
            return
        self.last = now
        dt = max(now - self.start, 1e-9)
        line = (f"{docs:,} docs ({docs / dt:,.0f}/s)  {tokens:,} tokens ({tokens / dt:,.0f}/s)  "
                f"{nbytes / 1e6:,.1f} MB ({nbytes / 1e6 / dt:,.1f} MB/s)")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr,
              flush=True)

    def done(self):
        if self.tty and not self.quiet:
            print(file=sys.stderr)


class _SourceTable:
    """Ids of the provenance map's source files: the input files, then raw files that curated
    records name, added as they appear."""

    def __init__(self, files):
        self.names = list(files)
        self.ids = {name: i for i, name in enumerate(self.names)}

    def id(self, source):
        if isinstance(source, int):
            return source
        found = self.ids.get(source)
        if found is None:
            found = self.ids[source] = len(self.names)
            self.names.append(source)
        return found


def output_prefix(prefix, key):
    return f"{prefix}_{key}_document"


def preprocess(args, files, prefix, spec, vocab_size, eod, ranges=None, rejects_path=None):
    """Tokenize `files` (an array task: its `ranges` of them) into `<prefix>_<key>_document`; returns
    (counters, rejects file or None)."""
    dtype = token_dtype(vocab_size)
    builders = {k: IndexedDatasetBuilder(output_prefix(prefix, k), dtype, args.compression, args.block_tokens)
                for k in args.json_keys}
    rejects_path = rejects_path or args.rejects or prefix + "_rejects.jsonl"
    rejects_out = None
    stats = collections.Counter()
    sources, prov_file, prov_line = _SourceTable(files), [], []
    progress = _Progress(args.quiet)
    try:
        batches = batched(iter_records(files, args.json_keys, max_record_bytes=args.max_record_bytes,
                                       ranges=ranges), args.batch_size, TASK_BYTES, _payload_bytes)
        init_args = (spec, args.json_keys, not args.no_cache, eod, not args.no_fast_engine, args.context_cuts)
        for kept, rejects, per_key, nbytes, cache_off, engine_off in ordered_map(_encode_task, batches, args.workers,
                                                                                 _init_worker, init_args):
            # What the workers did, not what this process planned: a self-check may turn the cache off.
            stats["batches"] += 1
            stats["batches_cached" if cache_off is None else f"cache_off:{cache_off}"] += 1
            if cache_off is None:
                stats["batches_engine" if engine_off is None else f"engine_off:{engine_off}"] += 1
            for file_index, line, reason, detail in rejects:
                where = f"{files[file_index]}:{line}"
                if args.strict:
                    raise SystemExit(f"preprocess: {where}: {reason}: {detail} (--strict; drop "
                                     f"--strict to skip and count bad records instead)")
                if sum(stats[r] for r in REJECT_REASONS) < REPORT_FIRST:
                    print(f"preprocess: skipping {where}: {reason}: {detail}", file=sys.stderr)
                stats[reason] += 1
                if rejects_out is None:
                    rejects_out = open(rejects_path + ".tmp", "w", encoding="utf-8")
                rejects_out.write(json.dumps({"file": files[file_index], "line": line,
                                              "reason": reason, "detail": detail}) + "\n")
            for key, (lengths, tokens) in zip(args.json_keys, per_key):
                builders[key].add_documents(tokens, lengths)
                stats["tokens_" + key] += int(tokens.size)
            prov_file.extend(sources.id(f) for f, _ in kept)
            prov_line.extend(line for _, line in kept)
            stats["documents"] += len(kept)
            stats["bytes"] += nbytes
            progress.update(stats["documents"], sum(stats["tokens_" + k] for k in args.json_keys),
                            stats["bytes"])
        progress.update(stats["documents"], sum(stats["tokens_" + k] for k in args.json_keys),
                        stats["bytes"], force=True)
        progress.done()
        for builder in builders.values():
            builder.finalize()
        for key in args.json_keys:
            write_provenance(output_prefix(prefix, key), sources.names, prov_file, prov_line)
    except BaseException:
        for builder in builders.values():
            builder.abort()
        if rejects_out is not None:
            rejects_out.close()
            os.remove(rejects_path + ".tmp")
        raise
    if rejects_out is not None:
        rejects_out.close()
        os.replace(rejects_path + ".tmp", rejects_path)
    elif os.path.exists(rejects_path):
        os.remove(rejects_path)  # a stale file from an earlier run would be misleading
    return stats, (rejects_path if rejects_out is not None else None)


def merge(prefixes, output, compression="none", block_tokens=DEFAULT_BLOCK_TOKENS):
    """Concatenate datasets (same token dtype, either kind) into one, with their provenance maps."""
    if not prefixes:
        raise SystemExit("merge: give --inputs PREFIX [PREFIX ...]")
    refuse_overwriting(dataset_files(output), [path for p in prefixes for path in token_files(p)])
    dtype = IndexedDataset(prefixes[0]).dtype
    builder = IndexedDatasetBuilder(output, dtype, compression, block_tokens)
    try:
        for p in prefixes:
            builder.add_index(p)
        builder.finalize()
    except BaseException:
        builder.abort()
        raise
    merge_provenance(prefixes, output)


def _merge_main(argv):
    p = argparse.ArgumentParser(prog="preprocess_data.py merge",
                                description="Concatenate datasets into one (one input: convert its kind)")
    p.add_argument("--inputs", nargs="+", required=True, help="dataset prefixes, in order")
    p.add_argument("--output-prefix", required=True, help="prefix of the merged dataset")
    add_compression_arguments(p)
    args = p.parse_args(argv)
    try:
        merge(args.inputs, args.output_prefix, args.compression, args.block_tokens)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"merge: {e}")
    print(f"merged {len(args.inputs)} datasets -> {describe_output(args.output_prefix)}")


def add_compression_arguments(p):
    p.add_argument("--compression", choices=COMPRESSIONS, default="none",
                   help="zstd: tokens in zstd-compressed Arrow blocks (.arrow) instead of a plain .bin")
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS,
                   help="tokens per compressed block (the unit a read decodes)")


def dataset_files(prefix):
    """Every file a dataset written at `prefix` may create or replace."""
    return (*dataset_paths(prefix), compressed_path(prefix), prefix + ".prov.npz")


def describe_output(prefix):
    """The files of a dataset for a summary line; a compressed one with its compression ratio."""
    dataset = IndexedDataset(prefix)
    if not dataset.compressed:
        return f"{prefix}.bin/.idx"
    raw = dataset.num_tokens * dataset.dtype.itemsize
    size = os.path.getsize(compressed_path(prefix))
    return (f"{prefix}.arrow/.idx ({size / 1e6:,.2f} MB for {raw / 1e6:,.2f} MB of {dataset.dtype} tokens: "
            f"{raw / max(size, 1):.2f}:1)")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    add_input_arguments(g, "keys to tokenize (default: text)")
    g.add_argument("--split-sentences", action="store_true", help="not supported (see --help)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None,
                   help="HuggingFaceTokenizer, SentencePieceTokenizer or GPT2BPETokenizer "
                        "(default: from --tokenizer-model's extension)")
    g.add_argument("--tokenizer-model", help="tokenizer.json (or its directory) or SentencePiece .model")
    g.add_argument("--vocab-file", help="GPT-2 vocab.json (GPT2BPETokenizer)")
    g.add_argument("--merge-file", help="GPT-2 merges.txt (GPT2BPETokenizer)")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token: --eod-token, else the tokenizer's eos_token")
    g.add_argument("--eod-token", help="--append-eod: this token (its text or id) instead of the eos_token")
    g.add_argument("--no-cache", action="store_true", help="disable the exact chunk cache")
    g.add_argument("--no-fast-engine", action="store_true",
                   help="encode the cache's misses with tokenizers, not tiktoken (byte-level BPE only)")
    g.add_argument("--context-cuts", action="store_true",
                   help="cut the cache's misses into pieces wherever no token occurs across (in runs of CJK letters "
                        "for byte-level BPE), not only between characters no merge joins (Llama 2 layout)")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx (.arrow/.idx)")
    g.add_argument("--rejects", help="rejects file (default: <prefix>_rejects.jsonl)")
    g.add_argument("--strict", action="store_true", help="stop at the first bad record")
    add_compression_arguments(g)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="worker processes")
    g.add_argument("--partitions", type=int, default=1,
                   help="process the input files in this many groups, then merge them")
    g.add_argument("--keep-partitions", action="store_true", help="keep per-partition datasets")
    g.add_argument("--batch-size", type=int, default=256,
                   help="documents per worker task, at most (a task also ends at 1 MB of input)")
    g.add_argument("--log-interval", type=int, default=None, help="accepted for Megatron compatibility")
    g.add_argument("--quiet", action="store_true", help="no progress line")
    g = p.add_argument_group("array jobs (data/offline/shards.py; launch/run_data_job.sh submits them)")
    add_shard_arguments(g)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        return _merge_main(argv[1:])
    p = build_parser()
    args = p.parse_args(argv)
    if args.split_sentences:
        p.error("--split-sentences is not supported: Trilith trains on whole documents")
    if min(args.workers, args.batch_size, args.partitions, args.block_tokens, args.max_record_bytes) < 1:
        p.error("--workers, --batch-size, --partitions, --block-tokens and --max-record-bytes must be at least 1")
    resolve_shard(args, p)
    if args.num_shards is not None and args.partitions > 1:
        p.error("--partitions and --num-shards both split the input: use one")
    start = time.time()
    try:
        files = expand_inputs(args.input)
        spec = tokenizer_spec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    options = (not args.no_cache, not args.no_fast_engine, args.context_cuts)
    encoder = _loaded[(spec, *options)] = load_encoder(spec, *options)
    if hasattr(encoder, "prepare"):
        encoder.prepare()  # once here: forked workers inherit what encoding a miss needs
    if args.eod_token is not None and not args.append_eod:
        p.error("--eod-token is the token --append-eod appends; add --append-eod")
    eod = None
    if args.append_eod:
        try:
            eod = eod_token_id(encoder, args.eod_token, args.tokenizer_type, args.tokenizer_model)
        except (OSError, ValueError) as e:
            p.error(f"--append-eod: {e}")
    if args.partitions > len(files):
        p.error(f"--partitions {args.partitions} exceeds the {len(files)} input files; "
                f"partitions split the file list")
    prefixes = [args.output_prefix] + [f"{args.output_prefix}_part{i}" for i in range(args.partitions)]
    try:
        refuse_overwriting([args.rejects or prefix + "_rejects.jsonl" for prefix in prefixes]
                           + [path for prefix in prefixes for key in args.json_keys
                              for path in dataset_files(output_prefix(prefix, key))], files)
    except ValueError as e:
        p.error(str(e))
    try:
        if args.num_shards is not None and not args.merge_shards:
            return _run_task(args, files, spec, encoder, eod, start)
        if args.merge_shards:
            stats, rejects_path = merge_shards(args, files)
        else:
            stats, rejects_path = _run(args, files, spec, encoder, eod)
    except (CorpusError, WorkerDied, ValueError) as e:
        raise SystemExit(f"preprocess: {e}")
    _summary(args, stats, rejects_path, encoder, start)


def shard_prefix(args, index):
    return os.path.join(args.output_prefix + ".shards", shard_name(index, args.num_shards))


def _run_task(args, files, spec, encoder, eod, start):
    """One array task: its part of the corpus into its own dataset beside the output, then its done-marker;
    skipped when an earlier run finished it on the same bytes and settings."""
    part = shard_prefix(args, args.shard_index)
    ranges = shard_ranges(files, args.shard_index, args.num_shards)
    inputs, options = describe_inputs(files, ranges), settings(args)
    name = os.path.basename(part)
    if finished(part + ".done.json", inputs, options):
        print(f"preprocess: {name} already done on the same inputs and settings; skipped")
        return False
    os.makedirs(os.path.dirname(part), exist_ok=True)
    if os.path.exists(part + ".done.json"):
        os.remove(part + ".done.json")
    stats, _ = preprocess(args, files, part, spec, encoder.vocab_size, eod, ranges, part + "_rejects.jsonl")
    write_marker(part + ".done.json", {"inputs": inputs, "settings": options, "counts": dict(stats)})
    print(f"preprocess: {name} done in {time.time() - start:.1f} s ({stats['documents']:,} documents)")
    return True


def merge_shards(args, files):
    """After all array tasks: their datasets concatenated in order (the single-process output, byte for byte)
    and their rejects; returns (counters, rejects file or None)."""
    parts = [shard_prefix(args, i) for i in range(args.num_shards)]
    markers = all_markers([part + ".done.json" for part in parts], files, settings(args))
    stats = collections.Counter()
    for marker in markers:
        stats.update(marker["counts"])
    for key in args.json_keys:
        merge([output_prefix(part, key) for part in parts], output_prefix(args.output_prefix, key),
              args.compression, args.block_tokens)
    rejects_path = _join_rejects(args, [part + "_rejects.jsonl" for part in parts])
    shutil.rmtree(args.output_prefix + ".shards")
    return stats, rejects_path


def _join_rejects(args, paths):
    """The parts' rejects files, those that exist, concatenated in order into the run's rejects file (or the
    run's stale one removed); returns its path, or None when nothing was rejected."""
    rejects_path = args.rejects or args.output_prefix + "_rejects.jsonl"
    found = [path for path in paths if os.path.exists(path)]
    if not found:
        if os.path.exists(rejects_path):
            os.remove(rejects_path)  # a stale file from an earlier run would be misleading
        return None
    with open(rejects_path + ".tmp", "wb") as out:
        for path in found:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out)
    os.replace(rejects_path + ".tmp", rejects_path)
    return rejects_path


def _run(args, files, spec, encoder, eod):
    """Preprocess `files` in args.partitions groups, merged into one dataset; returns (counters, rejects)."""
    if args.partitions == 1:
        stats, rejects_path = preprocess(args, files, args.output_prefix, spec, encoder.vocab_size, eod)
    else:
        stats = collections.Counter()
        bounds = np.linspace(0, len(files), args.partitions + 1).astype(int)
        parts = [f"{args.output_prefix}_part{i}" for i in range(args.partitions)]
        for i, part in enumerate(parts):
            part_stats, _ = preprocess(args, files[bounds[i]:bounds[i + 1]], part, spec, encoder.vocab_size, eod,
                                       rejects_path=part + "_rejects.jsonl")
            stats.update(part_stats)
        rejects_path = _join_rejects(args, [part + "_rejects.jsonl" for part in parts])
        if not args.keep_partitions:
            for part in parts:
                if os.path.exists(part + "_rejects.jsonl"):
                    os.remove(part + "_rejects.jsonl")
        for key in args.json_keys:
            merge([output_prefix(part, key) for part in parts], output_prefix(args.output_prefix, key),
                  args.compression, args.block_tokens)
            if not args.keep_partitions:
                for part in parts:
                    for path in (*token_files(output_prefix(part, key)), output_prefix(part, key) + ".prov.npz"):
                        os.remove(path)
    return stats, rejects_path


def _cuts(encoder):
    """The cut rule the workers used, and for the whitespace-run layout and byte-level BPE whether new chunks were
    cut into pieces."""
    cuts = f"{encoder.rule.name if encoder.rule else 'chunk'} cuts"
    if encoder.rule is None or encoder.piece_reason == "not a layout with pieces":
        return cuts
    if encoder.cutter is None:
        return cuts + f"; no pieces: {encoder.piece_reason}"
    return cuts + ", new chunks in pieces" + (" where no token spans" if encoder.cutter.context else "")


def _cache_use(stats, encoder):
    """Whether the workers encoded through the chunk cache, from their own reports per batch."""
    off = sorted(key.split(":", 1)[1] for key in stats if key.startswith("cache_off:") and stats[key])
    cached, batches = stats["batches_cached"], stats["batches"]
    if not batches:
        return f"cache {'on' if encoder.cached else 'off: ' + str(encoder.cache_reason)} (no documents)"
    if cached == batches:
        return f"cache on ({_cuts(encoder)}) in all {batches:,} batches; {_engine_use(stats)}"
    if not cached:
        return f"cache off: {'; '.join(off)}"
    return f"cache on in {cached:,} of {batches:,} batches, off in the others: {'; '.join(off)}"


def _engine_use(stats):
    """Whether the cache's misses went to tiktoken (data/offline/fast_bpe.py), from the workers' reports."""
    off = sorted(key.split(":", 1)[1] for key in stats if key.startswith("engine_off:") and stats[key])
    used, cached = stats["batches_engine"], stats["batches_cached"]
    if used == cached:
        return "misses by tiktoken"
    if not used:
        return f"misses by tokenizers (tiktoken off: {'; '.join(off)})"
    return f"misses by tiktoken in {used:,} of {cached:,} cached batches (off in the others: {'; '.join(off)})"


def _summary(args, stats, rejects_path, encoder, start):
    elapsed = time.time() - start
    skipped = {r: stats[r] for r in REJECT_REASONS if stats[r]}
    tokens = sum(stats["tokens_" + k] for k in args.json_keys)
    print(f"preprocess: {stats['documents']:,} documents, {tokens:,} tokens, "
          f"{stats['bytes'] / 1e6:,.1f} MB in {elapsed:.1f} s "
          f"({stats['bytes'] / 1e6 / max(elapsed, 1e-9):,.1f} MB/s); "
          f"skipped {sum(skipped.values())}" + (f" {skipped}" if skipped else "") + "; " + _cache_use(stats, encoder))
    for key in args.json_keys:
        print(f"  wrote {describe_output(output_prefix(args.output_prefix, key))} and .prov.npz")
    if rejects_path:
        print(f"  rejects: {rejects_path}")


if __name__ == "__main__":
    main()
