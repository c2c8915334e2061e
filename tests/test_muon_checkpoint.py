"""Muon's momentum in the checkpoint format (key `momentum` beside `master`): an exact resume at one process,
a load at another layout (DDP's checkpoint into ZeRO-3, next steps within 1e-5), and a switch from AdamW to Muon on resume with one notice and fresh Muon state."""
import json
import logging

import pytest
import torch

from engine.checkpoint.manifest import MANIFEST
from tests.helpers import tiny_trainer

MUON = ("optim.name=muon", "optim.muon_lr=0.02", "model.num_layers=2", "model.seq_length=16", "train.steps=4")


def run(run_dir, *overrides):
    return tiny_trainer(f"run.dir={run_dir}", *MUON, *overrides)


def losses(trainer, steps):
    return [trainer.train_step()["loss"] for _ in range(steps)]


def test_resume_with_muon_repeats_the_straight_run_exactly_and_loads_at_zero3(tmp_path):
    straight = run(tmp_path / "a")
    losses(straight, 2)
    path = straight.save_checkpoint()
    straight.checkpointer.wait()
    after = losses(straight, 2)
    manifest = json.loads((path / MANIFEST).read_text())["tensors"]
    assert manifest["model.layers.0.self_attn.q_proj.weight"]["keys"] == ["master", "momentum"]
    assert manifest["model.embed_tokens.weight"]["keys"] == ["master", "exp_avg", "exp_avg_sq"]
    resumed = run(tmp_path / "b", f"checkpoint.load={path}")
    assert losses(resumed, 2) == after
    for (name, a), (_, b) in zip(straight.named_params, resumed.named_params):
        assert torch.equal(a, b), name
    # the momentum read back as global tensors at another layout (ZeRO-3's shard of one rank: every vector)
    resharded = run(tmp_path / "c", f"checkpoint.load={path}", "parallel.zero_stage=3")
    assert losses(resharded, 2) == pytest.approx(after, abs=1e-5)


def test_switching_adamw_to_muon_on_resume_notices_and_starts_muon_fresh(tmp_path, caplog):
    adamw = tiny_trainer(f"run.dir={tmp_path / 'a'}", *MUON[2:])
    losses(adamw, 2)
    path = adamw.save_checkpoint()
    adamw.checkpointer.wait()
    with caplog.at_level(logging.INFO, logger="trilith"):
        muon = run(tmp_path / "b", f"checkpoint.load={path}")
    notices = [r.message for r in caplog.records if "optim.name=adamw" in r.message]
    assert len(notices) == 1 and "continuing with optim.name=muon" in notices[0]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(adamw.named_params, muon.named_params))
    assert all(not buf.any() for buf in muon.optimizer.muon.momentum)
    losses(muon, 1)
    assert all(buf.any() for buf in muon.optimizer.muon.momentum)
