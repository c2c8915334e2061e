"""Validation loss (train.eval_interval / eval_iters): the mean loss of fixed held-out batches, computed
without disturbing training. Layout independence (TP + SP + interleaved PP, PP × ZeRO-3, TP × ZeRO-1) is
in tests/test_pipeline.py; the real data path's validation split in tests/test_train.py."""
import pytest
import torch

from engine.config import ConfigError, load_config, validate
from engine.metrics import MetricsLog
from engine.mock_data import MockBatchLoader
from engine.train import Trainer
from parallel.distributed import DistEnv

TINY = "launch/configs/tiny.yaml"
COMMON = ["model.num_layers=2", "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.steps=4",
          "train.eval_iters=3"]


def make(*overrides) -> Trainer:
    cfg = load_config(TINY, [*COMMON, *overrides])
    validate(cfg, 1)
    return Trainer(cfg, DistEnv())


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
    (["train.eval_interval=5", "train.eval_iters=0"], "eval_iters=0 at least 1"),
])
def test_evaluation_config_is_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(TINY, overrides), 1)
