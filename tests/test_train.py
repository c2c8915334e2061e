"""Single-process and local multi-process training runs through launch/run_pretrain.sh."""
import pytest
import yaml

from tests.helpers import TINY, launch, launch_process, tool


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("single"))


def test_single_process_run_writes_run_dir_and_learns(single, tmp_path_factory):
    assert [r["step"] for r in single] == list(range(1, 21))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "consumed_tokens", "peak_memory_gb"):
        assert key in single[0]
    assert single[-1]["loss"] < single[0]["loss"] - 1.0
    assert single[-1]["consumed_tokens"] == 20 * 8 * 32


def test_resolved_config_is_saved(tmp_path):
    launch(tmp_path, "train.steps=1", "optim.lr=1e-3")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 1e-3 and saved["train"]["steps"] == 1
    assert (tmp_path / "logs" / "train.log").read_text().count("step") >= 1
    assert (tmp_path / "checkpoints").is_dir()


@pytest.mark.parametrize("layout", [["parallel.tensor=2"], ["parallel.tensor=2", "parallel.sequence_parallel=true"],
                                    []], ids=["tp2", "tp2-sp", "dp2"])
def test_two_processes_follow_the_single_process_curve(single, tmp_path, layout):
    multi = launch(tmp_path, *layout, nproc=2)
    for a, b in zip(single, multi):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a["step"], a["loss"], b["loss"])


def test_config_error_exits_2_with_message(tmp_path):
    done = launch_process(tmp_path, "parallel.tensor=3")
    assert done.returncode == 2
    assert "num_attention_heads=4 is not divisible by parallel.tensor=3" in done.stderr


@pytest.mark.parametrize("overrides, status, message", [
    (["data.mock=false", "data.paths=[/nonexistent/corpus_text_document]"], 2,
     "configuration error: data.paths: token shard '/nonexistent/corpus_text_document.bin' does not exist"),
    (["checkpoint.load=/nonexistent/checkpoints"], 1,
     "checkpoint error: checkpoint.load=/nonexistent/checkpoints is neither a checkpoint directory"),
])
def test_bad_inputs_end_with_one_clear_line_not_a_traceback(tmp_path, overrides, status, message):
    done = launch_process(tmp_path, *overrides)
    assert done.returncode == status and message in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_bf16_run_trains(tmp_path):
    records = launch(tmp_path, "train.precision=bf16", "train.steps=10")
    assert records[-1]["loss"] < records[0]["loss"]


def test_training_on_preprocessed_shards(tmp_path):
    """The real data path end to end: corpus → tokenizer → zstd-compressed shards → training at DP=2, with
    the losses of the same run on the plain .bin/.idx made from them."""
    tool("tools/stdlib_corpus.py", "--output", str(tmp_path / "c.jsonl"), "--limit", "40")
    tool("tools/train_tokenizer.py", "--input", str(tmp_path / "c.jsonl"), "--output-dir", str(tmp_path / "tok"),
         "--vocab-size", "512")
    tool("tools/preprocess_data.py", "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "d"),
         "--tokenizer-model", str(tmp_path / "tok" / "tokenizer.json"), "--append-eod", "--workers", "1",
         "--compression", "zstd")
    assert (tmp_path / "d_text_document.arrow").is_file() and not (tmp_path / "d_text_document.bin").exists()
    data = ["data.mock=false", f"data.paths=[{tmp_path / 'd_text_document'}]", "model.vocab_size=512",
            f"data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}"]
    # Validation on the held-out documents (split 90,10,0), documents kept apart (EOD id from the tokenizer).
    options = ["train.steps=6", "data.split=90,10,0", "train.eval_interval=3", "train.eval_iters=2",
               "data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true"]
    records = launch(tmp_path / "run", *data, *options, nproc=2)
    assert len(records) == 6 and records[-1]["loss"] < records[0]["loss"]
    tool("tools/preprocess_data.py", "merge", "--inputs", str(tmp_path / "d_text_document"), "--output-prefix",
         str(tmp_path / "plain_text_document"))
    plain = launch(tmp_path / "plain_run", *data, f"data.paths=[{tmp_path / 'plain_text_document'}]", *options,
                   nproc=2)
    assert [(r["loss"], r.get("eval_loss")) for r in plain] == [(r["loss"], r.get("eval_loss")) for r in records]
    assert records[-1]["consumed_samples"] == 6 * 8
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert records[5]["eval_loss"] < records[2]["eval_loss"]

    no_valid = launch_process(tmp_path / "nv", *data, "data.split=100,0,0", "train.eval_interval=3")
    assert no_valid.returncode == 2
    assert "leaves no documents for the valid split" in no_valid.stderr and "train.eval_interval=0" in no_valid.stderr
    assert "step      1" not in no_valid.stdout  # refused before training, not at the first evaluation

    too_small = launch_process(tmp_path / "bad", "data.mock=false", f"data.paths=[{tmp_path / 'd_text_document'}]",
                               "model.vocab_size=100")
    assert too_small.returncode == 2
    assert "but model.vocab_size=100; set model.vocab_size to at least" in too_small.stderr



def test_mid_run_micro_batch_switch_under_pipeline(single, tmp_path):
    """Switching recompute on and doubling the micro batch at step 5 keeps the PP=2 curve on the reference."""
    multi = launch(tmp_path, "parallel.pipeline=2", "train.recompute_switch_step=5", "train.recompute_after_switch=full",
                   "train.micro_batch_size_after_switch=4", nproc=2)
    for a, b in zip(single, multi):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a["step"], a["loss"], b["loss"])


def test_wall_time_checkpoints_agree_across_ranks(tmp_path):
    """Rank 0's clock decides (a broadcast), so both ranks save the same steps: here every one of them."""
    launch(tmp_path, "train.steps=4", "checkpoint.interval_minutes=1e-9", "checkpoint.keep=2", nproc=2)
    saved = sorted(d.name for d in (tmp_path / "checkpoints").iterdir() if d.name.startswith("step_"))
    assert saved == ["step_00000003", "step_00000004"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip().endswith("step_00000004")


def test_a_config_error_in_the_first_batch_leaves_no_prefetch_thread(tmp_path):
    """The vocabulary check fails on the first batch, which started the loader's prefetch thread: run() must
    stop it (left reading at interpreter exit, it aborted the process now and then: status -6, "terminate
    called without an active exception"). Also a switch of micro batch closes the loader it replaces."""
    import threading

    import numpy as np

    from data.indexed import IndexedDatasetBuilder
    from engine.config.schema import ConfigError, load_config, validate
    from engine.train import Trainer, run
    from parallel.distributed import DistEnv

    builder = IndexedDatasetBuilder(str(tmp_path / "d"), np.int32)
    for doc in range(50):
        builder.add_document(np.arange(40) + doc)  # ids up to 88
    builder.finalize()
    data = ["data.mock=false", f"data.paths=[{tmp_path / 'd'}]", "data.split=100,0,0"]
    cfg = load_config(TINY, [*data, "model.vocab_size=64", f"run.dir={tmp_path / 'run'}"])
    validate(cfg, 1)
    before = set(threading.enumerate())  # in-process tests elsewhere may leave loaders of their own
    with pytest.raises(ConfigError, match=r"holds token id \d+ but model.vocab_size=64"):
        run(cfg, DistEnv())
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("trilith-data")]

    cfg = load_config(TINY, [*data, "model.vocab_size=128", "train.recompute_switch_step=2",
                             "train.micro_batch_size_after_switch=4", f"run.dir={tmp_path / 'switch'}"])
    validate(cfg, 1)
    trainer = Trainer(cfg, DistEnv())
    first = trainer.loader
    trainer.train_step()
    trainer.train_step()
    assert trainer.loader is not first and first._thread is None  # replaced at the switch, and stopped
    trainer.loader.close()


def test_preparing_a_step_reads_no_tensor_back_to_the_host(monkeypatch):
    """The token-id check runs on the loader's host arrays before the copy: on a GPU, reading a bound from a
    device tensor would stall the host once per micro-batch until the copy landed."""
    import torch

    from tests.helpers import tiny_trainer

    trainer = tiny_trainer("train.global_batch_size=8", "train.micro_batch_size=2")
    reads = []
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _name=name, _original=original: reads.append(_name) or _original(self, *a))
    micro_batches, _ = trainer.next_micro_batches()
    monkeypatch.undo()
    trainer.loader.close()
    assert len(micro_batches) == 4 and reads == []
