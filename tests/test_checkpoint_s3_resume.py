"""A launched 2-rank run (launch/run_pretrain.sh, DP 2) that saves to run.dir and an S3 store (`rclone serve s3`,
tests/s3_server.py), loses run.dir and resumes from the store: exactly at its own layout, within the reshard
matrix's tolerance on one rank; and a store that is down at save (training goes on) or at resume (one line)."""
import hashlib
import json
import os
import shutil
import subprocess

import boto3
import pytest
import torch

from tests.helpers import LAUNCH_ENV, ROOT, launch_command, launch_process, read_metrics, tiny_trainer
from tests.s3_server import KEY, SECRET, S3Server, serve

torch.set_num_threads(1)
STEPS, SAVED = 14, 4  # after losing run.dir, the next 10 steps resumed from the store
FINAL = f"step_{STEPS:08d}"
# The commands of docs/checkpoints.md's procedure (1 MiB parts: the tiny checkpoint's files go up multipart)
RUN = [f"train.steps={STEPS}", f"checkpoint.interval={SAVED}", "checkpoint.upload_part_mb=1"]
MIRRORS = "checkpoint.mirrors=[s3://ckpt/run]"
RESHARD_TOLERANCE = 1e-5  # tests/test_checkpoint.py's reshard matrix
UNREACHABLE = "cannot reach the S3 endpoint {}; check that the store is up and that AWS_ENDPOINT_URL names it"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, ["ckpt"])


def steps(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run (DP 2, saving every SAVED steps and at STEPS) whose store dies once the ranks start:
    uploads never touch training, so its losses are the reference. (run dir, records, the launcher's output,
    the store's URL)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    store = S3Server(tmp_path_factory.mktemp("dead") / "store", buckets=["ckpt"])
    store.start()
    try:
        proc = subprocess.Popen(launch_command(run_dir, *RUN, "checkpoint.mirrors=[s3://ckpt/dead]",
                                                "checkpoint.upload_retries=1", "checkpoint.upload_backoff_s=0.05",
                                                nproc=2),
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**LAUNCH_ENV, **store.env()})
        lines = []
        for line in proc.stdout:  # the pre-start check wrote to the store; the ranks will find it gone
            lines.append(line.rstrip("\n"))
            if "Trilith: 2 ranks" in line:
                store.stop()
        assert proc.wait(timeout=600) == 0, "\n".join(lines[-40:])
    finally:
        store.stop()
    return run_dir, steps(run_dir), lines, store.url


def objects(server, prefix: str) -> dict[str, bytes]:
    """Every object below `prefix`, read back through boto3 as any S3 user reads it."""
    s3 = boto3.client("s3", endpoint_url=server.url, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                      region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="ckpt", Prefix=prefix + "/").get("Contents", [])]
    return {k[len(prefix) + 1:]: s3.get_object(Bucket="ckpt", Key=k)["Body"].read() for k in keys}


def assert_secret_nowhere(done: subprocess.CompletedProcess, run_dir) -> None:
    """Not in the launch's output, nor in any file of run.dir (config.yaml, logs, metrics, checkpoints)."""
    assert SECRET not in done.stdout + done.stderr
    assert not [p for p in run_dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


def test_store_down_at_save_warns_one_line_per_failure_and_training_goes_on(straight):
    run_dir, records, lines, dead_url = straight
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    failures = [line for line in lines if "copying step_" in line]
    # each copy is tried twice (checkpoint.upload_retries=1); a save's is skipped if the next superseded it first
    saves = [f"step_{step:08d}" for step in (*range(SAVED, STEPS, SAVED), STEPS)]
    tried = [name for name in saves if f"copying {name} " in "\n".join(failures)]
    assert tried[-1:] == [FINAL] and len(failures) == 2 * len(tried), "\n".join(failures)
    copies = [r["checkpoint_copies"]["s3://ckpt/dead"] for r in read_metrics(run_dir) if "checkpoint_copies" in r]
    assert copies[-1] == {"last_complete": None, "failures": len(failures), "pending": [],
                          "last_error": "reading s3://ckpt/dead/latest: " + UNREACHABLE.format(dead_url)}
    assert failures[-2].endswith(f"checkpoint: WARNING copying {FINAL} to s3://ckpt/dead/{FINAL} failed "
                                 "(attempt 1 of 2: reading s3://ckpt/dead/latest: " + UNREACHABLE.format(dead_url) +
                                 "); retrying in 0.05 s"), failures[-2]
    assert lines[-1].endswith(f"checkpoint: the final checkpoint {FINAL} is complete in {run_dir / 'checkpoints'}"
                              f"; missing from s3://ckpt/dead (reading s3://ckpt/dead/latest: "
                              f"{UNREACHABLE.format(dead_url)})"), lines[-1]


def test_launched_run_resumes_from_the_store_after_losing_run_dir(tmp_path, server, straight):
    expected = straight[1]
    run_dir = tmp_path / "run"
    done = launch_process(run_dir, *RUN, MIRRORS, f"checkpoint.exit_after={SAVED}", nproc=2, env=server.env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.endswith(f"checkpoint: the final checkpoint step_00000004 is complete in {run_dir / 'checkpoints'}, "
                         f"s3://ckpt/run"), last

    # every object the store holds is the manifest's, read back through boto3
    stored = objects(server, "run")
    manifest = json.loads(stored["step_00000004/manifest.json"])
    assert stored["step_00000004/manifest.json"] == (run_dir / "checkpoints" / "step_00000004" / "manifest.json"
                                                     ).read_bytes()
    assert sorted(stored) == sorted(["latest", "step_00000004/manifest.json",
                                     *(f"step_00000004/{name}" for name in manifest["files"])])
    assert len(manifest["files"]) == 3  # metadata.json and one file per DP rank
    assert len(stored["step_00000004/tp00-pp00-dp000.safetensors"]) > 2 << 20  # > 2 parts of 1 MiB: multipart
    for name, info in manifest["files"].items():
        assert hashlib.sha256(stored[f"step_00000004/{name}"]).hexdigest() == info["sha256"], name
    assert stored["latest"] == b"step_00000004\n"
    assert_secret_nowhere(done, run_dir)
    assert not [k for k, data in stored.items() if SECRET.encode() in data]

    shutil.rmtree(run_dir)  # the node and its disk are gone
    server.stop()  # and so is the store: the launch stops before any rank starts (a checkpoint.load there: at
    # rank 0's first request)
    down = launch_process(run_dir, *RUN, MIRRORS, nproc=2, env=server.env())
    assert down.returncode == 2 and "Traceback" not in down.stdout + down.stderr, down.stdout + down.stderr
    assert down.stderr.strip().splitlines() == [
        "trilith: checkpoint location error: s3://ckpt/run (bucket ckpt): " + UNREACHABLE.format(server.url)]

    down = launch_process(tmp_path / "load", *RUN, "checkpoint.load=s3://ckpt/run", nproc=2, env=server.env())
    server.start()
    assert down.returncode == 1 and "Traceback" not in down.stdout + down.stderr, down.stdout + down.stderr
    reason = "trilith: checkpoint error: reading s3://ckpt/run/manifest.json: " + UNREACHABLE.format(server.url)
    assert down.stderr.strip().splitlines() == [reason, f"run_pretrain.sh: the run failed (exit 1): {reason} "
                                                        f"(torchrun's report: {tmp_path / 'load'}/logs/torchrun.log)"]

    # on another layout (one rank, in this process): restored from the store, within the reshard tolerance
    single = tiny_trainer(f"run.dir={tmp_path / 'single'}", *RUN, MIRRORS)
    assert single.step == SAVED
    resharded = [single.train_step()["loss"] for _ in range(STEPS - SAVED)]
    assert resharded == pytest.approx([r["loss"] for r in expected[SAVED:]], abs=RESHARD_TOLERANCE)

    # the same command again at its own layout, its credentials from a profile this time: restored from the
    # store, the losses the straight run's exactly
    credentials = tmp_path / "aws-credentials"
    credentials.write_text(f"[trilith]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n")
    profile = {"AWS_ENDPOINT_URL": server.url, "AWS_PROFILE": "trilith", "AWS_CONFIG_FILE": os.devnull,
               "AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_DEFAULT_REGION": "us-east-1"}
    done = launch_process(run_dir, *RUN, MIRRORS, nproc=2, env=profile)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"checkpoint: restored s3://ckpt/run/step_00000004 to {run_dir / 'checkpoints' / 'step_00000004'}" \
           in done.stdout
    resumed = steps(run_dir)
    assert [r["step"] for r in resumed] == list(range(SAVED + 1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in expected[SAVED:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in expected[SAVED:]]
    assert resumed[-1]["consumed_samples"] == expected[-1]["consumed_samples"]
    assert done.stdout.strip().splitlines()[-1].endswith(
        f"checkpoint: the final checkpoint {FINAL} is complete in {run_dir / 'checkpoints'}, s3://ckpt/run")
    assert objects(server, "run")["latest"] == f"{FINAL}\n".encode()
    assert_secret_nowhere(done, run_dir)
