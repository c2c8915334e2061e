"""Checkpoint verification, fallback, retention, mirror, async snapshots, and the reshard matrix."""
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from engine.checkpoint.files import CheckpointError, read_latest, step_dirs
from engine.train import Trainer
from tests.distributed import WorkerPool
from tests.helpers import launch, tiny_trainer

torch.set_num_threads(1)


def trainer(run_dir, *overrides, rank: int = 0, world: int = 1) -> Trainer:
    return tiny_trainer(f"run.dir={run_dir}", *overrides, rank=rank, world=world)


def train(t: Trainer, steps: int) -> list[float]:
    return [t.train_step()["loss"] for _ in range(steps)]


def saved_run(run_dir, *overrides, steps=2) -> Trainer:
    t = trainer(run_dir, "checkpoint.interval=1", *overrides)
    for _ in range(steps):
        t.train_step()
        t.save_checkpoint()
    t.checkpointer.wait()
    t.checkpointer.finish_uploads()  # the copies to checkpoint.mirrors are made in the background
    return t


def flip_byte(path, offset=-5):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_file_is_named_and_fallback_loads_previous(tmp_path):
    saved_run(tmp_path)
    bad = tmp_path / "checkpoints" / "step_00000002" / "tp00-pp00-dp000.safetensors"
    flip_byte(bad)
    with pytest.raises(CheckpointError, match=r"tp00-pp00-dp000\.safetensors: SHA-256 differs.*fallback=true"):
        trainer(tmp_path)
    resumed = trainer(tmp_path, "checkpoint.fallback=true")
    assert resumed.step == 1 and resumed.consumed_samples == 8


def test_truncated_file_is_caught_even_without_checksums(tmp_path):
    saved_run(tmp_path)
    path = tmp_path / "checkpoints" / "step_00000002" / "metadata.json"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"metadata\.json: .* bytes, manifest says .*truncated"):
        trainer(tmp_path, "checkpoint.verify=false")


def test_retention_keeps_last_k_and_every_nth_and_mirror_is_verified_copy(tmp_path, caplog):
    mirror = tmp_path / "mirror"
    with caplog.at_level(logging.WARNING, logger="trilith"):
        saved_run(tmp_path / "run", "checkpoint.keep=2", "checkpoint.keep_every=2", f"checkpoint.mirror_dir={mirror}",
                  steps=5)
    # the older key still works, with one line saying how to write it now
    assert [r.getMessage() for r in caplog.records if "mirror_dir" in r.getMessage()] == [
        f"checkpoint: checkpoint.mirror_dir is read as the first entry of checkpoint.mirrors; write "
        f"checkpoint.mirrors=[{mirror}] instead"]
    names = ["step_00000005", "step_00000004", "step_00000002"]
    for root in (tmp_path / "run" / "checkpoints", mirror):
        assert [d.name for d in step_dirs(root)] == names
        assert read_latest(root).name == "step_00000005"
    for name in names:
        primary = tmp_path / "run" / "checkpoints" / name
        assert (primary / "manifest.json").read_bytes() == (mirror / name / "manifest.json").read_bytes()
    flip_byte(tmp_path / "run" / "checkpoints" / "step_00000005" / "metadata.json", offset=3)
    resumed = trainer(tmp_path / "run", f"checkpoint.mirror_dir={mirror}", "checkpoint.fallback=true")
    assert resumed.step == 5  # the mirror's intact copy of the same step, not an older one
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # primary storage lost: the mirror alone resumes the run
    assert trainer(tmp_path / "run", f"checkpoint.mirror_dir={mirror}").step == 5


def test_async_save_writes_the_snapshot_not_later_state(tmp_path):
    t = trainer(tmp_path, "checkpoint.async_save=true")
    train(t, 2)
    expected = {n: s["master"].clone() for n, s in t.optimizer.owned_state().items()}
    path = t.save_checkpoint()
    train(t, 1)  # runs while the background thread writes
    t.checkpointer.wait()
    with safe_open(str(path / "tp00-pp00-dp000.safetensors"), "pt") as f:
        for name, value in expected.items():
            assert torch.equal(f.get_tensor(f"master/{name}"), value), name
    assert json.loads((path / "metadata.json").read_text())["adam_step"] == 2


def test_model_shape_mismatch_is_a_clear_error(tmp_path):
    saved_run(tmp_path, steps=1)
    with pytest.raises(CheckpointError, match=r"mlp\.up_proj\.weight: checkpoint \[128, 64\] vs model \[96, 64\]"):
        trainer(tmp_path, "model.ffn_hidden_size=96")


# Reshard matrix: saved at SAVE_AT on 4 ranks, loaded at each LOAD_AT; the next step's loss must agree.
SAVE_AT = ["parallel.tensor=2"]
LOAD_AT = {"tp4-kv-replicated": ["parallel.tensor=4"], "dp4": [], "tp2-dp2": ["parallel.tensor=2"]}
LAUNCH_LOAD_AT = {"tp2-dp1": (2, ["parallel.tensor=2"])}  # other world sizes: new processes via the launcher
STEPS_BEFORE_SAVE = 3


def _save_and_continue(rank, world, run_dir):
    torch.set_num_threads(1)
    t = trainer(run_dir, *SAVE_AT, rank=rank, world=world)
    train(t, STEPS_BEFORE_SAVE)
    t.save_checkpoint()
    return train(t, 1)[0]


def _load_and_step(rank, world, run_dir, source, overrides):
    torch.set_num_threads(1)
    t = trainer(run_dir, f"checkpoint.load={source}", *overrides, rank=rank, world=world)
    assert t.step == STEPS_BEFORE_SAVE
    return train(t, 1)[0]


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(4)
    yield workers
    workers.close()


def test_reshard_matrix_gives_the_same_next_step_loss(pool, tmp_path):
    reference = pool.run(_save_and_continue, str(tmp_path / "src"))[0]
    source = tmp_path / "src" / "checkpoints"
    losses = {name: pool.run(_load_and_step, str(tmp_path / name), str(source), overrides)[0]
              for name, overrides in LOAD_AT.items()}
    single = trainer(tmp_path / "single", f"checkpoint.load={source}")
    assert single.step == STEPS_BEFORE_SAVE and single.consumed_samples == STEPS_BEFORE_SAVE * 8
    losses["single"] = train(single, 1)[0]
    for name, (nproc, overrides) in LAUNCH_LOAD_AT.items():
        records = launch(tmp_path / name, f"checkpoint.load={source}", f"checkpoint.exit_after={STEPS_BEFORE_SAVE + 1}",
                         *overrides, nproc=nproc)
        assert [r["step"] for r in records] == [STEPS_BEFORE_SAVE + 1]
        losses[name] = records[0]["loss"]
    for name, loss in losses.items():
        assert abs(loss - reference) <= 1e-5, (name, loss, reference)


# Saved at TP×PP×DP = 2×2×2 with ZeRO-3 (8 ranks), loaded at other layouts and stages.
THREE_D = ["parallel.tensor=2", "parallel.pipeline=2", "parallel.zero_stage=3"]
THREE_D_LOAD_AT = {"4x1x2": ["parallel.tensor=4"], "1x4x2-zero1": ["parallel.pipeline=4", "parallel.zero_stage=1"]}


@pytest.fixture(scope="module")
def pool8():
    workers = WorkerPool(8)
    yield workers
    workers.close()


def _save_3d_and_continue(rank, world, run_dir):
    torch.set_num_threads(1)
    t = trainer(run_dir, *THREE_D, rank=rank, world=world)
    train(t, 3)
    t.save_checkpoint()
    t.checkpointer.wait()
    return train(t, 1)[0]


def test_reshard_from_3d_zero3(pool8, tmp_path):
    reference = pool8.run(_save_3d_and_continue, str(tmp_path / "src"))[0]
    source = tmp_path / "src" / "checkpoints" / "step_00000003"
    losses = {name: pool8.run(_load_and_step, str(tmp_path / name), str(source), overrides)[0]
              for name, overrides in THREE_D_LOAD_AT.items()}
    single = trainer(tmp_path / "1x1x1", f"checkpoint.load={source}")
    assert single.step == STEPS_BEFORE_SAVE
    losses["1x1x1"] = train(single, 1)[0]
    for name, loss in losses.items():
        assert abs(loss - reference) <= 1e-5, (name, loss, reference)


HSDP = ["parallel.zero_stage=3", "parallel.hsdp_group_size=2"]


def _hsdp_save_and_continue(rank, world, run_dir):
    torch.set_num_threads(1)
    t = trainer(run_dir, *HSDP, rank=rank, world=world)
    train(t, 2)
    t.save_checkpoint()
    t.checkpointer.wait()
    return train(t, 1)[0]


def _hsdp_resume(rank, world, run_dir, source):
    torch.set_num_threads(1)
    t = trainer(run_dir, *HSDP, f"checkpoint.load={source}", rank=rank, world=world)
    return t.step, train(t, 1)[0]


def test_hsdp_checkpoint_is_written_once_and_resumes(pool, tmp_path):
    """ZeRO-3 sharded within pairs, replicated across them: only the first replica group writes."""
    straight = pool.run(_hsdp_save_and_continue, str(tmp_path / "a"))[0]
    step2 = tmp_path / "a" / "checkpoints" / "step_00000002"
    for dp in range(4):  # every rank saves its RNG; optimizer state comes from the first replica group only
        with safe_open(str(step2 / f"tp00-pp00-dp{dp:03d}.safetensors"), "pt") as f:
            has_state = any(not key.startswith("rng/") for key in f.keys())
        assert has_state == (dp < 2), dp
    step, resumed = pool.run(_hsdp_resume, str(tmp_path / "b"), str(step2))[0]
    assert step == 2 and resumed == straight


# Saved at DP 4 with ZeRO-3 and copied to an object store (tests/s3_server.py) as checkpoint.mirrors copies it,
# loaded from the store at TP 2 × DP 2 with bucketed DDP: the same reshard as from disk.
S3_SAVE_AT, S3_LOAD_AT = ["parallel.zero_stage=3"], ["parallel.tensor=2", "parallel.zero_stage=0"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.s3_server import serve
    yield from serve(tmp_path_factory, ["ckpt"])


def _save_zero3_and_continue(rank, world, run_dir):
    torch.set_num_threads(1)
    t = trainer(run_dir, *S3_SAVE_AT, rank=rank, world=world)
    train(t, STEPS_BEFORE_SAVE)
    t.save_checkpoint()
    t.checkpointer.wait()
    return train(t, 1)[0]


def _load_from_store_and_step(rank, world, run_dir, env):
    torch.set_num_threads(1)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the store's variables for this call only: the pool's workers outlive the test
    try:
        t = trainer(run_dir, *S3_LOAD_AT, "checkpoint.load=s3://ckpt/zero3", rank=rank, world=world)
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert t.step == STEPS_BEFORE_SAVE and t.consumed_samples == STEPS_BEFORE_SAVE * 8
    return train(t, 1)[0]


def test_reshard_on_load_from_an_object_store(pool, server, tmp_path):
    from engine.checkpoint.locations import S3Location
    reference = pool.run(_save_zero3_and_continue, str(tmp_path / "src"))[0]
    step = tmp_path / "src" / "checkpoints" / "step_00000003"
    # the pool's ranks are daemonic processes, which may not start the uploader's copy process: this process
    # makes the copy, by the method the uploader calls
    manifest = json.loads((step / "manifest.json").read_text())
    S3Location("s3://ckpt/zero3", 3, 0, 1, 2).put(step, step.name, manifest["files"])
    losses = pool.run(_load_from_store_and_step, str(tmp_path / "tp2"), server.env())
    assert (tmp_path / "tp2" / "checkpoints" / step.name / "manifest.json").read_bytes() == \
        (step / "manifest.json").read_bytes()  # restored from the store into run.dir, verified
    for rank, loss in enumerate(losses):
        assert abs(loss - reference) <= 1e-5, (rank, loss, reference)


def test_checkpoints_by_wall_time(tmp_path, monkeypatch):
    """checkpoint.interval_minutes=1 with a clock that moves 25 s per step: saved at 75 s (step 3) only."""
    import time
    import types

    import engine.checkpoint.save_schedule
    from engine.observe.metrics import MetricsLog
    now = [0.0]
    monkeypatch.setattr(engine.checkpoint.save_schedule, "time", types.SimpleNamespace(monotonic=lambda: now[0],
                                                                     perf_counter=time.perf_counter))
    t = trainer(tmp_path, "checkpoint.interval_minutes=1", "train.steps=5")
    step = t.train_step

    def timed_step():
        now[0] += 25.0
        return step()
    t.train_step = timed_step
    t.train(MetricsLog(tmp_path, enabled=False))
    assert [d.name for d in step_dirs(tmp_path / "checkpoints")] == ["step_00000003"]
