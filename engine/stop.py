"""Stopping a run early and cleanly: preemption signals and GPU-health thresholds, agreed by every rank.

SIGTERM or SIGUSR1 (what SLURM sends before preemption or the time limit; `#SBATCH --signal=USR1@120`)
only sets a flag: the current step finishes, then all ranks agree (one MAX all-reduce of a small integer
per step) to stop at the same step, save a checkpoint and exit with PREEMPTED_EXIT, which
launch/run_pretrain.sh turns into a SLURM requeue. A GPU-health stop exits with HEALTH_EXIT; the nodes
whose GPUs crossed a threshold are gathered to rank 0 and left in the launcher's stop file, so that under
sbatch the job can be requeued without them (the same GPU would fail again).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from engine.observe.health import HealthMonitor
from parallel import comm
from parallel.distributed import DistEnv, node_name, world_group

PREEMPTED_EXIT = 3
HEALTH_EXIT = 4
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def exit_status(code: int, unhealthy_nodes: tuple = ()) -> int:
    """The process exit status for a stop. Under the sbatch wrapper (TRILITH_STOP_FILE set) every rank exits 0,
    so srun's --kill-on-bad-exit cannot race the others, and rank 0 leaves the code in the file instead,
    with a second line `unhealthy NODE[,NODE...]` after a GPU-health stop."""
    path = os.environ.get("TRILITH_STOP_FILE")
    if not path:
        return code
    if not dist.is_initialized() or dist.get_rank() == 0:
        nodes = f"unhealthy {','.join(unhealthy_nodes)}\n" if unhealthy_nodes else ""
        Path(path).write_text(f"{code}\n{nodes}")
    return 0


def final_failure(code: int) -> int:
    """The exit status for a failure that starting again would only repeat (a configuration error, an
    unloadable checkpoint, a checkpoint that cannot be written (a full disk), non-finite training, replicas
    that differ, a failed pre-flight), also left in the launcher's stop file: a code there is final, so
    launch/run_pretrain.sh --max-restarts does not retry it. Any rank may write it."""
    path = os.environ.get("TRILITH_STOP_FILE")
    if path:
        Path(path).write_text(f"{code}\n")
    return code


class StopRun(Exception):
    """Raised after the checkpoint of an early stop; `code` is the process exit status."""

    def __init__(self, code: int, message: str, unhealthy_nodes: tuple = ()):
        super().__init__(message)
        self.code, self.unhealthy_nodes = code, unhealthy_nodes


class StopControl:
    def __init__(self, env: DistEnv, health: HealthMonitor | None = None):
        self.env, self.health = env, health
        self.signal_name = ""
        self.unhealthy_nodes: tuple = ()  # after a GPU-health stop: the nodes whose GPUs crossed a threshold
        # Python only lets the main thread install handlers (run() may be called from a worker thread).
        self.installed = threading.current_thread() is threading.main_thread()
        for sig in STOP_SIGNALS if self.installed else ():
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def check(self, step: int) -> tuple[list | None, int]:
        """After `step` steps: (GPU readings if read now, exit code every rank agreed on; 0 = keep going)."""
        local, readings = 0, None
        if self.signal_name:
            local = PREEMPTED_EXIT
        if self.health is not None and self.health.due(step):
            readings, reason = self.health.check(step)
            if reason:
                print(f"trilith: rank {self.env.rank}: GPU health threshold crossed: {reason}; stopping after "
                      f"a checkpoint", file=sys.stderr, flush=True)
                local = HEALTH_EXIT
        flag = torch.tensor([local], dtype=torch.int32, device=self.env.device)
        comm.all_reduce(flag, world_group(), op=dist.ReduceOp.MAX)
        code = int(flag.item())
        if code == HEALTH_EXIT:
            self.unhealthy_nodes = self._gather_unhealthy(local == HEALTH_EXIT)
        return readings, code

    def _gather_unhealthy(self, mine: bool) -> tuple:
        """Every rank learns which nodes reported a GPU past a threshold (once per run: it stops after):
        one flag per rank, named through the node of every rank gathered at start (DistEnv.nodes)."""
        flags = torch.zeros(self.env.world_size, dtype=torch.int32, device=self.env.device)
        flags[self.env.rank] = int(mine)
        comm.all_reduce(flags, world_group())
        nodes = self.env.nodes or (node_name(),) * self.env.world_size
        return tuple(sorted({nodes[r] for r in flags.nonzero().flatten().tolist()}))

    def message(self, code: int, step: int) -> str:
        if code == PREEMPTED_EXIT:
            why = f"received {self.signal_name}" if self.signal_name else "another rank received a stop signal"
            return f"trilith: stopped at step {step}: {why}; exit {code} (requeue and rerun to resume)"
        nodes = ", ".join(self.unhealthy_nodes) or "a node"
        return f"trilith: stopped at step {step}: GPU health threshold crossed on {nodes} (see stderr / " \
               f"logs/health-*.jsonl); exit {code}"

    def barrier(self) -> None:
        """Every rank has saved its part before anyone exits (a launcher may kill the rest on the first exit)."""
        comm.all_reduce(torch.zeros(1, device=self.env.device), world_group())

    def restore(self) -> None:
        for sig in STOP_SIGNALS if self.installed else ():
            signal.signal(sig, signal.SIG_DFL)
