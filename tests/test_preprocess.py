"""tools/preprocess_data.py: MMIDIDX output, exact cache, bad input, formats, merge, provenance."""
import json
import os
import re
import struct

import numpy as np
import pytest

from data.indexed import IndexedDataset
from data.offline.encoder import OTHER_SPACES, SAFE_SPACES, load_encoder, tokenizer_spec
from data.provenance import Provenance
from tests.helpers import write_jsonl
from tools import preprocess_data, train_tokenizer

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "Hello world! It's 2024, isn't it?  Numbers: 3.14159 and 42.\n\n",
    "café naïve résumé — unicode “quotes” 日本語のテキスト 😀 emoji\ttab\r\nwindows",
    "   leading spaces and trailing   \n\n\n",
    "a<|endoftext|>b special token inside",
    "odd spaces:\u00a0nbsp\u2003em\u3000ideographic\x0bvt\x1cfs",
    "x'sy don'T CAN'T we'll 'd ' ' s' 1st 2nd 3rd\u00bd\u2162",
    "self.assertEqual(foo_bar[0], {'k': [1, 2]}) # comment\n" * 3,
    "ﬁne ①② NFKC-sensitive ＡＢＣ",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    corpus = write_jsonl(d / "c.jsonl", [{"text": t} for t in TEXTS * 3])
    train_tokenizer.main(["--input", corpus, "--output-dir", str(d / "bpe"), "--vocab-size", "400",
                          "--min-frequency", "1", "--holdout-fraction", "0"])
    train_tokenizer.main(["--input", corpus, "--output-dir", str(d / "nfkc"), "--vocab-size", "400",
                          "--min-frequency", "1", "--holdout-fraction", "0", "--nfkc", "--strip-control"])
    return {"bpe": str(d / "bpe" / "tokenizer.json"), "nfkc": str(d / "nfkc" / "tokenizer.json")}


def run(tmp_path, tok_path, inputs, *extra, prefix="out"):
    out = str(tmp_path / prefix)
    preprocess_data.main(["--input", *inputs, "--output-prefix", out, "--tokenizer-model", tok_path,
                          "--quiet", *extra])
    return out + "_text_document"


def test_idx_layout_matches_published_mmidx(tmp_path, tok):
    path = run(tmp_path, tok["bpe"], [write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS[:3]])],
               "--append-eod")
    ds = IndexedDataset(path)
    lengths = [len(ds[i]) for i in range(3)]
    # Written by hand from Megatron-LM's indexed_dataset.py: magic, version 1, dtype code 8
    # (uint16), sequence count, document count (documents + 1), int32 lengths, int64 byte
    # pointers, int64 document indices.
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                + struct.pack("<Q", 3) + struct.pack("<Q", 4)
                + struct.pack("<3i", *lengths)
                + struct.pack("<3q", 0, 2 * lengths[0], 2 * (lengths[0] + lengths[1]))
                + struct.pack("<4q", 0, 1, 2, 3))
    assert open(path + ".idx", "rb").read() == expected
    assert os.path.getsize(path + ".bin") == 2 * sum(lengths)


@pytest.mark.parametrize("which", ["bpe", "nfkc"])
@pytest.mark.parametrize("cache", [True, False])
def test_output_identical_to_per_document_encode(tmp_path, tok, which, cache):
    from tokenizers import Tokenizer
    reference = Tokenizer.from_file(tok[which])
    texts = TEXTS + [t[::-1] for t in TEXTS] + ["".join(TEXTS)]
    path = run(tmp_path, tok[which], [write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])],
               "--append-eod", *([] if cache else ["--no-cache"]))
    ds = IndexedDataset(path)
    eod = reference.token_to_id("<|endoftext|>")
    assert len(ds) == len(texts)
    for i, t in enumerate(texts):
        assert ds[i].tolist() == reference.encode(t).ids + [eod]


def test_chunk_cache_is_exact_on_random_text(tok):
    from tokenizers import Tokenizer
    reference = Tokenizer.from_file(tok["bpe"])
    encoder = load_encoder(tokenizer_spec(None, tok["bpe"]))
    assert encoder.cached, encoder.cache_reason
    rng = np.random.RandomState(0)
    alphabet = list("abcXYZ019_.,;:'\"()[]{}#-+=/\\<>|!?é日😀") + list(SAFE_SPACES) * 3 + ["'s", "'ll"]
    texts = ["".join(rng.choice(alphabet, rng.randint(1, 80))) for _ in range(400)]
    out = encoder.encode_batch(texts)
    assert encoder.cached
    for t, ids in zip(texts, out):
        assert ids.tolist() == reference.encode(t).ids, repr(t)


def test_other_spaces_list_is_complete():
    python_spaces = {chr(c) for c in range(0x110000) if chr(c).isspace()}
    assert python_spaces == set(SAFE_SPACES) | set(OTHER_SPACES)


def test_round_trip_text_shards_text_and_provenance(tmp_path, tok):
    from tokenizers import Tokenizer
    reference = Tokenizer.from_file(tok["bpe"])
    texts = ["first document\n", "second one", "third: ünïcödé"]
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    path = run(tmp_path, tok["bpe"], [src], "--workers", "2", "--batch-size", "1")
    ds = IndexedDataset(path)
    assert [reference.decode(ds[i].tolist()) for i in range(len(ds))] == texts
    prov = Provenance(path)
    assert [prov.lookup(i) for i in range(3)] == [(src, 1), (src, 2), (src, 3)]


def test_bad_records_skipped_counted_and_reported(tmp_path, tok, capsys):
    src = tmp_path / "bad.jsonl"
    lines = [b'{"text": "good one"}', b'{"text": "broken', b'{"text": "\xff\xfe bad utf8"}',
             b'{"other": "x"}', b'{"text": 17}', b'{"text": "   "}', b'[1, 2]',
             b'{"text": "\\ud800 lone surrogate"}', b'', b'{"text": "good two"}']
    src.write_bytes(b"\n".join(lines) + b"\n")
    path = run(tmp_path, tok["bpe"], [str(src)])
    assert len(IndexedDataset(path)) == 2
    assert Provenance(path).lookup(1) == (str(src), 10)
    rejects = [json.loads(x) for x in open(tmp_path / "out_rejects.jsonl")]
    assert [(r["line"], r["reason"]) for r in rejects] == [
        (2, "malformed_json"), (3, "invalid_utf8"), (4, "missing_key"), (5, "non_string"),
        (6, "empty"), (7, "malformed_json"), (8, "invalid_utf8")]
    captured = capsys.readouterr()
    assert f"{src}:2: malformed_json" in captured.err
    assert "skipped 7" in captured.out


def test_strict_fails_without_leaving_outputs(tmp_path, tok):
    src = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, '{"text": nope}'])
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: malformed_json"):
        run(tmp_path, tok["bpe"], [src], "--strict")
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out")]


def test_zstd_parquet_and_directory_inputs(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    d = tmp_path / "in"
    d.mkdir()
    raw = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:3]).encode()
    (d / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": TEXTS[3:6], "id": [1, 2, 3]}), d / "b.parquet")
    path = run(tmp_path, tok["bpe"], [str(d)])
    ds = IndexedDataset(path)
    from tokenizers import Tokenizer
    reference = Tokenizer.from_file(tok["bpe"])
    assert [ds[i].tolist() for i in range(6)] == [reference.encode(t).ids for t in TEXTS[:6]]
    prov = Provenance(path)
    assert prov.lookup(4) == (str(d / "b.parquet"), 2)


def test_provenance_names_the_raw_source_of_curated_records(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq
    src = write_jsonl(tmp_path / "clean.jsonl", [
        {"text": "from raw", "source_file": "raw/web.jsonl", "source_line": 41},
        {"text": "no origin"},
        {"text": "bad origin", "source_file": "raw/web.jsonl", "source_line": "7"},
        {"text": "other raw", "source_file": "raw/code.jsonl", "source_line": 3}])
    table = tmp_path / "clean.parquet"
    pq.write_table(pa.table({"text": ["row"], "source_file": ["raw/a.jsonl"], "source_line": [9]}), table)
    for partitions in ("1", "2"):
        path = run(tmp_path, tok["bpe"], [src, str(table)], "--partitions", partitions, prefix="p" + partitions)
        prov = Provenance(path)
        assert [prov.lookup(i) for i in range(5)] == [
            ("raw/web.jsonl", 41), (src, 2), (src, 3), ("raw/code.jsonl", 3), ("raw/a.jsonl", 9)]


def test_partitions_and_merge_equal_single_run(tmp_path, tok):
    files = [write_jsonl(tmp_path / f"{i}.jsonl", [{"text": t} for t in TEXTS[i::3]]) for i in range(3)]
    single = run(tmp_path, tok["bpe"], files, "--append-eod", prefix="single")
    parted = run(tmp_path, tok["bpe"], files, "--append-eod", "--partitions", "3", prefix="parted")
    for ext in (".bin", ".idx"):
        assert open(single + ext, "rb").read() == open(parted + ext, "rb").read()
    assert Provenance(parted).lookup(len(TEXTS) - 1) == Provenance(single).lookup(len(TEXTS) - 1)
    assert not [f for f in os.listdir(tmp_path) if "_part" in f]
    merged = str(tmp_path / "merged")
    preprocess_data.main(["merge", "--inputs", single, parted, "--output-prefix", merged])
    m = IndexedDataset(merged)
    assert len(m) == 2 * len(TEXTS)
    assert m[len(TEXTS)].tolist() == IndexedDataset(single)[0].tolist()
    assert m.document_indices.tolist() == list(range(2 * len(TEXTS) + 1))


@pytest.mark.parametrize("named", [False, True])
def test_partitions_keep_every_reject_in_one_file(tmp_path, tok, named):
    """Rejects of every partition end up in the one rejects file, in input order, as in a single run; a clean
    partition neither drops the others' nor leaves a file of its own."""
    bodies = ['{"text": "one"}\n{"text": broken\n', '{"text": "clean"}\n', '{"text": 5}\n{"text": "end"}\n']
    files = []
    for i, body in enumerate(bodies):
        (tmp_path / f"{i}.jsonl").write_text(body)
        files.append(str(tmp_path / f"{i}.jsonl"))
    rejects = {}
    for prefix, extra in (("single", []), ("parted", ["--partitions", "3"])):
        where = str(tmp_path / f"{prefix}_named.jsonl") if named else str(tmp_path / f"{prefix}_rejects.jsonl")
        run(tmp_path, tok["bpe"], files, *extra, *(["--rejects", where] if named else []), prefix=prefix)
        rejects[prefix] = [(r["file"], r["line"], r["reason"]) for r in map(json.loads, open(where))]
    assert rejects["parted"] == rejects["single"] == [(files[0], 2, "malformed_json"), (files[2], 1, "non_string")]
    assert not [f for f in os.listdir(tmp_path) if "_part" in f]


def test_compressed_output_partitions_and_conversion(tmp_path, tok, capsys):
    """--compression zstd (with partitions) holds the same documents as the plain run; `merge` of one input
    converts between the kinds, byte for byte back to the plain .bin."""
    files = [write_jsonl(tmp_path / f"{i}.jsonl", [{"text": t} for t in TEXTS[i::3] * 20]) for i in range(3)]
    plain = run(tmp_path, tok["bpe"], files, "--append-eod", prefix="plain")
    capsys.readouterr()
    packed = run(tmp_path, tok["bpe"], files, "--append-eod", "--partitions", "3", "--compression", "zstd",
                 "--block-tokens", "1000", prefix="packed")
    ratio = float(re.search(r"packed_text_document\.arrow/\.idx \(.* tokens: ([\d.]+):1\)", capsys.readouterr().out)
                  .group(1))
    assert ratio > 1.5  # every text repeated 20 times
    assert not os.path.exists(packed + ".bin") and not [f for f in os.listdir(tmp_path) if "_part" in f]
    a, b = IndexedDataset(plain), IndexedDataset(packed)
    assert b.compressed and [a[i].tolist() for i in range(len(a))] == [b[i].tolist() for i in range(len(b))]
    assert open(plain + ".idx", "rb").read() == open(packed + ".idx", "rb").read()
    assert Provenance(packed).lookup(len(a) - 1) == Provenance(plain).lookup(len(a) - 1)
    back = str(tmp_path / "back")
    preprocess_data.main(["merge", "--inputs", packed, "--output-prefix", back])
    assert open(back + ".bin", "rb").read() == open(plain + ".bin", "rb").read()
    with pytest.raises(SystemExit):
        run(tmp_path, tok["bpe"], files, "--block-tokens", "0", prefix="bad")


def test_clear_errors(tmp_path, tok):
    with pytest.raises(SystemExit):
        run(tmp_path, tok["bpe"], [str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit):
        run(tmp_path, str(tmp_path / "nope.json"), [write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])])


def test_sentencepiece_tokenizer(tmp_path, tok):
    import sentencepiece as spm
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS * 5])
    train_tokenizer.main(["--input", corpus, "--output-dir", str(tmp_path / "sp"), "--type", "sp-bpe",
                          "--vocab-size", "600", "--holdout-fraction", "0"])
    model = str(tmp_path / "sp" / "tokenizer.model")
    path = run(tmp_path, model, [corpus], "--append-eod", "--tokenizer-type", "SentencePieceTokenizer")
    sp = spm.SentencePieceProcessor(model_file=model)
    assert IndexedDataset(path)[0].tolist() == sp.encode(TEXTS[0]) + [sp.piece_to_id("<|endoftext|>")]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """A GPT-2, a Llama-3-style (Split + ByteLevel, BOS template), a Metaspace and a Llama 2 / Mistral tokenizer."""
    from tools.bench_preprocess import FAMILIES, build_family
    d = tmp_path_factory.mktemp("families")
    return {f: (str(d / f"{f}.json"), build_family(f, TEXTS * 3, 600, str(d / f"{f}.json"))) for f in FAMILIES}


@pytest.mark.parametrize("family", ["gpt2", "llama3", "metaspace", "llama2"])
def test_chunk_cache_is_exact_for_each_tokenizer_family(tmp_path, families, family, capsys):
    """Random text built to stress the cuts (runs of mixed whitespace and line breaks, identifiers next to
    punctuation, contractions, the Metaspace mark itself): cached ids equal the plain encoder's. Then the
    tool's output equals a per-document encode, and its summary says the workers used the cache."""
    from tokenizers import Tokenizer
    path, eod_token = families[family]
    reference = Tokenizer.from_file(path)
    encoder = load_encoder(tokenizer_spec(None, path))
    assert encoder.cached, encoder.cache_reason
    encoder.verify_first = 0  # the comparison below is the check
    rng = np.random.RandomState(1)
    alphabet = (list("abcXYZ019_.,;:'\"()[]{}#-+=/\\<>|!?é日😀\u2581") + list(SAFE_SPACES) * 3
                + ["'s", "'ll", "\n \n", " \n", "\t\n  ", "  ", "def", " x"])
    texts = ["".join(rng.choice(alphabet, rng.randint(1, 60))) for _ in range(600)] + TEXTS
    # In batches: later ones mix cache hits with misses that get the next slots.
    out = [ids for i in range(0, len(texts), 150) for ids in encoder.encode_batch(texts[i:i + 150])]
    for t, ids in zip(texts, out):
        assert ids.tolist() == reference.encode(t).ids, repr(t)
    if family == "metaspace":  # misses were encoded without word ids, their words found from the ids
        assert encoder._word_start is not None
    out = run(tmp_path, path, [write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts if t.strip()])],
              "--append-eod", "--eod-token", eod_token, "--workers", "2", "--batch-size", "100")
    eod = reference.token_to_id(eod_token)
    ds = IndexedDataset(out)
    assert [ds[i].tolist() for i in range(len(ds))] == [reference.encode(t).ids + [eod] for t in texts if t.strip()]
    assert "; cache on (" in capsys.readouterr().out


def test_summary_reports_a_cache_the_workers_turned_off(tmp_path, tok, monkeypatch, capsys):
    """A cut rule that breaks exactness is caught by the self-check; the summary says so rather than `cache on`."""
    from data.offline import chunk_rules
    monkeypatch.setattr(chunk_rules.GPT2, "split", lambda text: [text[i:i + 2] for i in range(0, len(text), 2)])
    path = run(tmp_path, tok["bpe"], [write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])])
    assert len(IndexedDataset(path)) == len(TEXTS)
    captured = capsys.readouterr()
    assert "cache off: self-check failed" in captured.out and "turning the cache off" in captured.err


@pytest.mark.parametrize("scheme", ["always", "never"])
@pytest.mark.parametrize("family", ["metaspace", "llama2"])
def test_metaspace_cache_is_exact_for_each_prepend_scheme(tmp_path, families, family, scheme):
    """The first chunk of a text: cached as a space-led chunk where the tokenizer prepends "▁" ("first", tested
    above, and "always"); where it does not ("never"), encoded on its own (Metaspace) or as a word that gets no
    "▁" (whitespace runs)."""
    from tokenizers import Tokenizer
    from data.offline import chunk_rules
    config = json.load(open(families[family][0]))
    config["pre_tokenizer"]["prepend_scheme"] = scheme
    reference = Tokenizer.from_str(json.dumps(config))
    encoder = load_encoder(("hf", json.dumps(config)))
    rules = {"metaspace": (chunk_rules.METASPACE, chunk_rules.METASPACE_NEVER),
             "llama2": (chunk_rules.METASPACE_EVEN_RUNS, chunk_rules.METASPACE_EVEN_RUNS_NEVER)}[family]
    assert encoder.rule is rules[scheme == "never"]
    encoder.verify_first = 0
    if scheme == "never" and family == "metaspace":  # and the words of the joined misses from the word ids
        encoder._build_inner()
        encoder._word_start = None
    rng = np.random.RandomState(2)
    alphabet = list("abXY01_.,:'()é日\u2581") + [" ", "  ", "\n", "\t", "def", " x", "\u2581x"]
    texts = ["".join(rng.choice(alphabet, rng.randint(1, 40))) for _ in range(400)] + TEXTS
    out = [ids for i in range(0, len(texts), 100) for ids in encoder.encode_batch(texts[i:i + 100])]
    for t, ids in zip(texts, out):
        assert ids.tolist() == reference.encode(t).ids, repr(t)


def _source_code(rng, n):
    """Python-like documents full of indentation, alignment runs, blank lines holding spaces, tabs and trailing
    spaces, with characters a small vocabulary lacks (byte fallback) and the mark itself."""
    words = ["def", "return", "self.x", "if", "else:", "for", "in", "range(n):", "=", "==", "+=", "#", "x", "None",
             "'s'", "foo(a,", "b)", "[1,", "2]", "日本", "😀", "\u2581", "\u2581\u2581x", "é", "\t", "pass", ""]
    docs = []
    for _ in range(n):
        lines = []
        for _ in range(rng.randint(1, 12)):
            indent = " " * rng.choice([0, 0, 1, 2, 3, 4, 4, 5, 8, 8, 12, 16, 17])
            gaps = [" " * rng.choice([1, 1, 1, 2, 3, 4, 7]) for _ in range(8)]
            line = indent + "".join(w + g for w, g in zip(rng.choice(words, rng.randint(0, 7)), gaps))
            lines.append(line if rng.rand() < 0.7 else line.rstrip(" "))
        docs.append("\n".join(lines) + rng.choice(["", "\n", "  \n", "   "]))
    return docs


@pytest.fixture(scope="module")
def llama2_code(tmp_path_factory):
    """A Llama 2 / Mistral layout tokenizer trained on standard-library source, and held-out source texts."""
    from tools.bench_preprocess import build_family
    from tools.stdlib_corpus import stdlib_python_files
    root, files = stdlib_python_files()
    texts = [open(os.path.join(root, f), encoding="utf-8").read() for f in files if f.startswith("json" + os.sep)]
    path = str(tmp_path_factory.mktemp("llama2") / "tokenizer.json")
    eod_token = build_family("llama2", texts[1:], 1200, path)
    return path, eod_token, texts[:1]


def _with_first_merge(tmp_path, path, left, right):
    """(a copy of the tokenizer.json at `path` whose first merge joins `left` and `right`, its Tokenizer)."""
    from tokenizers import Tokenizer
    config = json.load(open(path))
    model = config["model"]
    model["vocab"][left + right] = max(model["vocab"].values()) + 1
    model["merges"].insert(0, [left, right])
    changed = str(tmp_path / "changed.json")
    with open(changed, "w") as f:
        json.dump(config, f)
    return changed, Tokenizer.from_file(changed)


def _exact_through_the_tool(tmp_path, tokenizer_path, reference, texts, eod_token, *options):
    """Run tools/preprocess_data.py on `texts`; assert its shards hold the reference's ids and EOD."""
    prefix = run(tmp_path, tokenizer_path, [write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])],
                 "--append-eod", "--eod-token", eod_token, *options)
    ds = IndexedDataset(prefix)
    eod = reference.token_to_id(eod_token)
    assert [ds[i].tolist() for i in range(len(ds))] == [reference.encode(t).ids + [eod] for t in texts]


@pytest.mark.parametrize("byte_fallback", [True, False])
def test_llama2_layout_cache_is_exact_on_source_code(tmp_path, llama2_code, capsys, byte_fallback):
    """Whitespace-run tokens, byte fallback and split false, as converted Llama 2 and Mistral tokenizers have
    them: the cache stays on with cuts only where a space follows another character, even runs encoded as two
    spaces, and source code with runs of spaces everywhere gives the ids of the whole-document encoder,
    in-process and through --workers 2.
    Without byte fallback, characters outside the vocabulary are unknown tokens of unknown length: their
    chunks are encoded one at a time. The new chunks are cut into pieces no token spans, each encoded once."""
    from tokenizers import Tokenizer
    from data.offline import chunk_rules
    path, eod_token, held_out = llama2_code
    config = json.load(open(path))
    vocab = config["model"]["vocab"]
    assert config["pre_tokenizer"]["split"] is False and config["model"]["byte_fallback"]
    assert "\u2581\u2581\u2581\u2581" in vocab and "<0xE6>" in vocab  # runs of "▁"; the bytes of 日
    if not byte_fallback:
        config["model"]["byte_fallback"] = False
        path = str(tmp_path / "unk.json")
        with open(path, "w") as f:
            json.dump(config, f)
    reference = Tokenizer.from_file(path)
    encoder = load_encoder(tokenizer_spec(None, path))
    assert encoder.rule is chunk_rules.METASPACE_EVEN_RUNS, encoder.cache_reason
    encoder.verify_first = 0  # the comparison below is the check
    rng = np.random.RandomState(3)
    texts = (held_out + _source_code(rng, 300) + ["    x", "\u2581  y", " ", "x    ", "\n  \n", "a b  c   d"]
             + [t.replace("    ", "\t") for t in held_out])
    out = [ids for i in range(0, len(texts), 100) for ids in encoder.encode_batch(texts[i:i + 100])]
    for t, ids in zip(texts, out):
        assert ids.tolist() == reference.encode(t).ids, repr(t)
    assert encoder.cached and len(encoder._index) > 100
    assert 0 < encoder._pieces.next < len(encoder._index)  # new chunks went through the piece cache
    assert (reference.token_to_id("<unk>") in np.concatenate(out)) != byte_fallback
    docs = [t for t in texts if t.strip()]
    prefix = run(tmp_path, path, [write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs])],
                 "--append-eod", "--eod-token", eod_token, "--workers", "2", "--batch-size", "40")
    eod = reference.token_to_id(eod_token)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [reference.encode(t).ids + [eod] for t in docs]
    assert ("; cache on (Metaspace whitespace-run, even-run cuts, new chunks in pieces) in all "
            in capsys.readouterr().out)


def test_metaspace_vocabulary_the_rule_cannot_cover_keeps_the_cache_off(tmp_path, llama2_code, monkeypatch,
                                                                     capsys):
    """A merge that makes a token with "▁" after another character ('e▁') can join text across a space: the
    cache stays off, the summary names the token, and the output is still the whole-document encoding. Cutting
    anyway would be wrong, which is why the rule refuses it (the encoder finds the token spanning two chunks)."""
    from data.offline import chunk_rules
    path, eod_token, held_out = llama2_code
    crossing, reference = _with_first_merge(tmp_path, path, "e", "\u2581")
    encoder = load_encoder(tokenizer_spec(None, crossing))
    assert not encoder.cached and "'e\u2581'" in encoder.cache_reason
    texts = ["the cat\n    we see\n", held_out[0][:2000]]
    assert "e\u2581" in [reference.id_to_token(i) for i in reference.encode(texts[0]).ids]
    _exact_through_the_tool(tmp_path, crossing, reference, texts, eod_token, "--workers", "2")
    assert "; cache off: Metaspace merges make 'e\u2581'" in capsys.readouterr().out
    monkeypatch.setattr(chunk_rules, "_metaspace_rule", lambda *args: (chunk_rules.METASPACE_RUNS, None))
    forced = load_encoder(tokenizer_spec(None, crossing))
    with pytest.raises(RuntimeError, match="a token spans two chunks"):
        forced.encode_batch(texts[:1])


@pytest.mark.parametrize("change", ["word merge first", "run + word token"])
def test_even_runs_only_where_the_merges_allow_them(tmp_path, llama2_code, change):
    """Even runs are encoded as two spaces only when ("▁", "▁") outranks every merge that could take a run's
    last "▁" and no token holds "▁▁" + a character. A merge ("▁", "r") ranked first takes the last "▁" of
    "    return" from the run (ids "▁▁▁", "▁r..."); a token "▁▁r" joins it across the cut. Either way the rule
    falls back to whole whitespace-run chunks, which stay exact, and forcing the even-run encoding on such a
    vocabulary is caught rather than written."""
    from tokenizers import Tokenizer
    from data.offline import chunk_rules
    path, _, held_out = llama2_code
    config = json.load(open(path))
    model = config["model"]
    if change == "word merge first":
        model["merges"].remove(["\u2581", "r"])
        model["merges"].insert(0, ["\u2581", "r"])
    else:
        model["vocab"]["\u2581\u2581r"] = max(model["vocab"].values()) + 1
        model["merges"].insert(0, ["\u2581\u2581", "r"])
    reference = Tokenizer.from_str(json.dumps(config))
    texts = ["    return x\n        return y\n"] + held_out + _source_code(np.random.RandomState(5), 50)
    assert reference.encode(texts[0]).ids != (reference.encode("    ", add_special_tokens=False).ids
                                              + reference.encode("  return x", add_special_tokens=False).ids[1:])
    encoder = load_encoder(("hf", json.dumps(config)))
    assert encoder.rule is chunk_rules.METASPACE_RUNS, encoder.cache_reason
    encoder.verify_first = 0
    for t, ids in zip(texts, encoder.encode_batch(texts)):
        assert ids.tolist() == reference.encode(t).ids, repr(t)
    forced = load_encoder(("hf", json.dumps(config)))
    forced.rule, forced.verify_first = chunk_rules.METASPACE_EVEN_RUNS, 0
    with pytest.raises(RuntimeError, match="the even-run rule is wrong"):
        forced.encode_batch(texts[:1])


def test_metaspace_split_true_cuts_at_every_space_whatever_the_vocabulary(llama2_code):
    """With `split` true the pre-tokenizer cuts before every "▁" itself, so whitespace-run tokens cannot span
    one: the finer cuts apply (the whitespace-run chunks would join what the tokenizer keeps apart)."""
    from tokenizers import Tokenizer
    from data.offline import chunk_rules
    path, _, held_out = llama2_code
    config = json.load(open(path))
    config["pre_tokenizer"]["split"] = True
    reference = Tokenizer.from_str(json.dumps(config))
    encoder = load_encoder(("hf", json.dumps(config)))
    assert encoder.rule is chunk_rules.METASPACE
    encoder.verify_first = 0
    texts = held_out + _source_code(np.random.RandomState(4), 100)
    for t, ids in zip(texts, encoder.encode_batch(texts)):
        assert ids.tolist() == reference.encode(t).ids, repr(t)


def test_wrong_piece_cuts_are_caught(llama2_code):
    """New pieces give the same ids joined by the separator or encoded as texts of their own. And the exactness
    checks above have teeth: cutting pieces where a token spans (everywhere), or between two characters outside
    the vocabulary (fused into one unknown token without byte fallback), changes the ids."""
    from tokenizers import Tokenizer
    from data.offline import chunk_rules
    path, _, held_out = llama2_code
    config = json.load(open(path))
    config["model"]["byte_fallback"] = False
    reference = Tokenizer.from_str(json.dumps(config))
    texts = [held_out[0][:3000], "x = '日本'  # 😀\n"]
    for wrong in ("everywhere", "between unknowns"):
        encoder = load_encoder(("hf", json.dumps(config)))
        encoder.verify_first = 0
        assert encoder.cutter is not None, encoder.piece_reason
        assert [ids.tolist() for ids in encoder.encode_batch(texts)] == [reference.encode(t).ids for t in texts]
        encoder._reset_cache()
        encoder.cutter.separator = None  # new pieces encoded as texts of their own rather than joined: same ids
        assert [ids.tolist() for ids in encoder.encode_batch(texts)] == [reference.encode(t).ids for t in texts]
        encoder._reset_cache()
        encoder.rule = chunk_rules.METASPACE_RUNS  # whole runs: the even-run check would catch cuts inside "▁▁"
        if wrong == "everywhere":
            encoder.cutter._apart[:] = True
        else:
            encoder.cutter._apart.reshape(encoder.cutter._width, -1)[-1, -1] = True
        got = [ids.tolist() for ids in encoder.encode_batch(texts)]
        assert got[wrong == "between unknowns"] != reference.encode(texts[wrong == "between unknowns"]).ids


def test_merge_of_a_byte_token_keeps_whole_chunks(tmp_path, llama2_code, capsys):
    """A merge whose part is a byte-fallback token (its text "<0xE6>" is not the character it covers) voids the
    piece proof: misses stay whole chunks, the summary says why, and the output is still exact."""
    path, eod_token, held_out = llama2_code
    merged, reference = _with_first_merge(tmp_path, path, "<0xE6>", "<0x97>")
    encoder = load_encoder(tokenizer_spec(None, merged))
    assert encoder.cached and encoder.cutter is None and "'<0xE6>'" in encoder.piece_reason
    texts = ["x = '日本'  # 日\n    return 日\n", held_out[0][:2000]]
    assert "<0xE6><0x97>" in [reference.id_to_token(i) for i in reference.encode(texts[0]).ids]
    _exact_through_the_tool(tmp_path, merged, reference, texts, eod_token)
    assert "even-run cuts; no pieces: a merge joins '<0xE6>'" in capsys.readouterr().out


def test_a_worker_task_ends_at_its_document_count_or_its_input_bytes():
    from data.offline.workers import batched
    records = [(0, n, b"x" * size) for n, size in enumerate([10, 10, 10, 600, 500, 10, 10])]
    sizes = [[len(r[2]) for r in batch] for batch in batched(records, 3, 1000, preprocess_data._payload_bytes)]
    assert sizes == [[10, 10, 10], [600, 500], [10, 10]]
    assert [len(b) for b in batched(range(7), 3)] == [3, 3, 1]
    assert preprocess_data._payload_bytes((0, 1, {"text": "parsed"})) == 0
