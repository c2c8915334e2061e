"""Multiple-choice tasks in the run (train.eval_tasks): lm-evaluation-harness's scoring, at every layout.

The reference is lm-evaluation-harness itself (installed once into build/lm-eval-venv beside this
checkout's packages) run on the Hugging Face export; its per-choice log-likelihoods must equal ours."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from engine.checkpoint.model_source import ModelSource, load_single_model
from engine.config.schema import ConfigError, load_config, validate
from engine.evaluate.scoring import Scorer
from engine.evaluate.tasks import TaskItem, accuracy, encode_pair, load_task, requests
from engine.evaluate.text_tokenizer import TextTokenizer
from engine.model import CausalLM
from engine.observe.metrics import MetricsLog
from engine.train import Trainer
from parallel.distributed import DistEnv
from tests.distributed import WorkerPool
from tests.eval_fixtures import VOCAB, lm_eval_python, make_tokenizer, one_thread, write_task  # noqa: F401
from tools import ckpt_convert, tasks_from_lm_eval

TINY = "launch/configs/tiny.yaml"


@pytest.fixture(scope="module")
def pool():
    made = WorkerPool(4)
    yield made
    made.close()


def test_encode_pair_moves_trailing_spaces_to_the_continuation_as_lm_eval_does(tmp_path):
    tok = TextTokenizer(make_tokenizer(tmp_path))
    head, tail = encode_pair(tok.encode, "import ", " os")
    assert head == tok.encode("import") and head + tail == tok.encode("import  os")
    head, tail = encode_pair(tok.encode, "for i in", " range(10):")
    assert head + tail == tok.encode("for i in range(10):") and tail


def test_acc_and_acc_norm_by_hand():
    items = [TaskItem("q", ["a", "bbbb"], 1), TaskItem("q", ["cc", "d"], 0)]
    # item 1: log-likelihoods -2 vs -4 → acc picks "a" (wrong); per character -2 vs -1 → acc_norm "bbbb" (right)
    # item 2: -1 vs -3 → both right
    assert accuracy(items, [2.0, 4.0, 1.0, 3.0]) == {"acc": 0.5, "acc_norm": 1.0}


@pytest.mark.parametrize("line, where", [("{\"context\": \"x\", \"choices\": [\"a\"], \"gold\": 0}", "line 2"),
                                         ("{\"context\": \"x\", \"choices\": [\"a\", \"b\"], \"gold\": 2}", "line 2"),
                                         ("not json", "line 2")])
def test_malformed_task_file_is_one_line_naming_file_and_line(tmp_path, line, where):
    path = tmp_path / "t.jsonl"
    path.write_text('{"context": "x", "choices": ["a", "b"], "gold": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{path} {where} is not a task item"):
        load_task(path)
    with pytest.raises(ConfigError, match="train.eval_tasks needs train.eval_tasks_interval > 0"):
        validate(load_config(TINY, [f"train.eval_tasks=[{path}]", "data.tokenizer=t.json"]), 1)
    with pytest.raises(ConfigError, match="train.eval_window=33 is longer than the model's context"):
        validate(load_config(TINY, ["train.eval_window=33"]), 1)


def reference_nll(model, reqs) -> list[float]:
    """Summed -log p of each request's last tokens from the full logits of one forward (no loss mask)."""
    out = []
    with torch.no_grad():
        for ids, n in reqs:
            logits = model.full_logits(model(torch.tensor([ids[:-1]])))[0].float().log_softmax(-1)
            out.append(-sum(logits[j, ids[j + 1]].item() for j in range(len(ids) - 1 - n, len(ids) - 1)))
    return out


def task_overrides(tmp: Path) -> list[str]:
    tok = make_tokenizer(tmp / "tok")
    task = write_task(tmp / "tiny_mc.jsonl")
    return ["model.num_layers=2", f"model.vocab_size={VOCAB}", f"data.tokenizer={tok}", f"train.eval_tasks=[{task}]",
            "train.eval_tasks_interval=2", "train.steps=4"]


def in_run_scores(rank, world, overrides):
    torch.set_num_threads(1)
    trainer = Trainer(load_config(TINY, overrides), DistEnv(rank, world))
    record = trainer.tasks.evaluate()
    items, reqs = trainer.tasks.suite.tasks["tiny_mc"]
    return record, trainer.tasks.scorer.nll_sums(reqs)


def test_in_run_task_scores_equal_the_reference_under_tp2_pp2_zero3_and_cp2(pool, tmp_path):
    common = task_overrides(tmp_path)
    trainer = Trainer(load_config(TINY, common), DistEnv())
    _, reqs = trainer.tasks.suite.tasks["tiny_mc"]
    want = reference_nll(trainer.chunks[0], reqs)
    seen = []  # each request's forward is as long as the request, not model.seq_length
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: seen.append(args[0].shape[1]) if isinstance(module, CausalLM) else None)
    try:
        record, got = in_run_scores(0, 1, common)
    finally:
        hook.remove()
    assert sorted(seen) == sorted(2 * [len(ids) - 1 for ids, _ in reqs])  # evaluate(), then nll_sums again
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4
    for layout in (["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true"],
                   ["parallel.pipeline=2", "parallel.zero_stage=3"],  # with DP=2
                   ["parallel.context=2", "parallel.context_attention=ring", "parallel.pipeline=2"]):
        for rank_record, rank_sums in pool.run(in_run_scores, common + layout):
            assert max(abs(a - b) for a, b in zip(rank_sums, want)) <= 1e-4, (layout, rank_sums, want)
            assert rank_record == record


def test_task_accuracy_is_logged_at_its_interval(tmp_path):
    cfg = load_config(TINY, task_overrides(tmp_path) + [f"run.dir={tmp_path / 'run'}"])
    (tmp_path / "run").mkdir()
    records = Trainer(cfg, DistEnv()).train(MetricsLog(tmp_path / "run", enabled=True, console=lambda line: None))
    assert [r["step"] for r in records if "tiny_mc/acc" in r] == [2, 4]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"tiny_mc/acc", "tiny_mc/acc_norm"} <= set(logged[-1])


def test_scores_equal_lm_evaluation_harness_on_the_hf_export(tmp_path):
    overrides = task_overrides(tmp_path) + ["train.steps=3", "checkpoint.interval=3", f"run.dir={tmp_path / 'run'}"]
    (tmp_path / "run").mkdir()
    trainer = Trainer(load_config(TINY, overrides), DistEnv())
    trainer.train(MetricsLog(tmp_path / "run", enabled=False))
    assert ckpt_convert.main(["--to", "hf", "--load-dir", str(tmp_path / "run" / "checkpoints"),
                              "--save-dir", str(tmp_path / "hf")]) == 0
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'tiny_mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    run = subprocess.run([str(lm_eval_python()), "-m", "lm_eval", "--model", "hf", "--model_args",
                          f"pretrained={tmp_path / 'hf'},dtype=float32", "--tasks", "tiny_mc", "--include_path",
                          str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "1", "--output_path",
                          str(tmp_path / "out"), "--log_samples"], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_tiny_mc_*.jsonl")).open()]
    theirs = [-float(resp[0]) for row in sorted(samples, key=lambda r: r["doc_id"]) for resp in row["filtered_resps"]]
    items = load_task(tmp_path / "tiny_mc.jsonl")
    source = ModelSource(tmp_path / "run" / "checkpoints")
    model = load_single_model(source)
    ours = Scorer([model], model.cfg.seq_length, "cpu").nll_sums(
        requests(items, TextTokenizer(tmp_path / "tok" / "tokenizer.json").encode))
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-4, (ours, theirs)
    result = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]["tiny_mc"]
    mine = accuracy(items, ours)
    assert (result["acc,none"], result["acc_norm,none"]) == (mine["acc"], mine["acc_norm"])
    assert mine == {k.split("/")[1]: v for k, v in trainer.tasks.evaluate().items()}
    # lm-eval's logged items convert back to the task file they came from
    samples_file = next((tmp_path / "out").rglob("samples_tiny_mc_*.jsonl"))
    assert tasks_from_lm_eval.main([str(samples_file), str(tmp_path / "converted.jsonl")]) == 0
    assert load_task(tmp_path / "converted.jsonl") == items


def test_converter_refuses_what_it_cannot_represent(tmp_path, capsys):
    row = {"doc_id": 0, "target": "0", "arguments": {"gen_args_0": {"arg_0": "x", "arg_1": "a"},
                                                      "gen_args_1": {"arg_0": "x", "arg_1": "b"}}}
    (tmp_path / "s.jsonl").write_text(json.dumps(row) + "\n")
    assert tasks_from_lm_eval.main([str(tmp_path / "s.jsonl"), str(tmp_path / "o.jsonl")]) == 1
    assert "line 1: a continuation does not start with the target_delimiter" in capsys.readouterr().err
