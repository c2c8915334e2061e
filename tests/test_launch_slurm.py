"""sbatch launch/run_pretrain.sh on a real two-node SLURM cluster started by the test (tests/slurm_cluster.py):
both slurmds run on this machine, but SLURM allocates, places and signals the job's tasks as on two hosts.

Skips, with the reason printed, only when Debian's SLURM packages cannot be installed here.
"""
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY, read_metrics, single_losses
from tests.slurm_cluster import SlurmCluster, SlurmUnavailable

BIN = Path(sys.executable).parent
ENV = {"TRILITH_PYTHON": sys.executable, "PATH": f"{BIN}:/usr/bin:/bin:/usr/sbin", "OMP_NUM_THREADS": "1"}
# Four ranks, two per node, as the README and docs/launching.md write it (--nodes × --ntasks-per-node, no -n:
# a --ntasks among the script's #SBATCH defaults would override the product), one CPU each on this machine's
# cores (the script's --open-mode=append stays: a requeued job's output keeps the first attempt's lines).
FOUR_RANKS = ["--nodes=2", "--ntasks-per-node=2", "-c", "1", "--overcommit"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2).__enter__()
    except SlurmUnavailable as exc:
        print(f"SKIP SLURM tests: {exc}")
        pytest.skip(f"SLURM cannot be installed here: {exc}")
    yield c
    c.close()


def steps_per_attempt(run_dir: Path) -> list[list[dict]]:
    """metrics.jsonl is appended by every attempt; an attempt starts where the step number drops."""
    attempts: list[list[dict]] = []
    for record in read_metrics(run_dir):
        if not attempts or record["step"] <= attempts[-1][-1]["step"]:
            attempts.append([])
        attempts[-1].append(record)
    return attempts


def reference_losses(run_dir: Path, steps: int) -> list[float]:
    """The single-process curve of a `steps`-step run (trained in this process)."""
    return single_losses(run_dir, f"train.steps={steps}")


def wait_for_steps(cluster, job: str, run_dir: Path, out: Path, steps: int) -> Path:
    """Wait until the job has logged `steps` steps (failing if it ends first); returns its metrics file."""
    deadline = time.monotonic() + 180
    metrics = run_dir / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        assert time.monotonic() < deadline and cluster.state(job)[0] in ("PENDING", "RUNNING", "CONFIGURING"), \
            (cluster.state(job), out.read_text()[-3000:] if out.exists() else "")
        time.sleep(0.3)
    return metrics


def test_sbatch_on_two_nodes_trains_and_names_a_split_tensor_group(cluster, tmp_path):
    """sbatch --nodes=2 --ntasks-per-node=2: four ranks, TP 2 × DP 2 over two nodes with SLURM's cyclic task
    distribution: ranks 0 and 1 (a TP pair) land on different nodes. The run says where every rank is, warns
    about the split group, and still follows the single-process loss curve."""
    out = tmp_path / "job.out"
    job = cluster.sbatch([*FOUR_RANKS, "--distribution=cyclic", f"--output={out}", "launch/run_pretrain.sh",
                          "--config", TINY, f"run.dir={tmp_path / 'run'}", "train.steps=6", "parallel.tensor=2"],
                         cwd=ROOT, env=ENV)
    state, code = cluster.wait(job, timeout=240, output=out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text[-3000:] + cluster.logs()
    assert "4 ranks = TP 2 × PP 1 × DP 2" in text
    placement = re.search(r"placement: 2 nodes \((\S+): ranks 0,2; (\S+): ranks 1,3\)", text)
    assert placement and set(placement.groups()) == set(cluster.nodes), text[-3000:]
    assert "WARNING: 2 of 2 tensor-parallel groups span nodes (ranks 0-1 on" in text, text[-3000:]
    got = [r["loss"] for r in steps_per_attempt(tmp_path / "run")[0]]
    ref = reference_losses(tmp_path / "single", 6)
    assert len(got) == 6 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-4, (ref, got)


def test_preemption_signal_checkpoints_requeues_and_resumes(cluster, tmp_path):
    """SIGUSR1 to a job on two nodes (block placement): every rank saves and stops, the job requeues itself
    and the next attempt resumes on the uninterrupted loss curve."""
    run_dir, out, steps = tmp_path / "run", tmp_path / "job.out", 60
    job = cluster.sbatch([*FOUR_RANKS, f"--output={out}", "launch/run_pretrain.sh", "--config", TINY,
                          f"run.dir={run_dir}", f"train.steps={steps}"], cwd=ROOT, env=ENV)
    wait_for_steps(cluster, job, run_dir, out, 3)
    cluster.run(["scancel", "--signal=USR1", job])
    state, code = cluster.wait(job, timeout=240, output=out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text[-3000:] + cluster.logs()
    assert "received SIGUSR1" in text and f"requeueing job {job}" in text, text[-3000:]
    assert "Restarts=1" in cluster.run(["scontrol", "show", "job", job]).stdout
    assert re.search(r"placement: 2 nodes \(\S+: ranks 0-1; \S+: ranks 2-3\)", text) and "WARNING: " not in text
    stopped = int(re.search(r"stopped at step (\d+): received SIGUSR1", text).group(1))
    assert 3 <= stopped < steps, "every rank stopped together after the signal, before the end"
    assert f"resumed from {run_dir / 'checkpoints'}" in text and f"at step {stopped}" in text, text[-3000:]
    # One attempt stopped at `stopped`, the requeued one continued from there: every step exactly once,
    # on the loss curve of an uninterrupted run.
    records = steps_per_attempt(run_dir)[0]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    ref = reference_losses(tmp_path / "single", steps)
    assert max(abs(a - r["loss"]) for a, r in zip(ref, records)) <= 1e-4, (ref, [r["loss"] for r in records])


def _rank_process(job: str, rank: int) -> int:
    """The pid of the training process of `rank` in SLURM job `job` (tasks are children of slurmstepd)."""
    for proc in Path("/proc").iterdir():
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and f"SLURM_PROCID={rank}".encode() in env \
                and b"engine.train" in cmdline:
            return int(proc.name)
    raise AssertionError(f"no training process of rank {rank} in job {job}")


def test_max_restarts_reruns_a_failed_step_in_the_same_allocation(cluster, tmp_path):
    """--max-restarts 1 in a batch job: a rank killed on the second node makes srun end the step; the batch
    shell starts a new one, which resumes from the last checkpoint, and the job completes on the curve."""
    run_dir, out, steps = tmp_path / "run", tmp_path / "job.out", 40
    job = cluster.sbatch([*FOUR_RANKS, f"--output={out}", "launch/run_pretrain.sh", "--max-restarts", "1",
                          "--config", TINY, f"run.dir={run_dir}", f"train.steps={steps}", "checkpoint.interval=2"],
                         cwd=ROOT, env=ENV)
    wait_for_steps(cluster, job, run_dir, out, 3)
    os.kill(_rank_process(job, 3), signal.SIGKILL)
    state, code = cluster.wait(job, timeout=240, output=out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text[-3000:] + cluster.logs()
    assert re.search(r"the run failed \(exit \d+\); restart 1 of 1, resuming from the latest checkpoint", text), \
        text[-3000:]
    resumed = int(re.search(r"resumed from \S+ at step (\d+)", text).group(1))
    records = read_metrics(run_dir)
    second = records[resumed - steps:]  # metrics.jsonl is appended to: the restarted attempt last
    assert [r["step"] for r in second] == list(range(resumed + 1, steps + 1))
    ref = reference_losses(tmp_path / "single", steps)
    assert max(abs(ref[r["step"] - 1] - r["loss"]) for r in second) <= 1e-4


def test_a_lost_node_resumes_from_the_partner_copies_of_its_shards(cluster, tmp_path):
    """Memory snapshots every 2 steps on two SLURM nodes of one rank each (snapshot directories by SLURM node
    name): rank 1 deletes its node's snapshots after step 4's and dies (run.inject_fault=lose_node); srun ends the
    step, the batch shell starts a new one (--max-restarts 1), rank 1 takes its shard of step 4 from rank 0's
    partner copy and the job completes on the single-process curve."""
    run_dir, out, shm = tmp_path / "run", tmp_path / "job.out", tmp_path / "shm"
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", "-c", "1", "--overcommit", f"--output={out}",
                          "launch/run_pretrain.sh", "--max-restarts", "1", "--config", TINY, f"run.dir={run_dir}",
                          "train.steps=6", "checkpoint.memory_interval=2", f"checkpoint.memory_dir={shm}",
                          "run.inject_fault=lose_node@step=4,rank=1"], cwd=ROOT, env=ENV)
    state, code = cluster.wait(job, timeout=300, output=out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text[-3000:] + cluster.logs()
    assert "restart 1 of 1" in text and \
        "recovery: from memory (partner copies for rank 1) at step 4: 0 steps lost" in text, text[-3000:]
    assert sorted(p.name for p in shm.iterdir()) == sorted(cluster.nodes)  # one directory per SLURM node name
    got = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    ref = reference_losses(tmp_path / "single", 6)
    assert sorted(got) == list(range(1, 7)) and max(abs(ref[s - 1] - got[s]) for s in got) <= 1e-4, (ref, got)


# nvidia-ml-py's module as the monitor uses it, for a CPU job: one GPU whose temperature crosses 90 °C at
# its second reading in the job's first run, and stays at 60 °C once SLURM has requeued the job.
FAKE_PYNVML = '''
import os


class NVMLError(Exception):
    """What nvidia-ml-py raises for a field a GPU does not report."""


NVML_TEMPERATURE_GPU, NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_VOLATILE_ECC = 0, 1, 2, 1
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
readings = 0


def nvmlInit():
    return None


def nvmlDeviceGetCount():
    return 1


def nvmlDeviceGetHandleByIndex(index):
    return index


def nvmlDeviceGetUUID(handle):
    return "GPU-fake-0"


def nvmlDeviceGetTemperature(handle, sensor):
    global readings
    readings += 1
    return 95 if readings >= 2 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 60


def unsupported(*args):
    raise NVMLError("not supported on this GPU")


nvmlDeviceGetPowerUsage = nvmlDeviceGetEnforcedPowerLimit = nvmlDeviceGetCurrentClocksEventReasons = unsupported
nvmlDeviceGetTotalEccErrors = nvmlDeviceGetClockInfo = unsupported
'''


def test_gpu_health_stop_requeues_the_job_without_the_hot_node(cluster, tmp_path):
    """A GPU crosses run.max_gpu_temperature: every rank saves and stops (exit 4), the batch shell submits the
    job that requeues it with the node the ranks named excluded; the next run lands on the other node,
    resumes from the checkpoint and completes, every step once, on the uninterrupted loss curve."""
    fake = tmp_path / "fake_nvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(FAKE_PYNVML)
    run_dir, out, steps = tmp_path / "run", tmp_path / "job.out", 16
    job = cluster.sbatch(["-N", "1", "-n", "2", "-c", "1", "--overcommit", f"--output={out}",
                          "launch/run_pretrain.sh", "--config", TINY, f"run.dir={run_dir}", f"train.steps={steps}",
                          "run.health_interval=4", "run.max_gpu_temperature=90"],
                         cwd=ROOT, env={**ENV, "PYTHONPATH": str(fake)})
    # FAILED (exit 4) first, then requeued
    state, code = cluster.wait(job, timeout=240, until=("COMPLETED",), output=out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text[-3000:] + cluster.logs()
    hot = re.search(r"stopped at step 4: GPU health threshold crossed on (\S+) ", text)
    assert hot and hot.group(1) in cluster.nodes, text[-3000:]
    assert "temperature 95 °C above run.max_gpu_temperature=90" in text
    assert f"job {job} goes back to the queue without node(s) {hot.group(1)} once it has ended" in text, text[-3000:]
    assert f"run_pretrain.sh: job {job} requeued without node(s) {hot.group(1)}" in text, text[-3000:]
    shown = cluster.run(["scontrol", "show", "job", job]).stdout
    assert "Restarts=1" in shown and f"ExcNodeList={hot.group(1)}" in shown, shown
    placed = re.findall(r"placement: 1 nodes? \((\S+): ranks 0-1\)", text)
    assert placed == [hot.group(1), next(n for n in cluster.nodes if n != hot.group(1))], text[-3000:]
    assert f"resumed from {run_dir / 'checkpoints'}" in text and "at step 4" in text, text[-3000:]
    records = steps_per_attempt(run_dir)[0]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    ref = reference_losses(tmp_path / "single", steps)
    assert max(abs(a - r["loss"]) for a, r in zip(ref, records)) <= 1e-4, (ref, [r["loss"] for r in records])


def test_requeued_job_keeps_the_first_attempts_output(cluster, tmp_path):
    """With the script's own #SBATCH --open-mode=append (not overridden here), the output of the attempt that
    was preempted survives the requeue, and each attempt's start is marked with the restart count."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = cluster.sbatch(["-N", "1", "-n", "1", "-c", "1", "--overcommit", f"--output={out}",
                          "launch/run_pretrain.sh", "--config", TINY, f"run.dir={run_dir}", "train.steps=40"],
                         cwd=ROOT, env=ENV)
    wait_for_steps(cluster, job, run_dir, out, 3)
    cluster.run(["scancel", "--signal=USR1", job])
    state, code = cluster.wait(job, timeout=240, until=("COMPLETED", "FAILED", "CANCELLED"), output=out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text[-3000:] + cluster.logs()
    assert "received SIGUSR1" in text and f"requeueing job {job}" in text, text[-3000:]  # the first attempt's
    starts = re.findall(rf"run_pretrain.sh: job {job} starting \(SLURM restart count (\d)\) on \S+ at \S+Z", text)
    assert starts == ["0", "1"], text[-3000:]
    first, second = text.split("SLURM restart count 1")
    assert "received SIGUSR1" in first and f"requeueing job {job}" in first, text[-3000:]
    assert "resumed from" in second, text[-3000:]


# Loaded by every Python of the job (PYTHONPATH): rank 0 of a job step leaves the given text in the batch
# shell's stop file and every rank exits 0 at once, as engine/stop.py does after an early stop.
FAKE_RANK = '''
import os
if os.environ.get("SLURM_STEP_ID") is not None:
    if os.environ.get("SLURM_PROCID") == "0":
        with open(os.environ["TRILITH_STOP_FILE"], "w") as f:
            f.write(os.environ["STOP_TEXT"])
    os._exit(0)
'''


@pytest.mark.parametrize("text, code", [("PATH[$(touch {pwned})]\n", "1:0"), ("4\nunhealthy $(touch {pwned})\n", "4:0")])
def test_hostile_stop_file_runs_nothing_in_the_batch_shell(cluster, tmp_path, text, code):
    """Text in the stop file is data: a first line that is not a number is a failure (1), a node line that
    is not SLURM node names requeues nothing; no command in it runs, now or in a helper job."""
    fake, out, pwned = tmp_path / "fake", tmp_path / "job.out", tmp_path / "pwned"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FAKE_RANK)
    job = cluster.sbatch(["-N", "1", "-n", "1", "-c", "1", "--overcommit", f"--output={out}", "launch/run_pretrain.sh",
                          "--config", TINY, f"run.dir={tmp_path / 'run'}"], cwd=ROOT,
                         env={**ENV, "PYTHONPATH": str(fake), "STOP_TEXT": text.format(pwned=pwned)})
    state, got = cluster.wait(job, timeout=120, output=out)
    assert (state, got) == ("FAILED", code), out.read_text()[-3000:] + cluster.logs()
    assert not pwned.exists(), out.read_text()[-3000:]
    # No requeue helper job was submitted (ended jobs stay listed for MinJobAge, 300 s).
    assert f"JobName=trilith-exclude-{job}" not in cluster.run(["scontrol", "-o", "show", "jobs"]).stdout
    assert "unbound variable" not in out.read_text() and "goes back to the queue" not in out.read_text()


def test_a_port_derived_from_the_job_id_may_be_taken_by_a_job_20000_ids_earlier(cluster, tmp_path):
    """Job N's derived port, 20000 + N % 20000, is job N - 20000's too: here a listening socket holds it, as
    that job's rendezvous store would on the same first node. The batch shell picks a port the kernel says
    is free, so the job's two ranks still meet and train."""
    out, run_dir = tmp_path / "job.out", tmp_path / "run"
    job = cluster.sbatch(["--hold", "-w", cluster.nodes[0], "-N", "1", "-n", "2", "-c", "1", "--overcommit",
                          f"--output={out}", "launch/run_pretrain.sh", "--config", TINY, f"run.dir={run_dir}",
                          "train.steps=3"], cwd=ROOT, env=ENV)
    with socket.socket() as earlier_job:
        earlier_job.bind(("", 20000 + int(job) % 20000))
        earlier_job.listen()
        cluster.run(["scontrol", "release", job])
        state, code = cluster.wait(job, timeout=180, output=out)
    assert (state, code) == ("COMPLETED", "0:0"), out.read_text()[-3000:] + cluster.logs()
    assert len(steps_per_attempt(run_dir)[0]) == 3
