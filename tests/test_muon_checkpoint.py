"""Muon's momentum in the checkpoint format (key `momentum` beside `master`): an exact resume at one process,
a load at another layout (DDP's checkpoint into ZeRO-3, next steps within 1e-5), and a switch from AdamW to Muon on resume with one notice and fresh Muon state."""
import json
import logging

import pytest
import torch

from safetensors.torch import load_file

from engine.checkpoint.manifest import MANIFEST, CheckpointReader
from engine.config.schema import from_dict, validate
from engine.train import Trainer
from parallel.distributed import DistEnv
from tests.distributed import worker_pools
from tests.helpers import tiny_trainer
from tools.ckpt_convert import main as convert

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


# ---- at 8 ranks (TP 2 × PP 2 × ZeRO-3 DP 2) and through tools/ckpt_convert.py ---------------------------------
EIGHT = {"model": dict(hidden_size=32, num_layers=4, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                       vocab_size=61, seq_length=16),
         "train": dict(micro_batch_size=1, global_batch_size=8, steps=4, seed=7),
         "optim": dict(lr=3e-3, warmup_steps=2, name="muon", muon_lr=0.02, muon_ns_dtype="fp32"),
         "data": dict(mock=True)}


def eight_rank_trainer(rank, world, run_dir, load="", **parallel):
    raw = {k: dict(v) for k, v in EIGHT.items()}
    raw.update(parallel=parallel, run={"dir": str(run_dir)}, checkpoint={"load": str(load)})
    cfg = from_dict(raw)
    validate(cfg, world)
    return Trainer(cfg, DistEnv(rank, world, 0, torch.device("cpu"), "gloo"))


def resume_and_reshard(rank, world, root):
    """(the straight run's steps 3-4, the same resumed at its own layout, resumed at PP 4 × ZeRO-1 DP 2)."""
    straight = eight_rank_trainer(rank, world, root / "a", tensor=2, pipeline=2, zero_stage=3)
    losses(straight, 2)
    straight.save_checkpoint()
    straight.checkpointer.wait()
    after = losses(straight, 2)
    load = root / "a" / "checkpoints"
    resumed = eight_rank_trainer(rank, world, root / "b", load, tensor=2, pipeline=2, zero_stage=3)
    resharded = eight_rank_trainer(rank, world, root / "c", load, pipeline=4, zero_stage=1)
    return after, losses(resumed, 2), losses(resharded, 2)


def test_resume_at_tp2_pp2_zero3_dp2_is_exact_and_reshards_to_pp4_zero1(tmp_path):
    with worker_pools(8) as pools:
        results = pools[8].run(resume_and_reshard, tmp_path, timeout=1500)
    for after, resumed, resharded in results:
        assert resumed == after
        assert resharded == pytest.approx(after, abs=1e-5)


def test_ckpt_convert_keeps_muons_momentum_and_exports_the_weights_alone(tmp_path):
    straight = run(tmp_path / "a")
    losses(straight, 2)
    path = straight.save_checkpoint()
    straight.checkpointer.wait()
    after = losses(straight, 2)
    assert convert(["--load-dir", str(path), "--save-dir", str(tmp_path / "tp2"), "--tensor", "2"]) == 0
    a, b = CheckpointReader(path), CheckpointReader(tmp_path / "tp2" / path.name)
    for name, entry in a.tensors.items():
        assert b.tensors[name]["keys"] == entry["keys"], name
        for key in entry["keys"]:
            assert torch.equal(a.global_tensor(name, key), b.global_tensor(name, key)), (name, key)
    # read back at one process from the TP 2 files: the same next steps as the straight run
    resumed = run(tmp_path / "b", f"checkpoint.load={tmp_path / 'tp2'}")
    assert losses(resumed, 2) == pytest.approx(after, abs=1e-6)
    # the Hugging Face export holds the weights only, as under AdamW
    assert convert(["--load-dir", str(path), "--save-dir", str(tmp_path / "hf"), "--to", "hf"]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(a.tensors)
    for name, tensor in exported.items():
        assert torch.equal(tensor, a.global_tensor(name, "master")), name
