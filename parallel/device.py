"""Which device a rank trains on (train.device), with no silent CPU fallback where GPUs were asked for.

train.device=auto takes CUDA when torch can use it. When it cannot, the run falls back to the CPU only if
nothing asked for GPUs: on a cluster a CPU-only torch build or a node without a driver would otherwise train
a GPU job on the CPU, thousands of times slower, without a word. torch is imported inside the functions
that need it, so that launch/check.py can ask gpu_request() before any rank starts without paying for it.
"""
from __future__ import annotations

import os
import socket

# Set by SLURM for a job given GPUs (--gpus-per-node, --gres=gpu:N) and by users choosing devices.
GPU_REQUESTS = ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")


class DeviceUnavailable(RuntimeError):
    """GPUs were asked for but CUDA cannot be used; a configuration error (exit status 2), never retried."""


def gpu_request(environ=None) -> str:
    """NAME=VALUE of the first variable by which SLURM or the user asked for GPUs, or "" when none did. An
    empty list, SLURM's 0 or NoDevFiles, and a list starting with a negative id (CUDA hides every device
    from there on) ask for none."""
    env = os.environ if environ is None else environ
    for name in GPU_REQUESTS:
        value = env.get(name, "").strip()
        first = value.split(",")[0].strip()
        if name == "SLURM_GPUS_ON_NODE":
            asked = value.isdigit() and int(value) > 0
        else:
            asked = bool(first) and not first.startswith("-") and value != "NoDevFiles"
        if asked:
            return f"{name}={value}"
    return ""


def cuda_problem() -> str:
    """Why torch cannot use CUDA here, and what to do about it."""
    import torch
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch in this "
                f"environment (pip install torch, a CUDA wheel on Linux)")
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable GPU; check the driver "
            f"(nvidia-smi) and that the job was given GPUs (sbatch --gpus-per-node=8)")


def choose_device(requested: str, cuda_available: bool, environ=None) -> tuple[str, str]:
    """("cuda" or "cpu", a note for the run's first log line, "" if none) for train.device=requested.
    Raises DeviceUnavailable when train.device=cuda, or auto with GPUs asked for, and CUDA is unusable."""
    if requested == "cpu":
        return "cpu", ""
    if cuda_available:
        return "cuda", ""
    asked = "train.device=cuda" if requested == "cuda" else gpu_request(environ)
    if asked:
        raise DeviceUnavailable(f"{asked} asks for GPUs, but CUDA is not usable on {socket.gethostname()}: "
                                f"{cuda_problem()}; to train on the CPU on purpose set train.device=cpu")
    return "cpu", "train.device=auto found no usable GPU, and none was asked for"


def check_requested_device(requested: str) -> None:
    """Raise DeviceUnavailable now, before any rank starts, if the ranks would; torch is imported only when
    GPUs were asked for."""
    if requested == "cuda" or (requested == "auto" and gpu_request()):
        import torch
        choose_device(requested, torch.cuda.is_available())
