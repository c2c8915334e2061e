"""The benchmark tools run and print their ratios against a baseline measured in the same run.

Speed itself is never asserted (docs/benchmarks.md); these prove the scripts work on CPU."""
import re

from tests.helpers import tool


def test_bench_train_prints_ratio():
    out = tool("tools/bench_train.py", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn",
               "64", "--vocab", "64", "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1")
    assert re.search(r"^trilith\s+[\d,]+ tokens/s$", out, re.M)
    assert re.search(r"^transformers\s+[\d,]+ tokens/s$", out, re.M)
    assert float(re.search(r"ratio trilith/transformers: ([\d.]+)", out).group(1)) > 0


def test_bench_checkpoint_prints_ratios(tmp_path):
    out = tool("tools/bench_checkpoint.py", "--dir", str(tmp_path), "--hidden", "32", "--layers", "1", "--vocab",
               "100", "--repeat", "1")
    assert float(re.search(r"save: .* ratio ([\d.]+) of raw write", out).group(1)) > 0
    assert float(re.search(r"load: .* ratio ([\d.]+) of raw read", out).group(1)) > 0


def test_bench_preprocess_checks_identical_output(tmp_path):
    tool("tools/stdlib_corpus.py", "--output", str(tmp_path / "c.jsonl"), "--limit", "20")
    tool("tools/train_tokenizer.py", "--input", str(tmp_path / "c.jsonl"), "--output-dir", str(tmp_path / "tok"),
         "--vocab-size", "400")
    out = tool("tools/bench_preprocess.py", "--input", str(tmp_path / "c.jsonl"), "--tokenizer-model",
               str(tmp_path / "tok" / "tokenizer.json"), "--workers", "1")
    assert "outputs identical: True" in out
    assert float(re.search(r"speed-up ([\d.]+)x", out).group(1)) > 0


def test_bench_data_reads_both_kinds_of_shards():
    out = tool("tools/bench_data.py", "--synthetic-tokens", "300000", "--seq-length", "256", "--seconds", "0.3",
               "--block-tokens", "4096")
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (plain \.bin|zstd \.arrow) \|.*\| ([\d.]+)x \|",
                                                               out, re.M)}
    assert rows["plain .bin"] > 0 and rows["zstd .arrow"] > 0, out
    assert re.search(r"^\| plain \.bin \| [\d.,]+ \| [\d,]+ \| [\d,]+ \| 1\.00x \|", out, re.M), out
    assert float(re.search(r"compression ([\d.]+):1", out).group(1)) > 1.0
