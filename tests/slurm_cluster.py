"""A real SLURM cluster on localhost for tests: munge + slurmctld + one slurmd per node, started and torn down here.

    with SlurmCluster(tmp_path, nodes=2) as cluster:   # installs Debian's packages with apt-get if missing
        job = cluster.sbatch(["-N", "2", "-n", "4", "launch/run_pretrain.sh", ...], cwd=ROOT, env=...)
        state, exit_code = cluster.wait(job, timeout=300)

`SlurmUnavailable` is raised (and the tests skip with its message) only when the packages cannot be
installed. The first node is this machine's real host name; a second node is a second slurmd (its own port,
spool and log) named `localhost`, another name of this machine that every rank can resolve, so that a job
spans two SLURM nodes as on a real cluster: one srun task set per node, SLURM_NODEID 0 and 1, the
rendezvous host taken from the node list. Each node declares at least 8 CPUs, as a GPU node has for its 8
ranks, so that run_pretrain.sh's `#SBATCH --ntasks-per-node=8` fits (slurmd accepts more than the machine has
with `SlurmdParameters=config_overrides`); jobs run more tasks than cores with `--overcommit`.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODE_CPUS = 8  # declared per node at least: run_pretrain.sh's 8 tasks per node need 8 CPUs with -c 1
BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue", "scancel", "sacct")


class SlurmUnavailable(RuntimeError):
    """The Debian SLURM packages could not be installed or started on this machine."""


def _have_binaries() -> bool:
    return all(shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin") for b in BINARIES[:7])


def ensure_installed() -> None:
    if _have_binaries():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("SLURM is not installed and apt-get as root is not available to install "
                               f"{' '.join(PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout)[-800:]}")
    if not _have_binaries():
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)} but the SLURM binaries are still missing")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=trilith
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldTimeout=30
# srun on a 2-core host busy with the ranks' exit can miss the default 10 s for a task-exit message; slurmstepd
# does not resend it, and the job would then run until its time limit.
MessageTimeout=60
SlurmdTimeout=30
KillWait=20
{node_lines}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 1):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        if nodes not in (1, 2):
            raise ValueError("a localhost cluster has one or two nodes")
        if nodes == 2 and self.host == "localhost":
            raise SlurmUnavailable("a two-node cluster on this machine needs a host name other than localhost")
        self.nodes = [self.host, "localhost"][:nodes]
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.env["PATH"] = self.env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin"
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "SlurmCluster":
        ensure_installed()
        for d in ("state", "munge"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        cpus = max(os.cpu_count() or 1, NODE_CPUS)
        node_lines = "\n".join(f"NodeName={n} CPUs={cpus} Port={_free_port()} State=UNKNOWN" for n in self.nodes)
        self.conf.write_text(SLURM_CONF.format(host=self.host, root=self.root, ctld_port=_free_port(),
                                               slurmd_port=_free_port(), node_lines=node_lines,
                                               node_names=",".join(self.nodes)))
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = str(self.root / "munge" / "munge.socket")
        self.env["MUNGE_SOCKET"] = self.munge_socket  # not read by slurm; kept for humans debugging
        self._daemon(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                      f"--pid-file={self.root / 'munge' / 'munged.pid'}", f"--seed-file={self.root / 'munge' / 'seed'}",
                      f"--log-file={self.root / 'munge' / 'munged.log'}"])
        self._wait_for(lambda: Path(self.munge_socket).exists(), "munged socket")
        self.conf.write_text(self.conf.read_text().replace(
            "AuthType=auth/munge", f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket},cred_expire=10"))
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._daemon(["slurmd", "-D", "-f", str(self.conf), "-N", node], log_name=f"slurmd-{node}")
        self._wait_for(self._nodes_idle, f"nodes {', '.join(self.nodes)} to become idle")

    def _daemon(self, cmd: list[str], log_name: str = "") -> None:
        log = open(self.root / f"{log_name or cmd[0]}.stdout", "w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def _wait_for(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited ({p.returncode}) while waiting for {what}:\n"
                                       + self.logs())
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}:\n" + self.logs())

    def _nodes_idle(self) -> bool:
        states = self.run(["sinfo", "-h", "-N", "-o", "%t"], check=False).stdout.split()
        return len(states) == len(self.nodes) and all(s in ("idle", "mix") for s in states)

    def run(self, cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                              timeout=60, **kw)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr}{done.stdout}")
        return done

    def sbatch(self, args: list[str], cwd: Path, env: dict) -> str:
        return self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env).stdout.strip().split(";")[0]

    def state(self, job: str) -> tuple[str, str]:
        """(state, exit code "N:S") from scontrol; the job record stays for MinJobAge after it ends."""
        out = self.run(["scontrol", "-o", "show", "job", job]).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "?"), fields.get("ExitCode", "?")

    def wait(self, job: str, timeout: float, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                     "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"),
             output: Path | None = None) -> tuple[str, str]:
        """Poll until the job reaches a state in `until`; a timeout names the daemons' logs and the tail of the
        job's own `output` file, where what the ranks were doing is."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, code = self.state(job)
            if state in until:
                return state, code
            time.sleep(1)
        tail = output.read_text()[-3000:] if output is not None and output.exists() else ""
        raise TimeoutError(f"job {job} still {self.state(job)} after {timeout}s:\n" + self.logs()
                           + (f"\n--- {output.name} ---\n{tail}" if tail else ""))

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", *(f"slurmd-{n}.log" for n in self.nodes), "munge/munged.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name} ---\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(parts)

    def close(self) -> None:
        for p in reversed(self.procs):  # only the daemons this object started, by their process ids
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()

    def __exit__(self, *exc) -> None:
        self.close()
