"""Validation loss (train.eval_interval / eval_iters): the mean loss of fixed held-out batches, computed
without disturbing training. Layout independence (TP + SP + interleaved PP, PP × ZeRO-3, TP × ZeRO-1) is
in tests/test_pipeline.py; the real data path's validation split in tests/test_train.py."""
import numpy as np
import pytest
import torch

from data.indexed import IndexedDatasetBuilder
from engine.config.schema import ConfigError, load_config, validate
from engine.mock_data import MockBatchLoader
from engine.observe.metrics import MetricsLog
from engine.train import Trainer
from tests.helpers import TINY, tiny_trainer
COMMON = ["model.num_layers=2", "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.steps=4",
          "train.eval_iters=3"]


def make(*overrides) -> Trainer:
    return tiny_trainer(*COMMON, *overrides, validated=True)


def test_validation_loss_is_the_mean_over_fixed_held_out_batches():
    trainer = make()
    got = trainer.evaluate()
    cfg = trainer.cfg
    held_out = MockBatchLoader(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.micro_batch_size,
                               cfg.train.global_batch_size, 0, 1, seed=cfg.train.seed + 1)
    model = trainer.chunks[0]
    with torch.no_grad():
        want = torch.stack([model(mb[:, :-1], mb[:, 1:]) for _ in range(cfg.train.eval_iters)
                            for mb in held_out.next_global_batch()]).mean().item()
    assert abs(got - want) <= 1e-6
    assert trainer.evaluate() == got  # the same samples, dropout off: deterministic
    training = trainer.loader.next_global_batch()[0]
    assert not any(torch.equal(training, mb) for mb in
                   MockBatchLoader(cfg.model.vocab_size, cfg.model.seq_length, 2, 8, 0, 1,
                                   seed=cfg.train.seed + 1).next_global_batch())


def test_evaluating_changes_nothing_in_training_even_with_dropout(tmp_path):
    plain = make(f"run.dir={tmp_path / 'plain'}")
    plain_losses = [r["loss"] for r in plain.train(MetricsLog(tmp_path / "plain", enabled=False))]
    evaluated = make("train.eval_interval=2", f"run.dir={tmp_path / 'eval'}")
    (tmp_path / "eval").mkdir(exist_ok=True)
    records = evaluated.train(MetricsLog(tmp_path / "eval", enabled=True, console=lambda line: None))
    assert [r["loss"] for r in records] == plain_losses
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert records[3]["eval_loss"] < records[1]["eval_loss"]
    assert abs(records[3]["eval_ppl"] - torch.tensor(records[3]["eval_loss"]).exp().item()) <= 1e-3
    assert '"eval_loss"' in (tmp_path / "eval" / "metrics.jsonl").read_text()


@pytest.mark.parametrize("overrides, message", [
    (["train.eval_interval=-1"], "eval_interval=-1 must be ≥ 0"),
    (["train.eval_interval=5", "train.eval_iters=0"], "eval_iters=0 must be ≥ 1"),
])
def test_evaluation_config_is_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(TINY, overrides), 1)


def synthetic_dataset(prefix, seed, vocab=256, documents=60):
    """Documents of random tokens below `vocab` (each dataset with its own token distribution)."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix), np.uint16)
    for _ in range(documents):
        builder.add_document(rng.integers(seed * 50, seed * 50 + 60, rng.integers(20, 80)) % vocab)
    builder.finalize()
    return str(prefix)


def test_validation_loss_of_each_dataset_of_a_blend(tmp_path):
    """train.eval_per_dataset: each dataset's own validation loss, equal to evaluating that dataset alone."""
    web, code = synthetic_dataset(tmp_path / "web_text_document", 1), synthetic_dataset(tmp_path / "code_text_document", 2)
    data = ["data.mock=false", f"data.paths=[0.7, {web}, 0.3, {code}]", "data.split=80,20,0",
            f"data.cache_dir={tmp_path / 'cache'}", "train.eval_interval=2", "train.eval_per_dataset=true"]
    trainer = make(*data, f"run.dir={tmp_path / 'run'}")
    lines = []
    (tmp_path / "run").mkdir(exist_ok=True)
    records = trainer.train(MetricsLog(tmp_path / "run", enabled=True, console=lines.append))
    by_dataset = records[-1]["eval_loss_by_dataset"]
    assert list(by_dataset) == ["web_text_document", "code_text_document"]
    for name, prefix in (("web_text_document", web), ("code_text_document", code)):
        alone = make(*data[:-1], f"data.paths=[{prefix}]", f"run.dir={tmp_path / name}").datasets
        assert trainer.evaluate(alone) == by_dataset[name]
    assert by_dataset["web_text_document"] != by_dataset["code_text_document"]
    assert f"eval loss by dataset web_text_document {by_dataset['web_text_document']:.4f}" in lines[-1]
    with pytest.raises(ConfigError, match="eval_per_dataset=true needs train.eval_interval > 0"):
        make("train.eval_per_dataset=true")
    few = synthetic_dataset(tmp_path / "few_text_document", 3, documents=3)  # too few for a 10% valid share
    with pytest.raises(ConfigError, match=f"leaves no validation documents in {few}"):
        make(*data, f"data.paths=[{web}, {few}]", "data.split=90,10,0")
