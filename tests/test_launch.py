"""launch/run_pretrain.sh started the ways users start it: two "nodes" on localhost, mpiexec, a killed rank (and
one brought back by --max-restarts), a hung rank, a preempted launcher.

Every multi-rank run must follow the single-process loss curve (≤ 1e-4 per step): same data, same model.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.helpers import ROOT, TINY, read_metrics, single_losses

STEPS = 6
BIN = Path(sys.executable).parent
ENV = {"TRILITH_PYTHON": sys.executable, "PATH": f"{BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def script(*args: str, run_dir: Path) -> list[str]:
    return ["bash", "launch/run_pretrain.sh", *args, "--config", TINY, f"run.dir={run_dir}", f"train.steps={STEPS}"]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def popen(cmd: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process curve (trained in this process: the launched runs below are what is tested)."""
    return single_losses(tmp_path_factory.mktemp("single"), f"train.steps={STEPS}")


def assert_same_curve(reference: list[float], run_dir: Path) -> None:
    got = losses(run_dir)
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(reference, got)) <= 1e-4, (reference, got)


def test_two_nodes_on_localhost_two_ranks_each(reference, tmp_path):
    port = str(free_port())
    nodes = [popen(script("--nproc", "2", "--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1",
                          "--master-port", port, run_dir=tmp_path)) for r in (0, 1)]
    out = [finish(p) for p in nodes]
    assert "4 ranks = TP 1 × PP 1 × DP 4" in out[0]
    assert_same_curve(reference, tmp_path)


def test_mpiexec_four_ranks(reference, tmp_path):
    mpiexec = BIN / "mpiexec"
    assert mpiexec.exists(), f"{mpiexec} missing: install the MPI extra with pip install -e '.[mpi]'"
    out = finish(popen([str(mpiexec), "-n", "4", *script(run_dir=tmp_path)]))
    assert "4 ranks = TP 1 × PP 1 × DP 4" in out
    assert_same_curve(reference, tmp_path)


def test_mpiexec_ranks_that_end_at_different_times_all_finish(tmp_path):
    """Ranks share the rendezvous over MPI, then end one after another with os._exit (exit_now). MPICH's
    mpiexec SIGKILLed the later ones (exit code 9) when the rank itself had loaded the MPI library, whose exit
    handlers os._exit skips."""
    program = ("import sys, time\n"
               "from parallel.distributed import _mpi_rendezvous, discover, exit_now\n"
               "launch = discover()\n"
               "host, port = _mpi_rendezvous(launch.source)\n"
               "time.sleep(0.4 * launch.rank)\n"
               f"open(f'{tmp_path}/ended{{launch.rank}}', 'w').write(f'{{host}}:{{port}}')\n"
               "exit_now(0)\n")
    out = finish(popen([str(BIN / "mpiexec"), "-n", "3", sys.executable, "-c", program], PYTHONPATH=str(ROOT)))
    shared = {p.read_text() for p in tmp_path.glob("ended*")}
    assert len(list(tmp_path.glob("ended*"))) == 3 and len(shared) == 1, (shared, out[-2000:])


def _children(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids] + [g for k in kids for g in _children(int(k))]


def _rank_of(pid: int) -> str:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), "")


def _start_two_ranks(run_dir: Path, timeout_minutes: float, *extra: str, launcher: tuple = (),
                     **env: str) -> subprocess.Popen:
    """A long --nproc 2 run, returned once it has logged three steps."""
    cmd = script("--nproc", "2", *launcher, run_dir=run_dir)[:-1] + [
        "train.steps=100000", f"parallel.timeout_minutes={timeout_minutes}", *extra]
    proc = popen(cmd, **env)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    return proc


def _output_or_kill(proc: subprocess.Popen, timeout: float, act=lambda: None) -> str:
    """`act()`, then the launcher's output once it exits; it is killed if `act` fails or it outlives
    `timeout` (the test fails then)."""
    try:
        act()
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _rank_pid(proc: subprocess.Popen, rank: str) -> int:
    return next(p for p in _children(proc.pid) if _rank_of(p) == rank)


def _latest_step(run_dir: Path) -> int:
    return int(re.search(r"(\d+)$", (run_dir / "checkpoints" / "latest").read_text().strip()).group(1))


def _resume_one_step(run_dir: Path, step: int) -> None:
    resumed = subprocess.run(script(run_dir=run_dir)[:-1] + [f"train.steps={step + 1}"], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr


def test_killed_rank_ends_the_job_with_its_name_and_the_last_checkpoint_loads(tmp_path):
    proc = _start_two_ranks(tmp_path, 0.5, "checkpoint.interval=2")
    # The survivor sees the closed connection at once.
    out = _output_or_kill(proc, 90, lambda: os.kill(_rank_pid(proc, "1"), signal.SIGKILL))
    assert proc.returncode != 0
    # the launcher's last line names the dead rank; torchrun's report is kept in logs/, not on the console
    assert re.search(r"run_pretrain.sh: the run failed \(exit 1\): rank 1 on \S+ was killed by Signal 9 \(SIGKILL\) "
                     r"\(torchrun's report: \S+torchrun.log\)\n$", out), out[-3000:]
    assert "ChildFailedError" not in out and "rank      : 1" in (tmp_path / "logs" / "torchrun.log").read_text()
    # The survivor says where it waited: a comm collective and its caller, or an async bucket wait; then,
    # from the heartbeats, that its peer went silent.
    assert re.search(r"trilith: rank 0 of 2 on \S+ failed in \w+ \((called from )?\S+\.py:\d+", out), out[-3000:]
    assert re.search(r"trilith: rank 0: heartbeats: rank 1 on host \S+ silent for \d+ s", out), out[-3000:]
    _resume_one_step(tmp_path, _latest_step(tmp_path))


def test_max_restarts_brings_a_killed_rank_back_on_the_uninterrupted_curve(tmp_path):
    """--max-restarts 1: rank 1 is killed mid-run; all ranks start again, resume from the last checkpoint and
    finish with exit 0, on the loss curve of a run that was never interrupted."""
    steps = 40
    proc = _start_two_ranks(tmp_path / "run", 0.5, "checkpoint.interval=2", f"train.steps={steps}",
                            launcher=("--max-restarts", "1"))
    out = _output_or_kill(proc, 240, lambda: os.kill(_rank_pid(proc, "1"), signal.SIGKILL))
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"run_pretrain.sh: the run failed \(exit 1\); restart 1 of 1, resuming from the latest "
                     r"checkpoint", out), out[-4000:]
    resumed = re.search(r"resumed from \S+ at step (\d+)", out)
    assert resumed and int(resumed.group(1)) >= 2, out[-4000:]
    records = read_metrics(tmp_path / "run")
    second = records[int(resumed.group(1)) - steps:]  # metrics.jsonl is appended to: the restarted attempt last
    assert [r["step"] for r in second] == list(range(int(resumed.group(1)) + 1, steps + 1))
    want = dict(enumerate(single_losses(tmp_path / "single", f"train.steps={steps}"), 1))
    assert max(abs(r["loss"] - want[r["step"]]) for r in second) <= 1e-4


def test_max_restarts_does_not_retry_a_configuration_error(tmp_path):
    done = subprocess.run(script("--nproc", "2", "--max-restarts", "3", run_dir=tmp_path) + ["model.num_layers=-1"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "restart 1 of" not in done.stderr, done.stderr[-3000:]
    bad = subprocess.run(script("--max-restarts", "x", run_dir=tmp_path), cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--max-restarts must be integers, got 'x'" in bad.stderr
    # attempt k of --nnodes rendezvouses on --master-port + k: the last port must exist
    port = subprocess.run(script("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "65535",
                                 "--max-restarts", "1", run_dir=tmp_path), cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert port.returncode == 2 and port.stderr == (
        "run_pretrain.sh: --master-port must be a port number with room for --max-restarts after it (attempt k uses "
        "port + k), got '65535'\n"), port.stderr


def test_hung_rank_times_out_in_the_named_collective(tmp_path):
    proc = _start_two_ranks(tmp_path, 0.2)  # 12 s collective timeout, data-parallel group included
    victim = _rank_pid(proc, "1")
    try:
        os.kill(victim, signal.SIGSTOP)
        rank0 = [p for p in _children(proc.pid) if _rank_of(p) == "0"]
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and all(Path(f"/proc/{p}").exists() for p in rank0):
            time.sleep(0.5)
        os.kill(victim, signal.SIGCONT)  # let the stopped rank take torchrun's SIGTERM and exit
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert re.search(r"trilith: rank 0 of 2 on \S+ failed in \w+ \(.*([Tt]imed out|timeout)", out), out[-3000:]
    # The stopped rank stopped beating when it stopped: silent for about the collective timeout.
    silent = re.search(r"trilith: rank 0: heartbeats: rank 1 on host \S+ silent for (\d+) s", out)
    assert silent and int(silent.group(1)) >= 10, out[-3000:]


def test_sigterm_to_the_launcher_stops_every_rank_with_a_checkpoint_and_exit_3(tmp_path):
    scratch = tmp_path / "tmp"  # where the launcher keeps its stop-code file
    scratch.mkdir()
    proc = _start_two_ranks(tmp_path, 1, "checkpoint.interval=100000", TMPDIR=str(scratch))
    # To the launcher script, as `kill` or a scheduler would.
    out = _output_or_kill(proc, 90, lambda: proc.send_signal(signal.SIGTERM))
    assert proc.returncode == 3, out[-3000:]
    assert not list(scratch.glob("trilith-stop*"))
    assert "ChildFailedError" not in out and "Traceback" not in out, out[-3000:]
    stopped = re.search(r"trilith: stopped at step (\d+): received SIGTERM; exit 3", out)
    assert stopped, out[-3000:]
    assert _latest_step(tmp_path) == int(stopped.group(1))
    _resume_one_step(tmp_path, int(stopped.group(1)))


def test_preflight_passes_a_sound_config_and_fails_an_exploding_one(tmp_path):
    ok = subprocess.run(["bash", "launch/run_pretrain.sh", "--preflight", "--nproc", "2", "--config", TINY,
                         f"run.dir={tmp_path / 'good'}", "--steps", "40"], cwd=ROOT, env=ENV, capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0 and "PRE-FLIGHT PASSED" in ok.stdout, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert ok.stdout.count("  PASS  ") == 7 and "2 ranks" in ok.stdout and "PASS  matmul alike on 2 ranks" in ok.stdout
    bad = subprocess.run(["bash", "launch/run_pretrain.sh", "--preflight", "--config", TINY, "--steps", "40",
                          f"run.dir={tmp_path / 'bad'}", "optim.lr=30", "optim.clip_grad=0",
                          f"checkpoint.load={tmp_path / 'missing'}"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "PRE-FLIGHT FAILED" in bad.stdout, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert "FAIL  grad norm not exploding" in bad.stdout
    # the shrunk model never loads checkpoint.load: it is judged, as a line, and the pre-flight runs
    assert f"FAIL  checkpoint.load={tmp_path / 'missing'}: checkpoint.load={tmp_path / 'missing'} is neither" in \
        bad.stdout and "Traceback" not in bad.stdout + bad.stderr
