"""tools/evaluate.py: loss, perplexity and bits per byte, the same at every layout and for the HF export."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.indexed import IndexedDatasetBuilder
from engine.config.schema import load_config
from engine.evaluate.text_tokenizer import TextTokenizer
from engine.observe.metrics import MetricsLog
from engine.train import Trainer
from parallel.distributed import DistEnv
from tests.distributed import WorkerPool, free_port
from tests.eval_fixtures import CORPUS, VOCAB, make_tokenizer, one_thread  # noqa: F401 (autouse fixture)
from tools import ckpt_convert
from tools import evaluate as evaluate_tool

TINY = "launch/configs/tiny.yaml"
DOCS = sorted(set(CORPUS)) + ["x = [i * i for i in range(100)]\n" * 6]  # the last one spans several windows


@pytest.fixture(scope="module")
def pool():
    made = WorkerPool(4)
    yield made
    made.close()


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def write_token_dataset(prefix, texts, tokenizer, eod):
    builder = IndexedDatasetBuilder(str(prefix), np.uint16)
    for text in texts:
        builder.add_document(np.array(tokenizer.encode(text) + [eod]))
    builder.finalize()
    return str(prefix)


def test_bits_per_byte_of_a_uniform_model_by_hand(tmp_path):
    """Output layer zero: every token costs ln V nats, so bits/byte = tokens · log2 V / bytes (23 characters,
    3 of them 2 bytes and 3 of them 3 bytes in UTF-8: 32 bytes)."""
    from safetensors.torch import load_file, save_file
    ckpt = train_and_save(tmp_path, 1)
    assert ckpt_convert.main(["--to", "hf", "--load-dir", ckpt, "--save-dir", str(tmp_path / "hf")]) == 0
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["lm_head.weight"].zero_()
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    text = "héllo wörld, ça va? 日本語"
    tokens = len(TextTokenizer(tmp_path / "tok" / "tokenizer.json").encode(text))
    got = evaluate_tool.evaluate(str(tmp_path / "hf"), [write_jsonl(tmp_path / "t.jsonl", [text])])["all"]
    assert len(text.encode("utf-8")) == got["bytes"] == 32 and got["tokens"] == tokens
    assert got["loss"] == pytest.approx(math.log(VOCAB), abs=1e-5)
    assert got["perplexity"] == pytest.approx(VOCAB, rel=1e-4)
    assert got["bits_per_byte"] == pytest.approx(tokens * math.log2(VOCAB) / 32, rel=1e-6)


def train_and_save(tmp, steps, *layout, rank=0, world=1) -> str:
    torch.set_num_threads(1)
    tok = tmp / "tok" / "tokenizer.json"
    if rank == 0 and world == 1:
        make_tokenizer(tmp / "tok")
    cfg = load_config(TINY, ["model.num_layers=2", f"model.vocab_size={VOCAB}", f"train.steps={steps}",
                             f"data.tokenizer={tok}", f"checkpoint.interval={steps}", f"run.dir={tmp / 'run'}",
                             *layout])
    (tmp / "run").mkdir(parents=True, exist_ok=True)
    Trainer(cfg, DistEnv(rank, world)).train(MetricsLog(tmp / "run", enabled=False))
    return str(tmp / "run" / "checkpoints")


def train_at(rank, world, tmp, steps, *layout) -> str:
    return train_and_save(tmp, steps, *layout, rank=rank, world=world)


def evaluate_at(rank, world, model, data, tensor, pipeline):
    torch.set_num_threads(1)
    return evaluate_tool.evaluate(model, data, tensor=tensor, pipeline=pipeline, rank=rank, world=world)


def transformers_nats(hf_dir, texts, tokenizer, eod, seq_length) -> float:
    """The same windows scored by transformers' LlamaForCausalLM: an implementation that is not ours."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for text in texts:
            for ids, n in evaluate_tool.windows(tokenizer.encode(text), eod, seq_length):
                logp = model(torch.tensor([ids[:-1]])).logits[0].log_softmax(-1)
                total -= sum(logp[j, ids[j + 1]].item() for j in range(len(ids) - 1 - n, len(ids) - 1))
    return total


def test_same_numbers_at_every_layout_for_a_zero3_checkpoint_and_its_hf_export(pool, tmp_path):
    make_tokenizer(tmp_path / "tok")
    pool.run(train_at, tmp_path, 2, "parallel.zero_stage=3")  # saved by 4 ranks, each with a shard
    ckpt = str(tmp_path / "run" / "checkpoints")
    tokenizer = TextTokenizer(tmp_path / "tok" / "tokenizer.json")
    data = [write_jsonl(tmp_path / "docs.jsonl", DOCS), write_token_dataset(tmp_path / "docs_text_document", DOCS,
                                                                           tokenizer, 0)]
    one = evaluate_tool.evaluate(ckpt, data)
    first, tokens = one["datasets"][data[0]], one["datasets"][data[1]]
    # the token dataset decodes to the same text: the same tokens, bytes and nats
    assert (first["tokens"], first["bytes"]) == (tokens["tokens"], tokens["bytes"])
    assert tokens["nats"] == pytest.approx(first["nats"], abs=1e-4)
    assert first["bytes"] == sum(len(t.encode("utf-8")) for t in DOCS)
    assert one["all"]["bits_per_byte"] == pytest.approx(one["all"]["nats"] / math.log(2) / one["all"]["bytes"])
    for got in pool.run(evaluate_at, ckpt, data, 2, 2):  # TP2 × PP2
        for key in ("loss", "bits_per_byte"):
            assert abs(got["all"][key] - one["all"][key]) <= 1e-5, (got, one)
    assert ckpt_convert.main(["--to", "hf", "--load-dir", ckpt, "--save-dir", str(tmp_path / "hf")]) == 0
    hf = evaluate_tool.evaluate(str(tmp_path / "hf"), data)
    for key in ("loss", "perplexity", "bits_per_byte"):
        assert abs(hf["all"][key] - one["all"][key]) <= 1e-4, (key, hf, one)
    reference = transformers_nats(tmp_path / "hf", DOCS, tokenizer, 0, 32)
    assert abs(reference - first["nats"]) <= 1e-4 * first["tokens"], (reference, first)


def test_bad_input_is_one_line(tmp_path, capsys):
    ckpt = train_and_save(tmp_path, 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    assert evaluate_tool.main(["--model", ckpt, "--data", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"evaluate: {bad} line 2: not a JSON object with a text string under 'text' (choose the key " \
                  f"with --text-key)"
    assert evaluate_tool.main(["--model", str(tmp_path / "nothing"), "--data", str(bad)]) == 1
    assert "neither a Trilith checkpoint" in capsys.readouterr().err
    out = tmp_path / "eval.json"
    assert evaluate_tool.main(["--model", ckpt, "--data", write_jsonl(tmp_path / "ok.jsonl", DOCS[:2]),
                               "--output", str(out)]) == 0
    assert json.loads(out.read_text())["step"] == 1


def test_command_line_under_torchrun_at_pp2_equals_one_process(tmp_path):
    ckpt = train_and_save(tmp_path, 1)
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    torchrun = Path(sys.executable).parent / "torchrun"
    run = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
                          "tools/evaluate.py", "--model", ckpt, "--data", data, "--pipeline", "2", "--output",
                          str(tmp_path / "pp2.json")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((tmp_path / "pp2.json").read_text())["all"]
    want = evaluate_tool.evaluate(ckpt, [data])["all"]
    assert abs(got["bits_per_byte"] - want["bits_per_byte"]) <= 1e-5 and got["tokens"] == want["tokens"]
