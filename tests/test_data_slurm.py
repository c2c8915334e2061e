"""launch/run_data_job.sh on a real local SLURM cluster (tests/slurm_cluster.py): curation and preprocessing
as 4-task array jobs with dependent merges give one process's outputs byte for byte, and after a failed task
a resubmission reruns only that task.

Skips, with the reason printed, only when Debian's SLURM packages cannot be installed here.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.slurm_cluster import SlurmCluster, SlurmUnavailable
from tests.test_data_array_jobs import planted_corpus, read, same_provenance, tokenizer  # noqa: F401 (a fixture)
from tools import curate_data, preprocess_data

BIN = Path(sys.executable).parent
ENV = {"TRILITH_PYTHON": sys.executable, "PATH": f"{BIN}:/usr/bin:/bin:/usr/sbin", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=1).__enter__()
    except SlurmUnavailable as exc:
        print(f"SKIP SLURM tests: {exc}")
        pytest.skip(f"SLURM cannot be installed here: {exc}")
    yield c
    c.close()


def submit(cluster, tmp_path, tokenizer, paths):
    """Both steps through the driver, preprocessing after curation's merge; returns the two merge job ids."""
    sbatch = f"--sbatch=--output={tmp_path}/%x-%A_%a.out -c 1 --overcommit"
    clean, prefix = tmp_path / "clean.jsonl", tmp_path / "tokens"

    def driver(*cmd):
        done = subprocess.run(["bash", "launch/run_data_job.sh", "--tasks", "4", sbatch, *cmd], cwd=ROOT,
                              env={**cluster.env, **ENV}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    curate = driver("curate", "--input", *paths, "--output", str(clean), "--quiet")
    tokens = driver("--after", curate, "preprocess", "--input", str(clean), "--output-prefix", str(prefix),
                    "--tokenizer-model", tokenizer, "--append-eod", "--quiet")
    return curate, tokens


def task_logs(tmp_path, name):
    return {p.name: p.read_text() for p in sorted(tmp_path.glob(f"{name}-*_*.out"))}


def test_array_jobs_equal_one_process_and_rerun_only_the_failed_task(cluster, tmp_path, tokenizer):  # noqa: F811
    raw = tmp_path / "raw"
    raw.mkdir()
    paths = planted_corpus(str(raw))
    reference = tmp_path / "ref"
    reference.mkdir()
    curate_data.main(["--input", *paths, "--output", str(reference / "clean.jsonl"), "--quiet"])
    preprocess_data.main(["--input", str(reference / "clean.jsonl"), "--output-prefix", str(reference / "tokens"),
                          "--tokenizer-model", tokenizer, "--append-eod", "--quiet"])

    # Task 2 fails: a file stands where its directory goes. The merges never start.
    blocker = tmp_path / "clean.jsonl.shards" / "shard-00002-of-00004"
    blocker.parent.mkdir()
    blocker.write_text("")
    curate, tokens = submit(cluster, tmp_path, tokenizer, paths)
    assert cluster.wait(tokens, timeout=60)[0] == "CANCELLED"
    assert cluster.state(curate)[0] == "CANCELLED"
    first = task_logs(tmp_path, "trilith-curate_data")
    assert len(first) == 4 and "FileExistsError" in "".join(v for k, v in first.items() if k.endswith("_2.out"))
    assert sum("done in" in text for text in first.values()) == 3

    blocker.unlink()
    for log in first:
        (tmp_path / log).unlink()
    curate, tokens = submit(cluster, tmp_path, tokenizer, paths)
    state = cluster.wait(tokens, timeout=90)
    logs = task_logs(tmp_path, "trilith-curate_data")
    assert state == ("COMPLETED", "0:0"), logs
    assert sorted(k.rsplit("_", 1)[1] for k, v in logs.items() if "done in" in v) == ["2.out"]
    assert sum("already done" in v for v in logs.values()) == 3
    assert read(tmp_path / "clean.jsonl") == read(reference / "clean.jsonl")
    assert read(tmp_path / "clean.rejects.jsonl") == read(reference / "clean.rejects.jsonl")
    for ext in (".bin", ".idx"):
        assert read(f"{tmp_path}/tokens_text_document{ext}") == read(f"{reference}/tokens_text_document{ext}")
    assert same_provenance(tmp_path / "tokens_text_document", reference / "tokens_text_document",
                           {str(tmp_path / "clean.jsonl"): str(reference / "clean.jsonl")})
    assert not os.path.exists(tmp_path / "clean.jsonl.shards")
