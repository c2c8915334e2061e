"""checkpoint.mirrors against a real S3 server (`rclone serve s3`, tests/s3_server.py) and a directory:
verified copies, a store that dies mid-upload, corrupt objects, a lost run.dir, the pre-start check and
ckpt_convert straight from the store."""
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.checkpoint.files import CheckpointError, read_latest, set_latest, step_dirs
from engine.checkpoint.locations import DirLocation, S3Location
from engine.checkpoint.load_check import check_load
from engine.observe.metrics import MetricsLog
from tests.helpers import LAUNCH_ENV, ROOT, tiny_trainer
from tests.s3_server import serve
from tools.ckpt_convert import main as convert

torch.set_num_threads(1)
FILE = "tp00-pp00-dp000.safetensors"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module, its credentials in the environment as an S3 user sets them."""
    yield from serve(tmp_path_factory, ["ckpt"])


def trainer(run_dir, *overrides):
    return tiny_trainer(f"run.dir={run_dir}", "checkpoint.upload_part_mb=1", "checkpoint.upload_backoff_s=0.05",
                        "checkpoint.upload_wait_s=600",  # a loaded machine: the copy process starts slowly
                        *overrides)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def saved(t, steps: int):
    """Train and save `steps` times, each copy complete before the next save (none is superseded)."""
    for _ in range(steps):
        t.train_step()
        t.save_checkpoint()
        for worker in t.checkpointer.uploader.workers:
            worker.wait(time.monotonic() + 120)
    return t.checkpointer.finish_uploads()


def test_every_copy_is_the_manifests_and_retention_is_per_location(tmp_path, server):
    prefix = server.root / "ckpt" / "verified"
    mirror = tmp_path / "mirror"
    t = trainer(tmp_path / "run", f"checkpoint.mirrors=[\"{mirror}?keep=1\", s3://ckpt/verified]", "checkpoint.keep=2")
    line = saved(t, 3)
    assert line == (f"checkpoint: the final checkpoint step_00000003 is complete in {tmp_path / 'run' / 'checkpoints'}, "
                    f"{mirror}, s3://ckpt/verified")
    assert sorted(p.name for p in prefix.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert sorted(p.name for p in mirror.iterdir()) == ["latest", "step_00000003"]  # its own keep=1
    for root in (prefix, mirror):
        assert (root / "latest").read_text().strip() == "step_00000003"
        manifest = json.loads((root / "step_00000003" / "manifest.json").read_text())
        assert sorted(p.name for p in (root / "step_00000003").iterdir()) == sorted([*manifest["files"],
                                                                                    "manifest.json"])
        for name, info in manifest["files"].items():  # the bytes the server stored, read from its directory
            assert sha256(root / "step_00000003" / name) == info["sha256"]
    assert (prefix / "step_00000003" / FILE).stat().st_size > 2 << 20  # > 2 parts of 1 MB: a multipart upload
    status = t.checkpointer.uploader.status()["s3://ckpt/verified"]
    assert status["last_complete"] == "step_00000003" and status["failures"] == 0

    # the pre-flight's line for a checkpoint.load here or there (engine/checkpoint/load_check.py)
    assert check_load("s3://ckpt/verified").startswith("checkpoint.load: s3://ckpt/verified/step_00000003 complete "
                                                       "(step 3, 3 objects")
    assert check_load(str(tmp_path / "run" / "checkpoints")).endswith("step_00000003 verified (step 3, every file's "
                                                                      "SHA-256)")

    # ckpt_convert straight from the store gives the Hugging Face files it gives from disk
    assert convert(["--load-dir", "s3://ckpt/verified", "--save-dir", str(tmp_path / "hf_s3"), "--to", "hf"]) == 0
    assert convert(["--load-dir", str(tmp_path / "run" / "checkpoints"), "--save-dir", str(tmp_path / "hf_disk"),
                    "--to", "hf"]) == 0
    files = sorted(p.name for p in (tmp_path / "hf_disk").iterdir())
    assert "model.safetensors" in files and sorted(p.name for p in (tmp_path / "hf_s3").iterdir()) == files
    for name in files:
        assert (tmp_path / "hf_s3" / name).read_bytes() == (tmp_path / "hf_disk" / name).read_bytes(), name


def test_retention_never_deletes_what_a_locations_latest_names(tmp_path, server):
    mirror = tmp_path / "mirror"
    t = trainer(tmp_path / "run", f"checkpoint.mirrors=[{mirror}, s3://ckpt/retained]")  # keep=3: all three stay
    saved(t, 3)
    names = ["step_00000001", "step_00000002", "step_00000003"]
    # each location's `latest` names an older step (what another writer, or an abandoned run, left there): its
    # retention (keep=1) deletes the step between, never that one nor the last save
    directory, store = DirLocation(str(mirror), 1, 0), S3Location("s3://ckpt/retained", 1, 0, 1, 2)
    set_latest(mirror, names[0])
    store.store.put_bytes(f"{names[0]}\n".encode(), "latest")
    for location in (directory, store):
        assert location.latest() == names[0] and location.steps()[::-1] == names
        location.prune(names)
    assert [d.name for d in step_dirs(mirror)] == [names[2], names[0]]
    assert sorted(p.name for p in (server.root / "ckpt" / "retained").iterdir()) == ["latest", names[0], names[2]]
    DirLocation(str(mirror), 1, 2).prune(names)  # keep_every=2 keeps step 2 forever; `latest` still step 1
    assert [d.name for d in step_dirs(mirror)] == [names[2], names[0]]


def test_the_wait_for_pending_copies_is_bounded_and_names_what_did_not_finish(tmp_path, server, caplog):
    t = trainer(tmp_path / "run", "checkpoint.mirrors=[s3://ckpt/late]", "checkpoint.upload_retries=3",
                "checkpoint.upload_backoff_s=300", "checkpoint.upload_wait_s=1")
    worker = t.checkpointer.uploader.workers[0]
    server.stop()  # a dead store: the copy fails and waits 300 s for its retry
    try:
        t.train_step()
        t.save_checkpoint()
        deadline = time.monotonic() + 120
        while worker.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.failures == 1 and worker.pending() == ["step_00000001"]
        with caplog.at_level(logging.WARNING, logger="trilith"):
            start = time.monotonic()
            line = t.checkpointer.finish_uploads()
            waited = time.monotonic() - start
        worker.thread.join(timeout=60)
        assert not worker.thread.is_alive() and worker.child.process is None  # no retry after the wait gave up
    finally:
        server.start()
    assert waited < 60  # checkpoint.upload_wait_s=1, not the 300 s back-off
    assert line == (f"checkpoint: the final checkpoint step_00000001 is complete in {tmp_path / 'run' / 'checkpoints'}"
                    f"; missing from s3://ckpt/late (not finished)")
    assert "checkpoint: WARNING copies to s3://ckpt/late not finished after checkpoint.upload_wait_s=1 s: " \
           "step_00000001" in [r.getMessage() for r in caplog.records]
    assert not (server.root / "ckpt" / "late" / "latest").exists()


def test_a_store_killed_mid_upload_never_names_the_partial_copy_and_training_goes_on(tmp_path, server, caplog):
    mirror = tmp_path / "mirror"
    # a vocabulary of 8,192 makes the checkpoint 14 MiB, 14 parts of 1 MiB: the upload lasts long enough for the
    # watcher to see its first part on a quiet machine (at 2 MiB it could finish between two looks)
    t = trainer(tmp_path / "run", f"checkpoint.mirrors=[s3://ckpt/killed, {mirror}]", "checkpoint.upload_retries=1",
                "model.vocab_size=8192")
    killed = []

    def kill():  # the first part of the multipart upload has arrived (rclone's temporary file): the store dies
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            parts = list((server.root / "ckpt" / "killed").rglob(".rclone_temp_multipart_*"))
            if any(p.stat().st_size >= 1 << 20 for p in parts if p.exists()):
                server.stop()
                killed.append(True)
            time.sleep(0.005)
    watcher = threading.Thread(target=kill, daemon=True)
    watcher.start()
    losses = []
    with caplog.at_level(logging.WARNING, logger="trilith"):
        t.train_step()
        t.save_checkpoint()
        for _ in range(3):  # training goes on while the copy fails and is retried
            losses.append(t.train_step()["loss"])
        watcher.join()
        t.checkpointer.uploader.workers[0].wait(time.monotonic() + 60)
    assert killed and t.step == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    warnings = [r.getMessage() for r in caplog.records if "copying step_00000001 to s3://ckpt/killed" in r.getMessage()]
    assert len(warnings) == 2 and "attempt 1 of 2" in warnings[0] and "after 2 attempts" in warnings[1]
    backing = server.root / "ckpt" / "killed"
    assert not (backing / "latest").exists() and not (backing / "step_00000001" / "manifest.json").exists()
    assert read_latest(mirror).name == "step_00000001"  # the directory mirror is not held back by the store
    status = t.checkpointer.uploader.status()
    assert status["s3://ckpt/killed"]["failures"] == 2 and status["s3://ckpt/killed"]["last_complete"] is None
    server.start()  # the store is back: the next save's copy completes
    t.save_checkpoint()
    line = t.checkpointer.finish_uploads()
    assert line == (f"checkpoint: the final checkpoint step_00000004 is complete in {tmp_path / 'run' / 'checkpoints'}, "
                    f"s3://ckpt/killed, {mirror}")
    assert (backing / "latest").read_text().strip() == "step_00000004"
    manifest = json.loads((backing / "step_00000004" / "manifest.json").read_text())
    assert sha256(backing / "step_00000004" / FILE) == manifest["files"][FILE]["sha256"]
    # nothing of the partial upload is listed (rclone keeps an aborted multipart's parts in a hidden file)
    assert t.checkpointer.locations[0].store.sizes("step_00000001") == {}


def test_lost_run_dir_resumes_from_the_store_and_a_corrupt_object_falls_back_to_the_next_copy(tmp_path, server,
                                                                                               caplog):
    straight = trainer(tmp_path / "straight")
    expected = [straight.train_step()["loss"] for _ in range(13)]
    mirror = tmp_path / "mirror"
    mirrors = f"checkpoint.mirrors=[s3://ckpt/lost, {mirror}]"
    t = trainer(tmp_path / "run", mirrors)
    saved(t, 3)
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # the node and its disk are gone
    resumed = trainer(tmp_path / "run", mirrors)
    assert resumed.step == 3 and read_latest(tmp_path / "run" / "checkpoints").name == "step_00000003"
    assert [resumed.train_step()["loss"] for _ in range(10)] == expected[3:]  # the next 10 steps

    # a corrupt local file: named; with fallback, replaced by the store's copy (the first location), verified
    local = tmp_path / "run" / "checkpoints" / "step_00000003" / FILE
    good = sha256(local)
    flip = bytearray(local.read_bytes())
    flip[-5] ^= 0xFF
    local.write_bytes(bytes(flip))
    with pytest.raises(CheckpointError, match=rf"{local}: SHA-256 differs.*fallback=true"):
        trainer(tmp_path / "run", mirrors)
    with caplog.at_level(logging.INFO, logger="trilith"):
        replaced = trainer(tmp_path / "run", mirrors, "checkpoint.fallback=true")
    assert replaced.step == 3 and sha256(local) == good and replaced.train_step()["loss"] == expected[3]
    assert f"checkpoint: restored s3://ckpt/lost/step_00000003 to {local.parent} (SHA-256 verified)" in caplog.messages

    shutil.rmtree(tmp_path / "run" / "checkpoints")
    obj = server.root / "ckpt" / "lost" / "step_00000003" / FILE
    data = bytearray(obj.read_bytes())
    data[-5] ^= 0xFF
    obj.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"s3://ckpt/lost/step_00000003/{FILE}: SHA-256 differs.*fallback=true"):
        trainer(tmp_path / "run", mirrors)
    fallback = trainer(tmp_path / "run", mirrors, "checkpoint.fallback=true")  # the directory's copy of step 3
    assert fallback.step == 3 and fallback.train_step()["loss"] == expected[3]
    load = trainer(tmp_path / "other", "checkpoint.load=s3://ckpt/lost/step_00000002")  # one checkpoint by URL
    assert load.step == 2 and load.train_step()["loss"] == expected[2]


def test_metrics_record_each_locations_copies(tmp_path, server):
    t = trainer(tmp_path, "checkpoint.mirrors=[s3://ckpt/metrics]", "checkpoint.interval=2", "train.steps=4",
                "train.log_interval=100")
    metrics = MetricsLog(tmp_path, enabled=True, console=lambda line: None)
    t.train(metrics)
    assert t.checkpointer.finish_uploads().endswith("s3://ckpt/metrics")
    metrics.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    copies = [r["checkpoint_copies"]["s3://ckpt/metrics"] for r in records if "checkpoint_copies" in r]
    assert "step_00000002" in copies[0]["pending"] + [copies[0]["last_complete"]]  # recorded from the first change
    assert t.checkpointer.uploader.status()["s3://ckpt/metrics"]["last_complete"] == "step_00000004"
    assert all("failures" in c for c in copies)  # counted (the killed store's test counts them)


def check(run_dir, env, *overrides) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch/check.py", "--world-size", "1", "--config", "launch/configs/tiny.yaml",
                           f"run.dir={run_dir}", *overrides], cwd=ROOT, capture_output=True, text=True,
                          env={**LAUNCH_ENV, **env, "PYTHONPATH": str(ROOT)}, timeout=120)


def test_unwritable_locations_are_one_line_each_before_any_rank_starts(tmp_path, server):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    done = check(tmp_path, server.env(), f"checkpoint.mirrors=[{blocker}/ckpt, s3://nobucket/x]")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"trilith: checkpoint location error: {blocker}/ckpt: cannot create or write the directory (Not a "
        f"directory); fix its permissions or name another in checkpoint.mirrors",
        "trilith: checkpoint location error: s3://nobucket/x (bucket nobucket): the bucket does not exist; create "
        "it, or name another in checkpoint.mirrors"]
    done = check(tmp_path, server.env(secret="wrong"), "checkpoint.mirrors=[s3://ckpt/x]")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert "s3://ckpt/x (bucket ckpt): the store refused the credentials (403); set AWS_ACCESS_KEY_ID and " \
           "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)" in done.stderr and "wrong" not in done.stderr
    assert check(tmp_path, server.env(), "checkpoint.mirrors=[s3://ckpt/x]").returncode == 0
