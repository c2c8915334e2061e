"""Start torch.distributed from whatever launched us (torchrun-style variables, SLURM, MPI) or run alone."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"


def discover() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's variables; (0, 1, 0) when started by hand."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        return int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0))
    return 0, 1, 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(device: str = "auto", backend: str = "auto", timeout_minutes: float = 10.0) -> DistEnv:
    rank, world_size, local_rank = discover()
    dev = pick_device(device, local_rank)
    chosen = backend if backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
    if world_size > 1 and not dist.is_initialized():
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeError(f"{var} is not set: start multi-process runs with launch/run_pretrain.sh "
                                   "(or torchrun), which sets the rendezvous address")
        dist.init_process_group(chosen, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes),
                                device_id=dev if dev.type == "cuda" else None)
    return DistEnv(rank, world_size, local_rank, dev, chosen)
