"""tools/curate_data.py: each cleaning stage, the rejects file and summary, and the reversible flow
raw JSONL -> curate -> preprocess -> training sample -> raw file and line."""
import collections
import json
import os
import random

import numpy as np
import pytest

from data.indexed import IndexedDataset
from data.loader import build_datasets, sample_provenance
from data.offline.contamination import gram_hashes, word_hashes
from data.offline.dedup import DuplicateFinder, components, lsh_bands
from data.offline.pii import scrub
from tests.helpers import write_jsonl
from tools import curate_data, preprocess_data, stdlib_corpus, train_tokenizer

ENGLISH = ("The committee published its annual report on the state of public libraries, noting that "
           "visitor numbers rose again this year and that several cities plan to open new reading rooms.")
CHINESE = "委员会发布了关于公共图书馆状况的年度报告，指出今年的访客人数再次上升，许多城市计划扩建阅览室。"
GERMAN = ("Der Ausschuss veröffentlichte seinen Jahresbericht über die Lage der öffentlichen Bibliotheken "
          "und stellte fest, dass die Besucherzahlen in diesem Jahr wieder gestiegen sind.")
CODE = ('def moving_average(values, window=3):\n    """Mean of each run of `window` values."""\n'
        '    total = sum(values[:window])\n    out = [total / window]\n'
        '    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n'
        '        out.append(total / window)\n    return out\n')
VOCAB = ("river stone garden window paper market letter winter music orange silver forest bridge "
         "doctor teacher island engine candle mirror pocket ticket violin harbor meadow lantern "
         "village thunder basket copper feather").split()


def random_doc(seed, words=120):
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(words)) + "."


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def curate(tmp_path, records, *flags, name="raw"):
    raw = write_jsonl(tmp_path / f"{name}.jsonl", records, ensure_ascii=False)
    out = str(tmp_path / f"{name}_clean.jsonl")
    summary = curate_data.main(["--input", raw, "--output", out, "--quiet", *flags])
    return raw, read_jsonl(out), read_jsonl(summary["rejects"]), summary


def reasons(rejects):
    return {r["source_line"]: (r["stage"], r["reason"]) for r in rejects}


# ---------------------------------------------------------------- PII

def id_number(base17):
    """A resident ID with its check digit, from the GB 11643 table (independent of data/offline/pii.py)."""
    weights = [7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2]
    return base17 + "10X98765432"[sum(int(d) * w for d, w in zip(base17, weights)) % 11]


@pytest.mark.parametrize("text, kind", [
    ("write to john.doe+lists@example.co.uk today", "email"),
    ("邮箱zhang.san@qq.com谢谢", "email"),
    ("call (555) 123-4567", "phone"), ("call 555-123-4567", "phone"), ("call 555.123.4567", "phone"),
    ("call +1 555 123 4567", "phone"), ("call 1-800-555-0199", "phone"), ("tel +44 20 7946 0958", "phone"),
    ("tel +49 (0)30 1234567", "phone"), ("tel +33 1 23 45 67 89", "phone"), ("tel +12025550123", "phone"),
    ("手机13812345678", "phone"), ("手机 138 1234 5678", "phone"), ("手机138-1234-5678", "phone"),
    ("电话：+86 138 1234 5678。", "phone"), ("+8613912345678", "phone"), ("座机010-12345678", "phone"),
    ("身份证号11010519491231002X", "id_number"), (f"ID {id_number('44030619990101123')} ok", "id_number"),
])
def test_pii_is_replaced_by_its_placeholder(text, kind):
    cleaned, counts = scrub(text)
    assert counts == {kind: 1}, (text, cleaned)
    assert f"<{kind.upper()}>" in cleaned


@pytest.mark.parametrize("text", [
    "version 3.11.7", "released 2024-01-15", "on 15/01/2024", "on 12.03.2024", "host 192.168.100.200",
    "gateway 10.0.0.1", "mask 255.255.255.0", "n = 1234567890", "pi 3141592653589793238", "$1,234,567.89",
    "uuid 123e4567-e89b-12d3-a456-426614174000", "ISBN 978-3-16-148410-0", "at 12:30:45", "x = a@b",
    "@property", "x+1", "1e+10", "0x7fffffff", "+35236450.6", "'+0000'", "v1.2.3-4567", "pages 12-34",
    "11010519491231002" + "1",  # the ID above with a wrong check digit
    "123456789012345678",       # 18 digits that are no ID
])
def test_ordinary_numbers_are_not_pii(text):
    assert scrub(text) == (text, {})


def test_id_numbers_need_a_valid_check_digit():
    valid = id_number("51010819851127345")
    invalid = valid[:17] + ("0" if valid[17] != "0" else "1")
    assert scrub(valid)[0] == "<ID_NUMBER>"
    assert scrub(invalid)[0] == invalid


# ---------------------------------------------------------------- stages through the tool

def test_language_filter_keeps_listed_languages(tmp_path):
    _, kept, rejects, summary = curate(tmp_path, [{"text": ENGLISH}, {"text": CHINESE}, {"text": GERMAN}],
                                       "--languages", "en,zh")
    assert [r["text"] for r in kept] == [ENGLISH, CHINESE]
    assert reasons(rejects) == {3: ("language", "language:de")}
    assert summary["dropped_by_stage"] == {"language": {"language:de": 1}}
    _, kept, rejects, _ = curate(tmp_path, [{"text": ENGLISH}, {"text": "Yes it is."}], "--languages", "en",
                                 "--min-language-confidence", "0.9", "--no-quality")
    assert [r["text"] for r in kept] == [ENGLISH]
    assert reasons(rejects) == {2: ("language", "low_language_confidence")}
    with pytest.raises(SystemExit):
        curate(tmp_path, [{"text": ENGLISH}], "--languages", "en,klingon")


def test_pii_scrubbed_in_kept_documents_and_counted(tmp_path):
    text = ENGLISH + " Contact jane@example.org or 555-123-4567, ID " + id_number("11010519800101001") + "."
    _, kept, _, summary = curate(tmp_path, [{"text": text, "url": "u"}])
    assert kept[0]["text"] == ENGLISH + " Contact <EMAIL> or <PHONE>, ID <ID_NUMBER>."
    assert kept[0]["url"] == "u"
    assert summary["pii_replaced"] == {"email": 1, "phone": 1, "id_number": 1}
    _, kept, _, summary = curate(tmp_path, [{"text": text}], "--no-pii")
    assert kept[0]["text"] == text and summary["pii_replaced"] == {"email": 0, "phone": 0, "id_number": 0}


def test_each_quality_reason(tmp_path):
    extra = tmp_path / "phrases.txt"
    extra.write_text("# site furniture\nsponsored content\n", encoding="utf-8")
    nav = "\n".join(["Home", "News", "Click to see more", "Cookie policy", "All rights reserved", ENGLISH])
    records = [
        {"text": "Too short."},                                       # 1
        {"text": "Supercalifragilistic expialidocious"},              # 2 two words
        {"text": "#### $$$$ %%%% &&&& **** !!!! @@@@ ^^^^ ~~~~ one two three"},  # 3
        {"text": "\n".join([ENGLISH] + ["Buy cheap watches now"] * 6)},  # 4
        {"text": nav},                                                # 5
        {"text": "点击查看更多\n" + CHINESE + "\n版权所有"},             # 6
        {"text": ENGLISH + "\nSponsored Content"},                    # 7 --boilerplate-file phrase
        {"text": " ".join(["a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8"] * 5)},  # 8 hash-like words
        {"text": "a b c d e f g h i j k l m n o p q r s t u v"},      # 9
        {"text": ENGLISH}, {"text": CHINESE}, {"text": CODE}, {"text": GERMAN},  # 10-13 kept
    ]
    _, kept, rejects, _ = curate(tmp_path, records, "--boilerplate-file", str(extra))
    assert reasons(rejects) == {
        1: ("quality", "too_few_chars"), 2: ("quality", "too_few_words"), 3: ("quality", "too_many_symbols"),
        4: ("quality", "repeated_lines"), 5: ("quality", "boilerplate"), 6: ("quality", "boilerplate"),
        7: ("quality", "boilerplate"), 8: ("quality", "mean_word_length"), 9: ("quality", "mean_word_length")}
    assert [r["source_line"] for r in kept] == [10, 11, 12, 13]
    _, kept, _, _ = curate(tmp_path, records, "--no-quality", "--no-dedup")
    assert len(kept) == len(records)


def test_near_and_exact_duplicates_removed_first_kept(tmp_path):
    base = random_doc(1, 300)
    words = base.split()
    for i in (40, 150, 260):
        words[i] = "changed"
    records = [{"text": base}, {"text": random_doc(2, 300)}, {"text": " ".join(words)}, {"text": base},
               {"text": random_doc(3, 300)}, {"text": base.upper()}]
    raw, kept, rejects, summary = curate(tmp_path, records)
    assert [r["source_line"] for r in kept] == [1, 2, 5]
    assert reasons(rejects) == {3: ("dedup", "near_duplicate"), 4: ("dedup", "exact_duplicate"),
                                6: ("dedup", "near_duplicate")}
    assert all(r["duplicate_of"] == {"source_file": raw, "source_line": 1} for r in rejects)
    assert summary["duplicates_removed"] == 3
    assert sorted(os.listdir(tmp_path)) == ["raw.jsonl", "raw_clean.jsonl", "raw_clean.rejects.jsonl"]
    work = tmp_path / "work"  # the signatures file goes to --dedup-workdir and is removed at the end
    _, kept, _, _ = curate(tmp_path, records, "--dedup-workdir", str(work))
    assert [r["source_line"] for r in kept] == [1, 2, 5] and not os.listdir(work)
    for unit, size in (("char", 5), ("word", 3)):
        _, kept, _, _ = curate(tmp_path, records, "--shingle-unit", unit, "--shingle-size", str(size))
        assert [r["source_line"] for r in kept] == [1, 2, 5]
    _, kept, _, _ = curate(tmp_path, records, "--no-dedup")
    assert len(kept) == len(records)
    with pytest.raises(SystemExit):  # too few LSH bands for 128 permutations: a clear error, not a trace
        curate(tmp_path, records, "--dedup-threshold", "0.99")


def test_components_are_connected_components_labelled_by_their_first_node():
    rng = np.random.default_rng(0)
    for n, edges in ((1, 0), (50, 30), (400, 350), (2000, 500)):
        first, second = rng.integers(0, n, edges), rng.integers(0, n, edges)
        neighbours = collections.defaultdict(set)
        for a, b in zip(first.tolist(), second.tolist()):
            neighbours[a].add(b)
            neighbours[b].add(a)
        want = list(range(n))
        for start in range(n):  # a breadth-first search from each component's smallest node
            if want[start] != start:
                continue
            frontier = [start]
            while frontier:
                node = frontier.pop()
                for other in neighbours[node]:
                    if want[other] == other and other > start:
                        want[other] = start
                        frontier.append(other)
        assert components(n, first, second).tolist() == want


def test_lsh_bands_match_datasketchs_choice():
    from datasketch.lsh import _optimal_param
    for threshold, num_perm in ((0.8, 128), (0.5, 128), (0.9, 256), (0.7, 64)):
        assert lsh_bands(threshold, num_perm) == _optimal_param(threshold, num_perm, 0.5, 0.5)


def test_duplicate_finder_at_scale_finds_planted_copies_and_chains(tmp_path):
    """20,000 random signatures with planted copies (95% of values kept: all found, none invented), and a
    chain A~B~C with A and C below the threshold: one cluster, kept A, C reported with its low estimate."""
    rng = np.random.default_rng(1)
    n, perm = 20_000, 128
    signatures = rng.integers(0, 2**32, (n, perm), dtype=np.uint64).astype(np.uint32)
    originals = rng.choice(n // 2, 500, replace=False)
    copies = n // 2 + np.arange(500)
    for original, copy in zip(originals, copies):
        signatures[copy] = signatures[original]
        changed = rng.choice(perm, 6, replace=False)
        signatures[copy, changed] = rng.integers(0, 2**32, 6, dtype=np.uint64).astype(np.uint32)
    chain = n - 3 + np.arange(3)  # A, B, C: B shares 85% with A, C shares 85% with B but ~72% with A
    signatures[chain[1]] = signatures[chain[0]]
    signatures[chain[1], :19] = 7
    signatures[chain[2]] = signatures[chain[1]]
    signatures[chain[2], 100:119] = 9
    finder = DuplicateFinder(0.8, perm, str(tmp_path))
    digests = rng.integers(0, 2**63, n)
    digests[5] = digests[4]  # one exact pair (its signature is the same text's)
    signatures[5] = signatures[4]
    for digest, signature in zip(digests.tolist(), signatures):
        finder.add(digest, signature)
    root, similarity, exact = finder.find()
    finder.close()
    assert not os.listdir(tmp_path)  # the signatures file is gone
    dropped = set(np.flatnonzero(root != np.arange(n)).tolist())
    assert dropped == set(copies.tolist()) | {5, int(chain[1]), int(chain[2])}
    assert (root[copies] == originals).all() and (similarity[copies] >= 0.9).all() and not exact[copies].any()
    assert root[5] == 4 and exact[5] and similarity[5] == 1.0
    assert root[chain[2]] == chain[0] and similarity[chain[2]] < 0.8


def test_rolled_gram_hashes_equal_hashing_each_gram():
    words = word_hashes("One two, THREE four five; six seven eight nine ten")
    base = 0x100000001B3
    for k, got in gram_hashes(words, {1, 3, 10, 11}).items():
        want = []
        for i in range(len(words) - k + 1):
            h = 0
            for w in words[i:i + k].tolist():
                h = (h * base + w) % 2**64
            want.append(h)
        assert got.tolist() == want, k
    assert 11 not in gram_hashes(words, {11})  # longer than the text: no grams


def test_documents_holding_evaluation_text_are_dropped(tmp_path, capsys):
    """--decontaminate: a training page that quotes a benchmark question (13 words or more in common), or
    holds a short evaluation answer whole, is dropped naming the evaluation record; the rest is kept."""
    question = ("Which river flows through the city that hosted the first modern Olympic Games in the "
                "year eighteen ninety six")
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"question": question, "answer": "none"},
                                                       {"question": "Name the violin maker", "answer": "Amati"}],
                             ensure_ascii=False)
    records = [{"text": ENGLISH},
               {"text": random_doc(1, 60) + " " + question.upper() + " " + random_doc(2, 60)},  # quoted
               {"text": random_doc(3, 80)},
               {"text": random_doc(4, 40) + " name the violin maker amati " + random_doc(5, 40)},  # short one whole
               {"text": random_doc(6, 60) + " " + " ".join(question.split()[:12]) + " " + random_doc(7, 60)}]
    raw, kept, rejects, summary = curate(tmp_path, records, "--decontaminate", evaluation,
                                         "--decontaminate-keys", "question", "answer")
    assert [r["source_line"] for r in kept] == [1, 3, 5]  # 12 words in common are not 13
    assert reasons(rejects) == {2: ("decontamination", "evaluation_overlap"),
                                4: ("decontamination", "evaluation_overlap")}
    details = {r["source_line"]: r["detail"] for r in rejects}
    assert details[2] == f"7 evaluation n-gram(s) (13 words, or a whole shorter text) shared with {evaluation}:1"
    assert details[4] == f"1 evaluation n-gram(s) (13 words, or a whole shorter text) shared with {evaluation}:2"
    assert summary["dropped_by_stage"]["decontamination"] == {"evaluation_overlap": 2}
    _, kept, _, _ = curate(tmp_path, records, "--decontaminate", evaluation, "--decontaminate-keys", "question",
                           "answer", "--decontaminate-ngram", "8")
    assert [r["source_line"] for r in kept] == [1, 3]  # with 8-word n-grams the 12-word quote counts too
    _, kept, _, _ = curate(tmp_path, records, "--decontaminate", evaluation, "--decontaminate-keys", "question",
                           "answer", "--decontaminate-min-hits", "3")
    assert [r["source_line"] for r in kept] == [1, 3, 4, 5]
    for bad in (["--decontaminate", str(tmp_path / "missing.jsonl")],
                ["--decontaminate", evaluation, "--decontaminate-keys", "prompt"],
                ["--decontaminate", evaluation, "--decontaminate-ngram", "0"]):
        with pytest.raises(SystemExit):
            curate(tmp_path, records, *bad)
    assert "evaluation set" in capsys.readouterr().err


def test_rejects_summary_and_malformed_lines(tmp_path, capsys):
    raw = tmp_path / "raw.jsonl"
    lines = [json.dumps({"text": ENGLISH}).encode(), b'{"text": "broken', json.dumps({"body": "x"}).encode(),
             b'{"text": "\xff bad utf8"}', json.dumps({"text": ENGLISH}).encode(), b"",
             json.dumps({"text": "tiny"}).encode(), json.dumps({"text": GERMAN}).encode()]
    raw.write_bytes(b"\n".join(lines) + b"\n")
    out = str(tmp_path / "clean.jsonl")
    summary = curate_data.main(["--input", str(raw), "--output", out])
    captured = capsys.readouterr()
    assert f"{raw}:2: malformed_json" in captured.err and f"{raw}:3: missing_key" in captured.err
    rejects = read_jsonl(tmp_path / "clean.rejects.jsonl")
    assert reasons(rejects) == {2: ("input", "malformed_json"), 3: ("input", "missing_key"),
                                4: ("input", "invalid_utf8"), 5: ("dedup", "exact_duplicate"),
                                7: ("quality", "too_few_chars")}
    assert all(r["source_file"] == str(raw) and r["detail"] for r in rejects)
    kept = read_jsonl(out)
    assert [(r["source_file"], r["source_line"]) for r in kept] == [(str(raw), 1), (str(raw), 8)]
    # Every record is accounted for exactly once, and the printed summary says the same.
    assert summary["documents_in"] == 7 == summary["kept"] + summary["dropped"]
    assert summary["dropped"] == len(rejects) == sum(sum(r.values()) for r in summary["dropped_by_stage"].values())
    assert "7 documents in, 2 kept (28.6%), 5 dropped" in captured.out
    assert "duplicates removed: 1 (1 exact, 0 near)" in captured.out


def test_workers_parquet_and_chained_passes_keep_the_raw_origin(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    records = [{"text": random_doc(i), "id": i} for i in range(20)] + [{"text": random_doc(3), "id": 99}]
    raw = write_jsonl(tmp_path / "raw.jsonl", records, ensure_ascii=False)
    one, two = str(tmp_path / "w1.jsonl"), str(tmp_path / "w2.jsonl")
    curate_data.main(["--input", raw, "--output", one, "--quiet"])
    curate_data.main(["--input", raw, "--output", two, "--quiet", "--workers", "2", "--batch-size", "3"])
    assert open(one).read() == open(two).read()
    assert open(str(tmp_path / "w1.rejects.jsonl")).read() == open(str(tmp_path / "w2.rejects.jsonl")).read()
    # A second pass over cleaned output still points at the raw file.
    again = str(tmp_path / "again.jsonl")
    curate_data.main(["--input", one, "--output", again, "--quiet", "--min-words", "200"])
    assert read_jsonl(again) == [] and {r["source_file"] for r in read_jsonl(tmp_path / "again.rejects.jsonl")} == {raw}
    table = tmp_path / "raw.parquet"
    pq.write_table(pa.table({"text": [ENGLISH, GERMAN], "lang": ["en", "de"]}), table)
    out = str(tmp_path / "pq.jsonl")
    curate_data.main(["--input", str(table), "--output", out, "--quiet"])
    assert read_jsonl(out) == [
        {"text": ENGLISH, "lang": "en", "source_file": str(table), "source_line": 1},
        {"text": GERMAN, "lang": "de", "source_file": str(table), "source_line": 2}]
    with pytest.raises(SystemExit):
        curate_data.main(["--input", raw, "--output", raw])


def test_round_trip_sample_traces_to_raw_file_and_line(tmp_path):
    records = []
    for i in range(30):
        if i % 4 == 1:
            records.append({"text": "too short"})
        elif i % 4 == 3:
            records.append("{not json")
        else:
            records.append({"text": f"marker{i} " + random_doc(100 + i, 60)})
    raw, kept, _, _ = curate(tmp_path, records)
    assert [r["source_line"] for r in kept] == [i + 1 for i in range(30) if i % 2 == 0]
    train_tokenizer.main(["--input", raw, "--output-dir", str(tmp_path / "tok"), "--vocab-size", "300",
                          "--min-frequency", "1", "--holdout-fraction", "0"])
    prefix = str(tmp_path / "shards")
    preprocess_data.main(["--input", str(tmp_path / "raw_clean.jsonl"), "--output-prefix", prefix,
                          "--tokenizer-model", str(tmp_path / "tok" / "tokenizer.json"), "--append-eod", "--quiet"])
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    dataset = build_datasets([prefix + "_text_document"], 64, 0, "100,0,0", cache_dir=str(tmp_path / "c"))["train"]
    indexed = IndexedDataset(prefix + "_text_document")
    raw_lines = open(raw, encoding="utf-8").read().splitlines()
    seen = set()
    for i in range(len(dataset)):
        for piece in sample_provenance(dataset, i):
            assert piece["source_file"] == raw
            marker = tok.decode(indexed[piece["document"]].tolist()).split()[0]
            assert json.loads(raw_lines[piece["line"] - 1])["text"].split()[0] == marker
            seen.add(piece["line"])
    assert seen == {r["source_line"] for r in kept}


def test_stdlib_sample_mostly_kept_with_defaults(tmp_path):
    corpus = str(tmp_path / "stdlib.jsonl")
    stdlib_corpus.main(["--output", corpus, "--limit", "40"])
    summary = curate_data.main(["--input", corpus, "--output", str(tmp_path / "clean.jsonl"), "--quiet"])
    assert summary["documents_in"] == 40
    assert summary["kept"] >= 0.95 * summary["documents_in"], summary
