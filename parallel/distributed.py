"""Start torch.distributed from whatever launched us: torchrun, SLURM's srun, Open MPI, MPICH/Hydra, or nothing.

`discover()` reads the launcher's variables in a fixed priority order (first complete set wins):

    1. torchrun / launch/run_pretrain.sh --nproc   RANK, WORLD_SIZE, LOCAL_RANK
    2. Open MPI (mpirun)                           OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK
    3. MPICH / Hydra (mpiexec)                     PMI_RANK, PMI_SIZE, MPI_LOCALRANKID
    4. SLURM (srun)                                SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID

MPI comes before SLURM because `mpirun` inside an allocation inherits the batch step's SLURM_PROCID=0.
The rendezvous (MASTER_ADDR/MASTER_PORT) is taken from the environment when set (launch/run_pretrain.sh's
batch shell picks a free port on the first node); otherwise SLURM runs use the first host of
SLURM_JOB_NODELIST and the step's reserved port (srun --resv-ports) or one derived from the job id, MPI runs
let rank 0 pick its address and a free port and broadcast them with mpi4py, in a child process of each rank.

A launched rank dies with the process that started it (`die_with_launcher`): torchrun starts each rank in a
session of its own, so a kill -9 of the launch's process group would otherwise leave the ranks training.
"""
from __future__ import annotations

import ctypes
import datetime
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import comm, heartbeat, nccl_semantics
from parallel.device import DeviceUnavailable, choose_device

SCHEDULERS = (  # (name, rank, world size, local rank) in priority order
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


class LaunchError(RuntimeError):
    """The launcher's environment is incomplete or inconsistent; the message names the variables."""


@dataclass
class Launch:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"  # which launcher the numbers came from


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"
    source: str = "single"
    nodes: tuple = ()  # node_name() of every rank, gathered at start (parallel/placement.py)
    device_note: str = ""  # why this device, when the run's first log line should say (parallel/device.py)


def _int(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer") from None


def discover(environ=None) -> Launch:
    """Rank, world size and local rank from the first launcher whose variables are set; one process if none."""
    env = os.environ if environ is None else environ
    for name, rank_var, size_var, local_var in SCHEDULERS:
        if rank_var not in env and size_var not in env:
            continue
        missing = [v for v in (rank_var, size_var) if v not in env]
        if missing:
            raise LaunchError(f"{name} launch detected but {', '.join(missing)} is not set (found "
                              f"{rank_var if rank_var in env else size_var}); a {name} rank needs {rank_var} and "
                              f"{size_var}, optionally {local_var}")
        rank, world = _int(env, rank_var), _int(env, size_var)
        local = _int(env, local_var) if local_var in env else _local_rank_fallback(env, rank)
        if not 0 <= rank < world:
            raise LaunchError(f"{rank_var}={rank} is outside [0, {size_var}={world})")
        return Launch(rank, world, local, name)
    return Launch()


def _local_rank_fallback(env, rank: int) -> int:
    # Without a local-rank variable, assume ranks are packed per node (LOCAL_WORLD_SIZE, SLURM tasks per node).
    per_node = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    return rank % int(per_node) if per_node.isdigit() and int(per_node) > 0 else 0


def looked_for() -> str:
    return "; ".join(f"{n}: {r}/{s}/{lr}" for n, r, s, lr in SCHEDULERS)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list ("gpu[01-03,07],login1") as host names, in order."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(n).zfill(len(lo))}{suffix}")
    return hosts


# Run in a child process: see _mpi_rendezvous. Prints rank 0's host name and a free port on it.
_MPI_EXCHANGE = """
import socket, sys
try:
    from mpi4py import MPI
except ImportError:
    sys.exit(3)
except RuntimeError as exc:  # mpi4py found no MPI library of the launcher's kind
    sys.exit(str(exc).splitlines()[0])
def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
world = MPI.COMM_WORLD
info = world.bcast((socket.gethostname(), str(free_port())) if world.Get_rank() == 0 else None, root=0)
MPI.Finalize()
print(*info)
"""


def _mpi_rendezvous(source: str) -> tuple[str, str]:
    """Rank 0's host and a free port, shared by MPI. The exchange runs in a child process, so the rank itself
    never loads the MPI library: a rank ends with os._exit (exit_now), which skips the library's exit handlers,
    and MPICH's mpiexec then takes the first rank to end for a crash and SIGKILLs the others (seen as exit
    code 9 after a finished run). The child ends normally; the PMI socket MPICH passes as PMI_FD goes with it
    (Open MPI's PMIx finds its server from the environment)."""
    env = dict(os.environ)
    if source == "openmpi":
        # mpi4py's PyPI wheel carries both the MPICH and the Open MPI ABI and, with the mpich wheel also
        # installed (the .[mpi] extra), would load MPICH's library, which aborts under Open MPI's PMIx.
        env.setdefault("MPI4PY_MPIABI", "openmpi")
    pmi_fd = env.get("PMI_FD", "")
    done = subprocess.run([sys.executable, "-c", _MPI_EXCHANGE], env=env, capture_output=True, text=True,
                          pass_fds=(int(pmi_fd),) if pmi_fd.isdigit() else ())
    if done.returncode == 3:
        raise LaunchError("started by mpirun/mpiexec without MASTER_ADDR/MASTER_PORT, and mpi4py is not "
                          "installed to share them: pip install -e '.[mpi]' (or set both variables)")
    if done.returncode:
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise LaunchError(f"mpi4py could not share the rendezvous under {source} ({reason}); set MPI4PY_LIBMPI "
                          f"to the launcher's libmpi.so (or MASTER_ADDR and MASTER_PORT)")
    host, port = done.stdout.split()[-2:]
    return host, port


def rendezvous(launch: Launch, environ=None) -> tuple[str, str]:
    """MASTER_ADDR and MASTER_PORT for a multi-process run, from the environment or the scheduler."""
    env = os.environ if environ is None else environ
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port:
        return addr, port
    if launch.source == "slurm":
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise LaunchError("SLURM run without MASTER_ADDR and without SLURM_JOB_NODELIST to pick the first "
                              "host from; set MASTER_ADDR")
        return addr or expand_nodelist(nodelist)[0], port or slurm_port(env)
    if launch.source in ("openmpi", "mpich"):
        mpi_addr, mpi_port = _mpi_rendezvous(launch.source)
        return addr or mpi_addr, port or mpi_port
    raise LaunchError(f"MASTER_ADDR/MASTER_PORT not set for a {launch.source} run of {launch.world_size} ranks: "
                      "start multi-process runs with launch/run_pretrain.sh or torchrun, which set them")


def slurm_port(env) -> str:
    """The rendezvous port of a SLURM step started without MASTER_PORT; every rank must agree on it without
    communication. A port srun reserved for the step (--resv-ports, or MpiParams=ports in slurm.conf) is
    never another running step's. Failing that, one derived from the job id: jobs a multiple of 20,000
    ids apart on the same first node would share it, which is why the batch shell sets MASTER_PORT."""
    reserved = env.get("SLURM_STEP_RESV_PORTS", "")
    match = re.match(r"(\d+)", reserved)
    if match:
        return match.group(1)
    return str(20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this rank when the process that started it ends (Linux; elsewhere nothing).
    SIGKILL, not a stop signal: with the launcher gone no one reads the ranks' exit codes or restarts them,
    and its other ranks die at the same moment. If the launcher ended before the signal was armed, this
    rank's parent has already changed: it exits now."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        raise SystemExit(f"trilith: rank {os.environ.get('RANK', '?')}: its launcher (PID {parent}) has ended; "
                         "exiting")


def node_name() -> str:
    """This rank's node: SLURM's name for it inside a SLURM job, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def snapshot_node() -> str:
    """The node whose shared memory this rank's memory snapshots live in (engine/checkpoint/memory_snapshot.py):
    node_name(), told apart by torchrun's node rank when several torchrun "nodes" share one host
    (launch/run_pretrain.sh --nnodes M on localhost), so that each keeps its own directory."""
    groups = os.environ.get("GROUP_WORLD_SIZE", "1")
    if groups.isdigit() and int(groups) > 1 and "GROUP_RANK" in os.environ:
        return f"{node_name()}.node{os.environ['GROUP_RANK']}"
    return node_name()


def pick_device(requested: str, local_rank: int) -> tuple[torch.device, str]:
    """This rank's device and the note for the first log line (parallel/device.py); one GPU per rank, by
    local rank, whether the rank sees every GPU of its node or only its own."""
    kind, note = choose_device(requested, torch.cuda.is_available())
    device = torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(gpu_for_local_rank(local_rank, torch.cuda.device_count()))
        device = torch.device("cuda", torch.cuda.current_device())
    nccl_semantics.bind_device(device)
    return device, note


def gpu_for_local_rank(local_rank: int, visible: int) -> int:
    """The GPU index of the rank with `local_rank` among `visible` GPUs: its own when it sees only one (SLURM's
    per-task binding), else the local rank's. More ranks than GPUs on a node is refused: two ranks would share
    a GPU (and NCCL refuses two ranks of one communicator on one device)."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise DeviceUnavailable(f"local rank {local_rank} sees only {visible} GPUs: a node runs more ranks than it "
                                "has GPUs; start one rank per GPU (sbatch --ntasks-per-node equal to "
                                "--gpus-per-node, or --nproc at most the node's GPU count)")
    return local_rank


def init_distributed(device: str = "auto", backend: str = "auto", timeout_minutes: float = 10.0) -> DistEnv:
    launch = discover()
    # Alone, a rank may outlive its shell on purpose (nohup); MPI's process managers end their ranks themselves,
    # and a rank whose parent (the MPI proxy) exits first at the end of a finished run must not die of it.
    if launch.source not in ("single", "openmpi", "mpich"):
        die_with_launcher()
    dev, note = pick_device(device, launch.local_rank)
    chosen = backend if backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
    global _TIMEOUT
    if launch.world_size > 1 and not dist.is_initialized():
        _TIMEOUT = datetime.timedelta(minutes=timeout_minutes)
        addr, port = rendezvous(launch)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=port)
        # NCCL otherwise hangs on a dead peer; with async error handling the watchdog aborts at the timeout.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        dump = nccl_dump_on_timeout() if chosen == "nccl" else ""
        dist.init_process_group(chosen, rank=launch.rank,
                                world_size=launch.world_size, timeout=_TIMEOUT,
                                device_id=dev if dev.type == "cuda" else None)
        comm.register_group(dist.group.WORLD, "world")
        # lets a rank whose collective fails name a dead or frozen peer; under NCCL the watchdog ends the rank
        # before Python sees the failure, so the heartbeat thread reports a stall itself, before the timeout
        heartbeat.start(launch.rank, node_name(), launch.world_size, STALL_FRACTION * _TIMEOUT.total_seconds(), dump)
    nodes = [node_name()] * launch.world_size
    if dist.is_initialized():
        comm.all_gather_object(nodes, node_name(), None)
    return DistEnv(launch.rank, launch.world_size, launch.local_rank, dev, chosen, launch.source, tuple(nodes), note)


_TIMEOUT: datetime.timedelta | None = None
STALL_FRACTION = 0.75  # of the collective timeout without a finished step, before the heartbeat thread reports


def nccl_dump_on_timeout() -> str:
    """Have NCCL's flight recorder (on by default in torch 2.13, TORCH_NCCL_TRACE_BUFFER_SIZE=2000 entries)
    write each rank's last collectives when the watchdog finds a timeout, and say where: a sentence for the
    heartbeat's stall report. The dump goes to the prefix in TORCH_NCCL_DEBUG_INFO_TEMP_FILE (or its newer
    name TORCH_FR_DUMP_TEMP_FILE; torch's default /tmp/nccl_trace_rank_) followed by the rank."""
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.setdefault(
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_")
    if os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] in ("0", "false", "False"):
        return ""
    return (f"At the timeout NCCL's flight recorder writes this rank's last collectives to {prefix}<rank> on its "
            "node (torchfrtrace DIR --prefix NAME compares the ranks' dumps)")


def collective_timeout() -> datetime.timedelta | None:
    """The timeout given to init_distributed, for every process group built later (None: torch's default)."""
    return _TIMEOUT


def host_backend() -> str:
    """The backend of groups that exchange small host objects beside the training's (NCCL) groups: gloo, or
    the fake backend itself under a dry run (engine/dry_run), where no collective moves data."""
    world = dist.get_backend() if dist.is_initialized() else ""
    return world if "fake" in world else "gloo"


def world_group():
    """The default group for job-wide agreement (stop flags), or None when running alone."""
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def shutdown(clean: bool) -> None:
    """Leave torch.distributed. After a clean run, first wait for every rank, so that no rank closes its
    connections while a peer's transport threads still use them (seen as an abort at exit under gloo)."""
    heartbeat.stop()
    if not dist.is_initialized():
        return
    if clean and world_group() is not None:
        comm.all_reduce(torch.zeros(1, device=f"cuda:{torch.cuda.current_device()}" if
                                    dist.get_backend() == "nccl" else "cpu"), world_group())
    dist.destroy_process_group()


def exit_now(status: int) -> None:
    """End a rank's process with `status` after flushing its output, skipping the interpreter's teardown: every
    file is closed by now, and torch's C++ destructors at teardown can abort a rank whose gloo transport threads
    are still winding down ("terminate called without an active exception", status -6), turning a finished run
    into a failure."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def describe_failure(exc: BaseException, env: DistEnv, step: int) -> str:
    """One line naming this rank, its host, the failed collective and its caller, for a dead or hung peer."""
    frames = traceback.extract_tb(exc.__traceback__)
    comm_frames = [i for i, f in enumerate(frames) if f.filename.endswith(os.path.join("parallel", "comm.py"))
                   or "torch/distributed" in f.filename]
    if comm_frames:
        first = comm_frames[0]
        op = frames[first].name
        caller = frames[first - 1] if first > 0 else frames[first]
        where = f"{op} (called from {os.path.relpath(caller.filename)}:{caller.lineno} in {caller.name})"
    else:
        where = f"{frames[-1].name} ({os.path.relpath(frames[-1].filename)}:{frames[-1].lineno})" if frames else "?"
    return (f"trilith: rank {env.rank} of {env.world_size} on {node_name()} failed in {where} during "
            f"step {step + 1}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            " -- a peer rank died or hung (collectives time out after parallel.timeout_minutes); the next line "
            "names silent peers, the launcher's summary a dead one")
