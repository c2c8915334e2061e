"""launch/run_pretrain.sh against what goes wrong around a run: a configuration error under --nproc, a stop
file holding something other than a code, a launcher killed with kill -9, a second launch into a run
directory that a live run is using. Real processes throughout.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY

BIN = Path(sys.executable).parent
ENV = {"TRILITH_PYTHON": sys.executable, "PATH": f"{BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}

# Loaded by every Python the launcher starts (PYTHONPATH): a rank (RANK set by torchrun) leaves the given
# text in the launcher's stop file and exits 0 at once, as engine/stop.py does after an early stop.
FAKE_RANK = '''
import os
if os.environ.get("RANK") == "0":
    with open(os.environ["TRILITH_STOP_FILE"], "w") as f:
        f.write(os.environ["STOP_TEXT"])
if os.environ.get("RANK"):
    os._exit(0)
'''


def launch(*args: str, run_dir: Path, overrides: tuple = (), **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "launch/run_pretrain.sh", *args, "--config", TINY, f"run.dir={run_dir}",
                           *overrides], cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True, timeout=240)


def test_nproc_configuration_error_is_one_line_and_no_rank_starts(tmp_path):
    done = launch("--nproc", "2", run_dir=tmp_path / "run", overrides=("model.num_layers=-1",))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [done.stderr.strip()] and "model.num_layers" in done.stderr, done.stderr[-3000:]
    assert done.stderr.startswith("trilith: configuration error:")
    assert not (tmp_path / "run").exists()  # no rank ever ran


@pytest.mark.parametrize("text, code", [
    ("4\nunhealthy node-7\n", 4),  # a GPU-health stop, as engine/stop.py writes it
    ("PATH[$(touch {pwned})]\n", 1),  # bash arithmetic would run the command substitution
    ("4\nunhealthy n1,$(touch {pwned})\n", 4),
    ("3 ; touch {pwned}\n", 1),
])
def test_nproc_stop_file_gives_its_code_and_runs_nothing(tmp_path, text, code):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FAKE_RANK)
    pwned = tmp_path / "pwned"
    done = launch("--nproc", "2", run_dir=tmp_path / "run", PYTHONPATH=str(fake),
                  STOP_TEXT=text.format(pwned=pwned), TMPDIR=str(tmp_path))
    assert done.returncode == code, done.stderr[-3000:]
    assert not pwned.exists()
    assert "unbound variable" not in done.stderr and "syntax error" not in done.stderr, done.stderr[-3000:]
    assert not list(tmp_path.glob("trilith-stop*"))  # the launcher's own file is gone


def _children(pid: int) -> list[int]:
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


def _training(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) training rank."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        return state != "Z" and b"engine.train" in cmdline and b"torch.distributed.run" not in cmdline
    except OSError:
        return False


def _wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 180
    while not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)


def _long_run(run_dir: Path, *args: str) -> subprocess.Popen:
    """A --nproc run (in a process group of its own) that would train for hours, once it has logged steps."""
    proc = subprocess.Popen(["bash", "launch/run_pretrain.sh", *args, "--config", TINY, f"run.dir={run_dir}",
                             "train.steps=100000", "checkpoint.interval=100000"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _wait_for_steps(proc, run_dir, 2)
    return proc


def _end(proc: subprocess.Popen, pids: list[int]) -> None:
    """Clean-up after a test: the launcher's group and any rank left over, by their process ids."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:  # first: a rank left over holds the output pipe open
        if _training(pid):
            os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=30)


def test_ranks_die_with_a_killed_launcher(tmp_path):
    proc = _long_run(tmp_path, "--nproc", "2")
    ranks = [p for p in _children(proc.pid) if _training(p)]
    try:
        assert len(ranks) == 2, ranks
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and torchrun, as an OOM killer or operator would
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_training(p) for p in ranks):
            time.sleep(0.2)
        assert not [p for p in ranks if _training(p)], "ranks still training after their launcher was killed"
    finally:
        _end(proc, ranks)


def test_second_launch_into_a_live_run_dir_refuses_and_a_dead_holders_lock_is_taken_over(tmp_path):
    first = _long_run(tmp_path, "--nproc", "1")  # one process: the rank is the launcher's exec
    try:
        holder = (tmp_path / "run.lock").read_text()
        assert f'"pid": {first.pid}' in holder, holder
        for second in (launch("--nproc", "2", run_dir=tmp_path),  # refused by the launcher, before any rank
                       subprocess.run([sys.executable, "-m", "engine.train", "--config", TINY, f"run.dir={tmp_path}"],
                                      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)):  # by rank 0
            assert second.returncode == 2, second.stderr[-3000:]
            line = second.stderr.strip()
            assert "\n" not in line and f"run.dir={tmp_path} is in use" in line and f"PID {first.pid} on " in line, \
                second.stderr[-3000:]
        assert first.poll() is None
        os.killpg(first.pid, signal.SIGKILL)  # a crash: the kernel releases the lock, the file stays
        first.communicate()
        assert (tmp_path / "run.lock").exists()
        third = launch(run_dir=tmp_path, overrides=("train.steps=2",))
        assert third.returncode == 0, third.stderr[-3000:]
    finally:
        _end(first, [])


def test_a_rank_whose_launcher_ended_before_it_armed_the_death_signal_exits():
    """The death signal is armed (the kernel reports SIGKILL), and a parent that changed meanwhile (the
    launcher died first, the rank was adopted) ends the rank with one line."""
    code = ("import ctypes, os, signal\n"
            "from parallel.distributed import die_with_launcher\n"
            "die_with_launcher()\n"
            "armed = ctypes.c_int()\n"
            "ctypes.CDLL(None).prctl(2, ctypes.byref(armed), 0, 0, 0)  # PR_GET_PDEATHSIG\n"
            "assert armed.value == signal.SIGKILL, armed.value\n"
            "parents = iter([4321, 1])\n"
            "os.getppid = lambda: next(parents)\n"
            "die_with_launcher()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**ENV, "RANK": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.strip() == \
        "trilith: rank 1: its launcher (PID 4321) has ended; exiting", done.stderr[-3000:]


def test_launch_check_takes_the_model_from_a_hugging_face_checkpoint_as_the_ranks_do(tmp_path, capsys):
    """checkpoint.load naming a Hugging Face directory replaces model.* before validation, in the ranks and
    so in the launcher's check: an architecture the run's own model.* would not pass is not refused."""
    spec = importlib.util.spec_from_file_location("trilith_launch_check", ROOT / "launch" / "check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 64}))
    args = ["--world-size", "1", "--config", str(ROOT / TINY), f"run.dir={tmp_path / 'run'}",
            "model.num_attention_heads=3"]  # 64 is not divisible by 3
    assert check.main(args) == 2 and "num_attention_heads" in capsys.readouterr().err
    assert check.main(args + [f"checkpoint.load={hf}"]) == 0, capsys.readouterr().err
