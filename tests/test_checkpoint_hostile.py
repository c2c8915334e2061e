"""Damaged and hostile checkpoints: retention that keeps what resuming needs, conversion that verifies,
manifests that cannot point outside their checkpoint, a full disk, and readers that fail in one line."""
import errno
import json
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import engine.checkpoint.checkpointer
from engine.checkpoint.files import CheckpointError, copy_verified, read_latest, step_dirs
from engine.checkpoint.hf_config import KERNELS_CLASH
from engine.checkpoint.manifest import SafetensorsRanges
from engine.train import main as train_main
from tests.distributed import WorkerPool
from tests.helpers import ROOT, TINY
from tests.test_checkpoint import flip_byte, saved_run, train, trainer
from tools.ckpt_convert import main as convert

RANK_FILE = "tp00-pp00-dp000.safetensors"
torch.set_num_threads(1)


def one_line_error(fn, *names) -> str:
    """fn() raises a one-line CheckpointError naming each of `names`; returns the message."""
    with pytest.raises(CheckpointError) as caught:
        fn()
    message = str(caught.value)
    assert "\n" not in message and all(str(n) in message for n in names), message
    return message


def edit_manifest(directory, change) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


# ---- 1: retention keeps `latest`'s target and this run's saves; step directories without `latest` -------
def test_retention_by_save_order_keeps_what_latest_names(tmp_path):
    keep = ["checkpoint.keep=1", "checkpoint.keep_every=2"]
    saved_run(tmp_path, *keep, steps=4)  # leaves step 4 (newest) and step 2 (a multiple of 2)
    root = tmp_path / "checkpoints"
    flip_byte(root / "step_00000004" / RANK_FILE)
    resumed = trainer(tmp_path, "checkpoint.fallback=true", *keep)
    assert resumed.step == 2
    train(resumed, 1)
    resumed.save_checkpoint()  # step 3: this run's newest save, although step 4 has a larger number
    assert read_latest(root).name == "step_00000003"
    assert [d.name for d in step_dirs(root)] == ["step_00000004", "step_00000003", "step_00000002"]
    assert trainer(tmp_path, *keep).step == 3


def test_step_directories_without_latest_are_resumed_or_named(tmp_path):
    saved_run(tmp_path, steps=2)
    root = tmp_path / "checkpoints"
    (root / "latest").unlink()
    assert trainer(tmp_path).step == 2  # the newest intact one, never a silent start from step 0
    flip_byte(root / "step_00000002" / RANK_FILE)
    one_line_error(lambda: trainer(tmp_path), root / "step_00000002", "fallback=true")
    assert trainer(tmp_path, "checkpoint.fallback=true").step == 1


# ---- 2: conversion verifies as loading does -----------------------------------------------------------
def test_convert_refuses_a_corrupt_checkpoint(tmp_path, capsys):
    saved_run(tmp_path / "run", steps=1)
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    flip_byte(step / RANK_FILE, offset=-3)  # the exponent byte of the last (little-endian) fp32 value
    for extra in (["--tensor", "2"], ["--to", "hf", "--tokenizer", ""]):
        out = tmp_path / "out" / extra[1]
        assert convert(["--load-dir", str(tmp_path / "run" / "checkpoints"), "--save-dir", str(out), *extra]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{step / RANK_FILE}: SHA-256 differs" in err, err
        assert not out.exists() or not any(out.iterdir())


# ---- 3: a manifest names only verified files inside its checkpoint; `latest` stays inside its directory ---
def test_manifest_cannot_point_outside_its_verified_files(tmp_path):
    saved_run(tmp_path / "a", steps=1)
    step = tmp_path / "a" / "checkpoints" / "step_00000001"
    shutil.copy(step / RANK_FILE, step / "unlisted.safetensors")
    pristine = (step / "manifest.json").read_text()
    for target, listed in (("unlisted.safetensors", False), (f"../step_00000001/{RANK_FILE}", True),
                           (str(step / RANK_FILE), True)):
        def point(manifest, target=target, listed=listed):
            for entry in manifest["tensors"].values():
                for piece in entry["pieces"]:
                    piece["file"] = target
            if listed:  # checksummed, but still outside the checkpoint
                manifest["files"][target] = manifest["files"][RANK_FILE]
        edit_manifest(step, point)
        one_line_error(lambda: trainer(tmp_path / "a"), step / "manifest.json", target[:80])
        (step / "manifest.json").write_text(pristine)
    assert trainer(tmp_path / "a").step == 1


def test_reads_stay_inside_the_tensor(tmp_path):
    saved_run(tmp_path, steps=1)
    path = tmp_path / "checkpoints" / "step_00000001" / RANK_FILE
    reader = SafetensorsRanges(path)
    key = next(k for k in reader.header if k.startswith("exp_avg/"))
    assert reader.read(key, 0, 8).numel() == 8
    for start, end in ((-4, 4), (0, 10**6)):  # a neighbour's bytes, whatever the manifest asks
        one_line_error(lambda: reader.read(key, start, end), path)
    reader.close()


def test_latest_naming_another_run_is_refused(tmp_path):
    saved_run(tmp_path / "other", steps=2)
    saved_run(tmp_path / "mine", steps=1)
    latest = tmp_path / "mine" / "checkpoints" / "latest"
    latest.write_text(str(tmp_path / "other" / "checkpoints" / "step_00000002") + "\n")
    one_line_error(lambda: trainer(tmp_path / "mine"), latest)
    latest.write_text("../../other/checkpoints/step_00000002\n")
    one_line_error(lambda: trainer(tmp_path / "mine"), latest)


def test_hf_index_cannot_point_outside_its_directory(tmp_path, capsys):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "elsewhere" / "model.safetensors")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    from safetensors import safe_open
    with safe_open(str(tmp_path / "elsewhere" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    capsys.readouterr()  # save_pretrained's progress bar
    for target in ("../elsewhere/model.safetensors", str(tmp_path / "elsewhere" / "model.safetensors")):
        index.write_text(json.dumps({"weight_map": {n: target for n in names}}))
        assert convert(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "out"),
                        "--from", "hf"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(index) in err and "'..'" in err, err
    assert not (tmp_path / "out").exists()


# ---- 6: a full disk is one final line; temporary folders go; symlinked step directories survive retention --
WRITE = engine.checkpoint.checkpointer.write_safetensors


def full_disk_at(call: int):
    write, calls = WRITE, [0]

    def write_until_full(path, tensors, metadata):
        calls[0] += 1
        if calls[0] == call:
            path.write_bytes(b"\0" * 1000)  # part of the file made it to disk
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write(path, tensors, metadata)
    return write_until_full


@pytest.mark.parametrize("mode", ["false", "true"], ids=["sync", "async"])
def test_full_disk_during_a_save_is_one_final_line(tmp_path, monkeypatch, capsys, mode):
    monkeypatch.setattr(engine.checkpoint.checkpointer, "write_safetensors", full_disk_at(call=2))
    stop_file = tmp_path / "stop"
    monkeypatch.setenv("TRILITH_STOP_FILE", str(stop_file))
    status = train_main(["--config", TINY, f"run.dir={tmp_path / 'run'}", "checkpoint.interval=1", "train.steps=3",
                         f"checkpoint.async_save={mode}"])
    err = capsys.readouterr().err
    assert status == 1 and stop_file.read_text() == "1\n"  # a code in the stop file: --max-restarts stops here
    assert err.count("\n") == 1 and err.startswith("trilith: checkpoint error: saving step 2") and \
        "No space left on device" in err, err
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]


def test_write_failure_of_a_real_process_is_one_line_naming_the_file(tmp_path):
    """The OS refuses the write (a file-size limit stands in for a full disk): status 1, left in the stop file
    (final), one line on stderr naming the file, nothing left behind."""
    limit = 1 << 20  # the config and logs fit; a checkpoint's rank file (~2.4 MB) does not
    stop_file = tmp_path / "stop"
    done = subprocess.run([sys.executable, "-m", "engine.train", "--config", TINY, f"run.dir={tmp_path / 'run'}",
                           "checkpoint.interval=1", "train.steps=2"], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "TRILITH_STOP_FILE": str(stop_file)}, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    rank_file = tmp_path / "run" / "checkpoints" / ".tmp-step_00000001" / RANK_FILE
    assert done.returncode == 1 and stop_file.read_text() == "1\n"
    assert done.stderr.count("\n") == 1 and f"writing {rank_file} failed: File too large" in done.stderr, done.stderr
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []


def _full_disk_on_rank_1(rank, world, run_dir):
    t = trainer(run_dir, rank=rank, world=world)
    train(t, 1)
    if rank == 1:
        engine.checkpoint.checkpointer.write_safetensors = full_disk_at(call=1)
    try:
        t.save_checkpoint()
    except CheckpointError as exc:
        return str(exc)
    finally:
        engine.checkpoint.checkpointer.write_safetensors = WRITE


def test_full_disk_on_one_rank_stops_every_rank(tmp_path):
    pool = WorkerPool(2)
    try:
        messages = pool.run(_full_disk_on_rank_1, str(tmp_path), timeout=120)
    finally:
        pool.close()
    for message in messages:
        assert "rank 1:" in message and "No space left on device" in message and "\n" not in message, message
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == []


def test_temporary_folders_are_cleaned_everywhere(tmp_path):
    mirror = tmp_path / "mirror"
    saved_run(tmp_path / "run", f"checkpoint.mirror_dir={mirror}", steps=1)
    for root in (tmp_path / "run" / "checkpoints", mirror):
        (root / ".tmp-step_00000009").mkdir()
    trainer(tmp_path / "run", f"checkpoint.mirror_dir={mirror}")
    assert not (tmp_path / "run" / "checkpoints" / ".tmp-step_00000009").exists()
    assert not (mirror / ".tmp-step_00000009").exists()
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    files = json.loads((step / "manifest.json").read_text())["files"]
    (step / "metadata.json").unlink()  # the copy fails halfway: the mirror keeps no half copy
    with pytest.raises(OSError):
        copy_verified(step, tmp_path / "mirror2", files)
    assert list((tmp_path / "mirror2").iterdir()) == []


def test_symlinked_step_directory_does_not_fail_saves(tmp_path):
    saved_run(tmp_path / "elsewhere", steps=1)
    target = tmp_path / "elsewhere" / "checkpoints" / "step_00000001"
    saved_run(tmp_path / "run", steps=1)
    root = tmp_path / "run" / "checkpoints"
    (root / "step_00000000").symlink_to(target, target_is_directory=True)
    saved_run(tmp_path / "run", "checkpoint.keep=1", steps=2)  # resumes at step 1, saves steps 2 and 3
    assert (root / "step_00000000").is_symlink() and (target / "manifest.json").is_file()
    assert [d.name for d in step_dirs(root)] == ["step_00000003", "step_00000000"]
    assert read_latest(root).name == "step_00000003"


# ---- 15: with checkpoint.verify=false a damaged file is still one CheckpointError naming it ----------------
def test_damaged_files_without_checksums_are_named(tmp_path):
    saved_run(tmp_path, steps=1)
    step = tmp_path / "checkpoints" / "step_00000001"
    path, pristine = step / RANK_FILE, (step / RANK_FILE).read_bytes()
    for offset in (5, 8):  # a high byte of the header length; the header JSON's first character
        flip_byte(path, offset=offset)
        one_line_error(lambda: trainer(tmp_path, "checkpoint.verify=false"), path)
        path.write_bytes(pristine)
    meta = json.loads((step / "metadata.json").read_text())
    meta["scaler"]["scale"] = "inf"  # would fail only at the first step that scales a loss
    (step / "metadata.json").write_text(json.dumps(meta))
    edit_manifest(step, lambda manifest: manifest["files"]["metadata.json"].update(
        bytes=(step / "metadata.json").stat().st_size))
    one_line_error(lambda: trainer(tmp_path, "checkpoint.verify=false"), step / "metadata.json", "scaler")
    edit_manifest(step, lambda manifest: manifest.pop("tensors"))
    one_line_error(lambda: trainer(tmp_path, "checkpoint.verify=false"), step / "manifest.json", "'tensors'")


def test_hugging_face_kernels_package_beside_trilith_is_one_line(tmp_path):
    """transformers >= 5.25 installs Hugging Face's `kernels` and imports it when its metadata says a supported
    version is there; Trilith's kernels/ has that import name. A distribution record at such a version (what
    `pip install kernels` leaves) makes transformers take Trilith's package: the export says so in one line."""
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    version = getattr(import_utils, "KERNELS_MIN_VERSION", None)
    if version is None:
        pytest.skip("this transformers does not import `kernels`")
    record = tmp_path / "site" / f"kernels-{version}.dist-info"
    record.mkdir(parents=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {version}\n")
    done = subprocess.run([sys.executable, "tools/ckpt_convert.py", "--to", "hf", "--load-dir", str(tmp_path / "c"),
                           "--save-dir", str(tmp_path / "hf")], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": f"{ROOT}:{tmp_path / 'site'}", "OMP_NUM_THREADS": "1",
                               "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [KERNELS_CLASH], done.stderr
    assert not (tmp_path / "hf").exists()
