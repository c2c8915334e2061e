"""The benchmark tools run and print their ratios against a baseline measured in the same run.

Speed itself is never asserted (docs/benchmarks.md); these prove the scripts work on CPU."""
import os
import re
import sys

import pytest

from tests.helpers import ROOT, run_tool, tool

# Megatron-LM's tools/preprocess_data.py, in miniature: its command line, a document for every text whose
# encoding is not empty (blank ones included), the eos token of tokenizer_config.json appended, GPT-2 from the
# vocab/merges files beside a "gpt2" folder (the hub model it loads). FLIP changes one token.
FAKE_MEGATRON = """
import argparse, json, os, sys
sys.path.insert(0, {root!r})
from tokenizers import Tokenizer, models, pre_tokenizers
from data.indexed import IndexedDatasetBuilder, token_dtype
p = argparse.ArgumentParser()
for flag in ("--input", "--output-prefix", "--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file",
             "--workers", "--log-interval"):
    p.add_argument(flag)
p.add_argument("--append-eod", action="store_true")
a = p.parse_args()
if a.tokenizer_type == "GPT2BPETokenizer":
    assert os.path.isdir("gpt2")
    tok = Tokenizer(models.BPE.from_file(a.vocab_file, a.merge_file))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    eod = tok.token_to_id("<|endoftext|>")
else:
    tok = Tokenizer.from_file(os.path.join(a.tokenizer_model, "tokenizer.json"))
    eod = tok.token_to_id(json.load(open(os.path.join(a.tokenizer_model, "tokenizer_config.json")))["eos_token"])
out = IndexedDatasetBuilder(a.output_prefix + "_text_document", token_dtype(tok.get_vocab_size()))
for i, line in enumerate(open(a.input)):
    ids = tok.encode(json.loads(line)["text"]).ids
    if ids:
        out.add_document(ids + [eod ^ 1 if {flip} and i == 3 else eod])
out.finalize()
"""


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


def test_bench_upload_prints_the_ratio_to_no_mirrors():
    out = tool("tools/bench_upload.py", "--hidden", "32", "--layers", "1", "--vocab", "100", "--steps", "4",
               "--save-every", "2", "--rounds", "1")
    ratio = re.search(r"mirrors=\[s3://\.\.\.\]: +median step [\d.]+ ms over 3 steps, ratio ([\d.]+)", out)
    assert float(ratio.group(1)) > 0
    cpu = re.search(r"CPU per copy of [\d.]+ MiB: copy process ([\d.]+) s .*, local store ([\d.]+) s, over (\d) "
                    r"copies", out)
    assert cpu and int(cpu.group(3)) >= 1 and float(cpu.group(1)) > 0 and float(cpu.group(2)) > 0, out


def test_bench_preprocess_checks_identical_output(tmp_path):
    tool("tools/stdlib_corpus.py", "--output", str(tmp_path / "c.jsonl"), "--limit", "20")
    tool("tools/train_tokenizer.py", "--input", str(tmp_path / "c.jsonl"), "--output-dir", str(tmp_path / "tok"),
         "--vocab-size", "400")
    out = tool("tools/bench_preprocess.py", "--input", str(tmp_path / "c.jsonl"), "--tokenizer-model",
               str(tmp_path / "tok" / "tokenizer.json"), "--workers", "1", "--context-cuts-too")
    assert "outputs identical: True" in out
    assert float(re.search(r"speed-up ([\d.]+)x", out).group(1)) > 0
    assert "trilith with --context-cuts" in out and "new chunks in pieces where no token spans" in out, out
    assert re.search(r"context rule: [\d,]+ of [\d,]+ places between two CJK letters cut", out), out


def test_bench_data_reads_both_kinds_of_shards():
    out = tool("tools/bench_data.py", "--synthetic-tokens", "300000", "--seq-length", "256", "--seconds", "0.3",
               "--block-tokens", "4096")
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (plain \.bin|zstd \.arrow) \|.*\| ([\d.]+)x \|",
                                                               out, re.M)}
    assert rows["plain .bin"] > 0 and rows["zstd .arrow"] > 0, out
    assert re.search(r"^\| plain \.bin \| [\d.,]+ \| [\d,]+ \| [\d,]+ \| 1\.00x \|", out, re.M), out
    assert float(re.search(r"compression ([\d.]+):1", out).group(1)) > 1.0


def _fake_megatron(path, flip):
    (path / "tools").mkdir(parents=True)
    (path / "tools" / "preprocess_data.py").write_text(FAKE_MEGATRON.format(root=str(ROOT), flip=flip))
    return str(path)


def test_bench_preprocess_against_megatron_command_line(tmp_path):
    """--megatron runs the tool with Megatron-LM's flags for each family, reads its output back and compares it
    document for document; blank documents only Megatron-LM keeps are counted; a changed token is reported."""
    from tests.helpers import write_jsonl
    tool("tools/stdlib_corpus.py", "--output", str(tmp_path / "c.jsonl"), "--limit", "12")
    texts = [__import__("json").loads(line)["text"] for line in open(tmp_path / "c.jsonl")]
    corpus = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts[:6] + ["", "  "] + texts[6:]])
    args = ["tools/bench_preprocess.py", "--input", corpus, "--families", "gpt2", "llama3", "metaspace",
            "--vocab-size", "400", "--workers", "1", "--megatron-python", sys.executable]
    out = tool(*args, "--megatron", _fake_megatron(tmp_path / "same", False))
    lines = re.findall(r"^  (\w+): megatron-lm preprocess .* vs megatron-lm ([\d.]+)x .* same tokens as "
                       r"megatron-lm: True \((\d+) blank", out, re.M)
    # "  " encodes to a space token everywhere; "" only to the BOS of the Llama-3 and Metaspace templates.
    assert [(f, int(b)) for f, _, b in lines] == [("gpt2", 1), ("llama3", 2), ("metaspace", 2)], out
    assert all(float(r) > 0 for _, r, _ in lines)
    done = run_tool(*args, "--megatron", _fake_megatron(tmp_path / "flip", True))
    assert done.returncode != 0 and "outputs differ for gpt2, llama3, metaspace" in done.stderr, done.stderr
    assert out.count("same tokens as megatron-lm: True") == 3


def test_bench_preprocess_refuses_a_missing_megatron(tmp_path):
    done = run_tool("tools/bench_preprocess.py", "--input", "x.jsonl", "--families", "gpt2", "--megatron",
                    str(tmp_path))
    assert done.returncode == 2 and "has no tools/preprocess_data.py" in done.stderr.splitlines()[-1]
    done = run_tool("tools/bench_preprocess.py", "--input", "x.jsonl", "--families", "gpt2", "--megatron",
                    _fake_megatron(tmp_path / "m", False), "--megatron-python", str(tmp_path / "nopython"))
    assert done.returncode == 2 and "--megatron-python" in done.stderr.splitlines()[-1]


MEGATRON = ROOT / "build" / "megatron-lm"
MEGATRON_PYTHON = ROOT / "build" / "megatron-venv" / "bin" / "python"


@pytest.mark.skipif(not (MEGATRON / "tools" / "preprocess_data.py").is_file() or not MEGATRON_PYTHON.is_file(),
                    reason="Megatron-LM is not set up in build/ (docs/benchmarks.md says how)")
def test_bench_preprocess_against_real_megatron(tmp_path):
    tool("tools/stdlib_corpus.py", "--output", str(tmp_path / "c.jsonl"), "--limit", "12")
    out = tool("tools/bench_preprocess.py", "--input", str(tmp_path / "c.jsonl"), "--families", "gpt2", "metaspace",
               "--vocab-size", "400", "--workers", "1", "--megatron", str(MEGATRON), "--megatron-python",
               str(MEGATRON_PYTHON), timeout=600)
    assert out.count("same tokens as megatron-lm: True") == 2, out


def test_bench_offload_prints_ratios_and_the_deepest_models():
    out = tool("tools/bench_offload.py", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn",
               "64", "--vocab", "64", "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1",
               "--overlap", "true", "--device-memory", "64MB")  # auto: off on a CPU device
    for fraction in ("0", "0.5", "1"):
        assert re.search(rf"^step at offload_fraction {fraction}: median [\d.]+ ms \(ratio [\d.]+\)", out, re.M)
        assert re.search(rf"^optimizer step at offload_fraction {fraction}: .* fastest [\d.]+ ms", out, re.M)
    for fraction in ("0.5", "1"):  # ZeRO-1 by default: host steps start during backward
        assert re.search(rf"^offload_fraction {fraction}: host AdamW [\d.]+ ms/step, \d+% of it behind backward", out,
                         re.M)
    deepest = [int(n) for n in re.findall(r"^deepest model fitting .*: (\d+) layers", out, re.M)]
    assert len(deepest) == 2 and deepest[1] > deepest[0] > 0  # offload leaves room for more layers


def test_bench_optim_prints_muon_against_adamw_and_the_newton_schulz_share():
    """TP 2: the owners spread the Newton–Schulz FLOPs over the TP ranks too (over DP: test_muon_parallel.py)."""
    out = tool("tools/bench_optim.py", "--hidden", "32", "--layers", "1", "--ffn", "64", "--vocab", "64", "--seq", "8",
               "--dp", "1", "--zero", "1", "--tensor", "2", "--rounds", "1")
    assert re.search(r"^zero 1 dp 1 tp 2: AdamW step [\d.]+ ms, Muon step [\d.]+ ms \(ratio [\d.]+\); "
                     r"Newton–Schulz per rank max [\d.]+ ms CPU \(1.00 of dp 1 tp 2\)", out, re.M), out
    shares = [int(s) for s in re.findall(r"^  rank \d: Newton–Schulz [\d.]+ ms CPU/step, (\d+)% of the FLOPs", out, re.M)]
    assert len(shares) == 2 and abs(sum(shares) - 100) <= 1 and min(shares) >= 40, out
