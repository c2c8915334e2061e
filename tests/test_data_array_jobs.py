"""curate_data / preprocess_data as array tasks plus a merge (data/offline/shards.py): the shards cover the corpus
exactly, near-duplicates are found across shards, the merged outputs equal one process's byte for byte, and a
finished task is not redone."""
import json
import os
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from data.offline.corpus_io import iter_records, shard_ranges
from tools import curate_data, preprocess_data, train_tokenizer

VOCAB = ("river stone garden window paper market letter winter music orange silver forest bridge doctor "
         "teacher island engine candle mirror pocket ticket violin harbor meadow lantern village").split()


def planted_corpus(directory, files=4, per_file=12):
    """`files` JSONL files; every document of the last two files is a near-copy (one word changed) or an
    exact copy of one in the first two, so duplicates span input files and shards."""
    rngs = [random.Random(i) for i in range(files * per_file)]
    originals = [" ".join(rng.choice(VOCAB) for _ in range(80)) + "." for rng in rngs]
    paths = []
    for f in range(files):
        path = os.path.join(directory, f"raw{f}.jsonl")
        with open(path, "w", encoding="utf-8") as out:
            for j in range(per_file):
                k = f * per_file + j
                text = originals[k]
                if f >= files // 2:
                    words = originals[k - files // 2 * per_file].split()
                    if j % 3:
                        words[-1] = "zebra."
                    text = " ".join(words)
                out.write(json.dumps({"text": text, "id": k}) + "\n")
                if j == 4:
                    out.write("\n{not json\n")
        paths.append(path)
    return paths


def read(path):
    with open(path, "rb") as f:
        return f.read()


def same_provenance(a, b, renamed=None):
    """The provenance maps hold the same source table (`renamed`: {a's name: b's}) and (file, line) per
    document (the .npz files differ in their zip timestamps)."""
    with np.load(f"{a}.prov.npz") as x, np.load(f"{b}.prov.npz") as y:
        files = [(renamed or {}).get(str(f), str(f)) for f in x["files"]]
        return (files == [str(f) for f in y["files"]] and np.array_equal(x["file_id"], y["file_id"])
                and np.array_equal(x["line"], y["line"]))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    corpus = os.path.join(d, "c.jsonl")
    with open(corpus, "w") as f:
        f.writelines(json.dumps({"text": " ".join(VOCAB[i:] + VOCAB[:i])}) + "\n" for i in range(len(VOCAB)))
    train_tokenizer.main(["--input", corpus, "--output-dir", str(d / "tok"), "--vocab-size", "300",
                          "--min-frequency", "1", "--holdout-fraction", "0"])
    return str(d / "tok" / "tokenizer.json")


@settings(max_examples=25, deadline=None)
@given(lines=st.lists(st.sampled_from(['{"text": "a"}', '{"text": "bb cc"}', "", "x" * 40, '{"t":1}']),
                      max_size=30),
       bom=st.booleans(), shards=st.integers(1, 7), split=st.integers(0, 30))
def test_shards_read_every_record_once_in_order(tmp_path_factory, lines, bom, shards, split):
    d = tmp_path_factory.mktemp("c")
    files = []
    for name, part in (("a.jsonl", lines[:split]), ("b.jsonl", lines[split:])):
        path = str(d / name)
        with open(path, "wb") as f:
            f.write((b"\xef\xbb\xbf" if bom else b"") + "".join(line + "\n" for line in part).encode())
        files.append(path)
    whole = list(iter_records(files, ["text"]))
    parts = [r for i in range(shards) for r in iter_records(files, ["text"], ranges=shard_ranges(files, i, shards))]
    assert parts == whole


def curate_args(paths, output, *extra):
    return ["--input", *paths, "--output", output, "--quiet", *extra]


def test_four_tasks_equal_one_process_and_finished_tasks_are_skipped(tmp_path, tokenizer, capsys):
    paths = planted_corpus(str(tmp_path))
    single = curate_data.main(curate_args(paths, str(tmp_path / "one.jsonl")))
    assert single["dropped_by_stage"]["dedup"] == {"near_duplicate": 16, "exact_duplicate": 8}
    assert single["dropped_by_stage"]["input"] == {"malformed_json": 4}
    out = str(tmp_path / "four.jsonl")
    assert all(curate_data.main(curate_args(paths, out, "--num-shards", "4", "--shard-index", str(i)))
               for i in range(4))
    with pytest.raises(SystemExit, match="cannot merge: task"):
        curate_data.main(curate_args(paths, out, "--num-shards", "4", "--merge-shards", "--dedup-threshold", "0.7"))
    marker = tmp_path / "four.jsonl.shards" / "shard-00002-of-00004" / "done.json"
    before = marker.stat().st_mtime_ns
    assert curate_data.main(curate_args(paths, out, "--num-shards", "4", "--shard-index", "2")) is False
    assert marker.stat().st_mtime_ns == before and "already done" in capsys.readouterr().out
    merged = curate_data.main(curate_args(paths, out, "--num-shards", "4", "--merge-shards"))
    assert read(out) == read(tmp_path / "one.jsonl")
    assert read(merged["rejects"]) == read(single["rejects"])
    assert {k: merged[k] for k in ("kept", "dropped_by_stage")} == {k: single[k] for k in ("kept", "dropped_by_stage")}

    prep = ["--input", out, "--tokenizer-model", tokenizer, "--append-eod", "--quiet"]
    preprocess_data.main([*prep, "--output-prefix", str(tmp_path / "t1")])
    for i in (3, 0, 2, 1):
        preprocess_data.main([*prep, "--output-prefix", str(tmp_path / "t4"), "--num-shards", "4",
                              "--shard-index", str(i)])
    preprocess_data.main([*prep, "--output-prefix", str(tmp_path / "t4"), "--num-shards", "4", "--merge-shards"])
    for ext in (".bin", ".idx"):
        assert read(str(tmp_path / "t4_text_document") + ext) == read(str(tmp_path / "t1_text_document") + ext)
    assert same_provenance(tmp_path / "t4_text_document", tmp_path / "t1_text_document")


def test_changed_input_reruns_its_task_and_merge_names_missing_ones(tmp_path, tokenizer, capsys):
    paths = planted_corpus(str(tmp_path), files=2)
    out = str(tmp_path / "clean.jsonl")
    curate_data.main(curate_args(paths, out, "--num-shards", "2", "--shard-index", "0"))
    with pytest.raises(SystemExit, match=r"task\(s\) 1 not finished"):
        curate_data.main(curate_args(paths, out, "--num-shards", "2", "--merge-shards"))
    with open(paths[0], "r+b") as f:  # same size, other bytes: the hash tells
        f.seek(20)
        f.write(b"Q")
    assert curate_data.main(curate_args(paths, out, "--num-shards", "2", "--shard-index", "0")) is True
    with pytest.raises(SystemExit):
        curate_data.main(curate_args(paths, out, "--num-shards", "2", "--shard-index", "2"))
    assert "outside 0..1" in capsys.readouterr().err


def test_local_driver_runs_the_tasks_as_processes_then_the_merge(tmp_path):
    """launch/run_data_job.sh --local: the same tasks and merge as on SLURM, as processes here."""
    import subprocess
    import sys
    driver = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "run_data_job.sh")
    paths = planted_corpus(str(tmp_path), files=2)
    single = curate_data.main(curate_args(paths, str(tmp_path / "one.jsonl"), "--no-dedup"))
    env = dict(os.environ, TRILITH_PYTHON=sys.executable)
    done = subprocess.run(["bash", driver, "--tasks", "3", "--local", "curate",
                           *curate_args(paths, str(tmp_path / "three.jsonl"), "--no-dedup")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert read(tmp_path / "three.jsonl") == read(tmp_path / "one.jsonl")
    assert read(tmp_path / "three.rejects.jsonl") == read(single["rejects"])
    bad = subprocess.run(["bash", driver, "--tasks", "0", "curate"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--tasks needs a positive number" in bad.stderr
