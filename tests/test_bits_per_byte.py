"""tools/evaluate.py: loss, perplexity and bits per byte, the same at every layout and for the HF export."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.indexed import IndexedDatasetBuilder
from engine.config.schema import load_config
from engine.evaluate.scoring import Scorer, rolling_windows
from engine.evaluate.text_tokenizer import TextTokenizer
from engine.model import CausalLM
from engine.observe.metrics import MetricsLog
from engine.train import Trainer
from parallel.context import ContextParallel
from parallel.distributed import DistEnv
from tests.distributed import WorkerPool, free_port
from tests.eval_fixtures import CORPUS, VOCAB, lm_eval_python, make_tokenizer, one_thread  # noqa: F401
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


def evaluate_at(rank, world, model, data, tensor, pipeline, window=0, context=1, context_attention="allgather"):
    torch.set_num_threads(1)
    return evaluate_tool.evaluate(model, data, tensor=tensor, pipeline=pipeline, rank=rank, world=world,
                                  window=window, context=context, context_attention=context_attention)


def transformers_nats(hf_dir, texts, tokenizer, eod, seq_length) -> float:
    """The same windows scored by transformers' LlamaForCausalLM: an implementation that is not ours."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for text in texts:
            for ids, n in rolling_windows(tokenizer.encode(text), eod, seq_length):
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


@pytest.mark.parametrize("window", [0, 15], ids=["seq-length", "odd-window"])
def test_context_parallel_scores_equal_one_process(pool, tmp_path, window):
    """--context 2 under each strategy (with DP2, TP2 or PP2 beside it) scores what one process scores, to 1e-5
    nats per token; a 15-token window pads each micro-batch to a multiple of 2c = 4 (padding is never scored)."""
    ckpt = train_and_save(tmp_path, 1)
    data = [write_jsonl(tmp_path / "docs.jsonl", DOCS)]
    one = evaluate_tool.evaluate(ckpt, data, window=window)["all"]
    for strategy, tensor, pipeline in (("allgather", 2, 1), ("ring", 1, 1), ("alltoall", 1, 2)):
        for got in pool.run(evaluate_at, ckpt, data, tensor, pipeline, window, 2, strategy):
            assert got["all"]["tokens"] == one["tokens"]
            assert abs(got["all"]["loss"] - one["loss"]) <= 1e-5, (strategy, got["all"], one)


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


def test_rolling_windows_are_lm_evaluation_harness_s():
    """Its get_rolling_token_windows(context_len=1) made disjoint, run in its own environment, for documents
    of lengths around multiples of the window (distinct tokens, so that every position is checked)."""
    cases = [(n, w) for w in (1, 4, 7) for n in sorted({1, w - 1, w, w + 1, 2 * w - 1, 2 * w, 2 * w + 1, 3 * w + 2})
             if n >= 1]
    script = ("import json, sys\nfrom lm_eval.utils import get_rolling_token_windows, make_disjoint_window\n"
              "print(json.dumps([[make_disjoint_window(p) for p in get_rolling_token_windows("
              "list(range(100, 100 + n)), 7, w, 1)] for n, w in json.load(sys.stdin)]))")
    run = subprocess.run([str(lm_eval_python()), "-c", script], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for (n, w), theirs in zip(cases, json.loads(run.stdout), strict=True):
        ours = rolling_windows(list(range(100, 100 + n)), 7, w)
        assert ours == [(context + scored, len(scored)) for context, scored in theirs], (n, w)


BOS = "<s>"
WINDOW = 16


def give_a_bos(hf_dir) -> int:
    """Make the export's tokenizer Llama-like: a BOS that its tokenizer_config.json declares (lm-eval's prefix
    token then) and that its post-processor puts before every text (lm-eval's encoding keeps it)."""
    from tokenizers import Tokenizer, processors
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok.add_special_tokens([BOS])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    tok.save(str(hf_dir / "tokenizer.json"))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((hf_dir / name).read_text())
        config["bos_token"] = BOS
        (hf_dir / name).write_text(json.dumps(config))
    return bos


def documents_around_multiples(tokenizer: TextTokenizer, prefix: int) -> list[str]:
    """Prefixes of the corpus whose encodings (BOS included) are 1, W - 1, W, W + 1, 2W - 1, 2W, 2W + 1 and 3W
    tokens long, for W = WINDOW."""
    text = "".join(sorted(set(CORPUS))) * 2
    found = {}
    for end in range(1, len(text)):
        found.setdefault(len(tokenizer.encode_as_harness(text[:end], prefix)), text[:end])
    targets = [2, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW - 1, 2 * WINDOW, 2 * WINDOW + 1, 3 * WINDOW]
    return [found[n] for n in targets]


def harness_bits_per_byte(tmp, hf_dir, data: str) -> float:
    """lm-evaluation-harness's own bits per byte of a loglikelihood_rolling task over `data`, at max_length WINDOW."""
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / "tiny_bpb.yaml").write_text(
        f"task: tiny_bpb\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: bits_per_byte\n")
    run = subprocess.run([str(lm_eval_python()), "-m", "lm_eval", "--model", "hf", "--model_args",
                          f"pretrained={hf_dir},dtype=float32,max_length={WINDOW}", "--tasks", "tiny_bpb",
                          "--include_path", str(tmp / "tasks"), "--device", "cpu", "--batch_size", "1",
                          "--output_path", str(tmp / "out")], capture_output=True, text=True, cwd=tmp,
                         env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(next((tmp / "out").rglob("results_*.json")).read_text())["results"]["tiny_bpb"][
        "bits_per_byte,none"]


def test_bits_per_byte_equal_lm_evaluation_harness_s_at_one_process_tp2_and_pp2(pool, tmp_path):
    """A model trained on the corpus (so that context pays), a Llama-like tokenizer (BOS prefix, BOS added to
    every text) and documents around multiples of the window: lm-eval's number to 1e-6 relative."""
    tok = make_tokenizer(tmp_path / "tok")
    tokenizer = TextTokenizer(tok)
    prefix = write_token_dataset(tmp_path / "corpus_text_document", CORPUS * 8, tokenizer, 0)
    ckpt = train_and_save(tmp_path, 40, "data.mock=false", f"data.paths=[{prefix}]", "data.split=100,0,0")
    hf = tmp_path / "hf"
    assert ckpt_convert.main(["--to", "hf", "--load-dir", ckpt, "--save-dir", str(hf)]) == 0
    bos = give_a_bos(hf)
    docs = documents_around_multiples(TextTokenizer(hf / "tokenizer.json"), bos)
    data = write_jsonl(tmp_path / "docs.jsonl", docs)
    one = evaluate_tool.evaluate(str(hf), [data], window=WINDOW)
    assert one["prefix_token"] == bos and one["window"] == WINDOW
    assert one["all"]["loss"] < 0.5 * math.log(VOCAB)  # it has learned the corpus: context matters
    theirs = harness_bits_per_byte(tmp_path, hf, data)
    assert abs(one["all"]["bits_per_byte"] - theirs) <= 1e-6 * theirs, (one["all"], theirs)
    for tensor, pipeline in ((2, 1), (1, 2)):  # each with DP2
        for got in pool.run(evaluate_at, str(hf), [data], tensor, pipeline, WINDOW):
            assert abs(got["all"]["bits_per_byte"] - theirs) <= 1e-6 * theirs, (tensor, pipeline, got, theirs)


def test_short_documents_cost_their_tokens_whatever_max_position_embeddings(tmp_path):
    """The forward's sequence lengths, counted by a hook, are the same for an 8192- and a 512-position config
    and no longer than the longest document's window."""
    ckpt = train_and_save(tmp_path, 1)
    assert ckpt_convert.main(["--to", "hf", "--load-dir", ckpt, "--save-dir", str(tmp_path / "hf")]) == 0
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS[:-1])
    longest = max(len(TextTokenizer(tmp_path / "tok" / "tokenizer.json").encode(t)) for t in DOCS[:-1])
    lengths = {}
    for context in (512, 8192):
        hf = tmp_path / f"hf{context}"
        shutil.copytree(tmp_path / "hf", hf)
        config = json.loads((hf / "config.json").read_text())
        config["max_position_embeddings"] = context
        (hf / "config.json").write_text(json.dumps(config))
        seen = lengths[context] = []
        hook = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: seen.append(args[0].shape[1]) if isinstance(module, CausalLM) else None)
        try:
            got = evaluate_tool.evaluate(str(hf), [data], batch=2)
        finally:
            hook.remove()
        assert got["window"] == context
    assert lengths[512] == lengths[8192] and max(lengths[8192]) == longest  # [eod] + tokens, less the last


def test_a_micro_batch_is_as_long_as_its_longest_request_rounded_for_sequence_and_context_parallelism():
    scorer = Scorer([], 8, "cpu", sequence_shards=2)
    mb = scorer.micro_batch([([1, 2, 3, 4], 2), ([5, 6], 1)])
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 0], [5, 6, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    scorer.window = 9  # a long request keeps its last window + 1 tokens, as lm-eval truncates on the left
    assert scorer.micro_batch([(list(range(20)), 3)]).tokens[0].tolist() == list(range(10, 20)) + [0]
    # context parallelism at c = 2: 2c = 4 chunks, each rank's 2 chunks split again over 2 SP ranks
    assert Scorer([], 8, "cpu", context=ContextParallel(size=2)).micro_batch([([1, 2, 3], 2)]).tokens.shape[1] == 5
    assert Scorer([], 8, "cpu", sequence_shards=4, context=ContextParallel(size=2)).micro_batch(
        [([1, 2, 3], 2)]).tokens.shape[1] == 9
