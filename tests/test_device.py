"""train.device and the GPUs a job asked for (parallel/device.py): CUDA when usable; where SLURM or the user asked
for GPUs (or train.device=cuda) and CUDA is unusable, one line and status 2 instead of training on the CPU;
train.device=auto with nothing asked falls back to the CPU and the first log line says so."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel.device import DeviceUnavailable, choose_device, gpu_request
from tests.helpers import ROOT, TINY

BIN = Path(sys.executable).parent
ENV = {"TRILITH_PYTHON": sys.executable, "PATH": f"{BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is unusable")


@pytest.mark.parametrize("name, value", [("SLURM_GPUS_ON_NODE", "8"), ("SLURM_JOB_GPUS", "0,1"),
                                         ("CUDA_VISIBLE_DEVICES", "0"), ("CUDA_VISIBLE_DEVICES", "GPU-5d1e")])
def test_gpus_asked_for_without_cuda_stop_naming_the_variable_and_the_fix(monkeypatch, name, value):
    for other in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    assert gpu_request() == f"{name}={value}"
    with pytest.raises(DeviceUnavailable, match=rf"^{name}={value} asks for GPUs, but CUDA is not usable on .*: "
                                                r".*; to train on the CPU on purpose set train.device=cpu$"):
        choose_device("auto", cuda_available=False)
    assert choose_device("cpu", cuda_available=False) == ("cpu", "")  # asked for by name: the CPU it is
    assert choose_device("auto", cuda_available=True) == ("cuda", "")


@pytest.mark.parametrize("environ", [{}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"},
                                     {"SLURM_GPUS_ON_NODE": "0"}, {"SLURM_JOB_GPUS": ""},
                                     {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}],
                         ids=["unset", "empty", "hidden", "slurm-none", "slurm-empty", "slurm-nodevfiles"])
def test_auto_without_cuda_or_a_request_falls_back_to_the_cpu_and_says_so(environ):
    assert gpu_request(environ) == ""
    assert choose_device("auto", False, environ) == ("cpu", "train.device=auto found no usable GPU, and none "
                                                            "was asked for")


def test_device_cuda_without_cuda_stops_even_with_nothing_asked():
    with pytest.raises(DeviceUnavailable, match=r"^train.device=cuda asks for GPUs, but CUDA is not usable"):
        choose_device("cuda", False, {})


def one_line_refusal(command: list, env: dict) -> str:
    """`command`'s only line on stderr, after it exited with status 2."""
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    return lines[0]


@NO_CUDA
def test_a_rank_given_gpus_it_cannot_use_exits_2_with_one_line(tmp_path):
    line = one_line_refusal([sys.executable, "-m", "engine.train", "--config", TINY, f"run.dir={tmp_path}",
                             "train.steps=1"], {**ENV, "SLURM_JOB_GPUS": "0,1"})
    assert line.startswith("trilith: configuration error: SLURM_JOB_GPUS=0,1 asks for GPUs, but CUDA is not usable "
                           "on "), line
    assert "CPU-only build" in line or "sees no usable GPU" in line


@NO_CUDA
def test_the_launcher_stops_a_gpu_recipe_before_any_rank_starts(tmp_path):
    line = one_line_refusal(["bash", "launch/run_pretrain.sh", "--nproc", "2", "--config", TINY, "train.device=cuda",
                             f"run.dir={tmp_path}"], ENV)
    assert line.startswith("trilith: configuration error: train.device=cuda asks for GPUs"), line
    assert not (tmp_path / "logs").exists()  # no rank started


@NO_CUDA
def test_auto_on_a_machine_that_asked_for_no_gpu_trains_on_the_cpu_and_says_so_first(tmp_path):
    done = subprocess.run([sys.executable, "-m", "engine.train", "--config", TINY, f"run.dir={tmp_path}",
                           "train.steps=1"], cwd=ROOT, env={**ENV, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first = (tmp_path / "logs" / "train.log").read_text().splitlines()[0]
    assert "on cpu (gloo; train.device=auto found no usable GPU, and none was asked for)" in first, first


@NO_CUDA
def test_evaluate_given_gpus_it_cannot_use_exits_2_with_one_line(tmp_path):
    line = one_line_refusal([sys.executable, "tools/evaluate.py", "--model", str(tmp_path), "--data", str(tmp_path)],
                            {**ENV, "SLURM_JOB_GPUS": "0"})
    assert line.startswith("evaluate: SLURM_JOB_GPUS=0 asks for GPUs, but CUDA is not usable"), line
