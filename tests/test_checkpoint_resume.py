"""Exact resume in a new process, per parallel layout, and a save killed midway (launch/run_pretrain.sh runs)."""
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.checkpoint.files import read_latest
from tests.helpers import ROOT, launch, tiny_trainer

# One entry per layout: (id, processes, overrides). A layout is one more line here.
LAYOUTS = [
    ("single", 1, []),
    ("tp2-async-dropout", 2, ["parallel.tensor=2", "checkpoint.async_save=true", "model.hidden_dropout=0.1",
                              "model.attention_dropout=0.1"]),
    ("dp2", 2, []),
    ("pp2", 2, ["parallel.pipeline=2"]),
    ("pp2-zbv", 2, ["parallel.pipeline=2", "parallel.schedule=zbv", "parallel.virtual_stages=2"]),
    ("dp2-zero3", 2, ["parallel.zero_stage=3"]),
    ("tp2-pp2-dp2", 8, ["parallel.tensor=2", "parallel.pipeline=2"]),
]


STEPS, SAVED = 10, 5  # a run of STEPS steps, saved at SAVED (after the warm-up, before the cosine's end)
RUN = [f"train.steps={STEPS}"]
SAVED_DIR = f"step_{SAVED:08d}"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The straight single-process run (saving at steps SAVED and STEPS), shared by the tests below."""
    run_dir = tmp_path_factory.mktemp("single")
    return run_dir, launch(run_dir, *RUN, f"checkpoint.interval={SAVED}")


@pytest.mark.parametrize("nproc,overrides", [(n, o) for _, n, o in LAYOUTS], ids=[i for i, _, _ in LAYOUTS])
def test_resume_in_a_new_process_repeats_the_straight_run_exactly(tmp_path, single, nproc, overrides):
    if nproc == 1 and not overrides:
        source, straight = single
    else:
        source, straight = tmp_path / "a", launch(tmp_path / "a", *RUN, f"checkpoint.interval={SAVED}", *overrides,
                                                  nproc=nproc)
    resumed = launch(tmp_path / "b", *RUN, f"checkpoint.load={source / 'checkpoints' / SAVED_DIR}", *overrides,
                     nproc=nproc)
    assert [r["step"] for r in resumed] == list(range(SAVED + 1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[SAVED:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight[SAVED:]]
    assert resumed[-1]["consumed_samples"] == straight[-1]["consumed_samples"]


def test_stopped_run_resumes_from_its_own_latest(tmp_path, single):
    straight = single[1]
    launch(tmp_path / "b", *RUN, f"checkpoint.exit_after={SAVED}")
    assert read_latest(tmp_path / "b" / "checkpoints").name == SAVED_DIR
    records = launch(tmp_path / "b", *RUN)  # same run.dir, no checkpoint.load: continues where it stopped
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in straight]


KILLED_SAVE = textwrap.dedent("""
    import sys, time
    import engine.checkpoint.checkpointer as checkpoint
    from engine.config.schema import load_config
    from engine.train import Trainer
    from parallel.distributed import DistEnv

    trainer = Trainer(load_config("launch/configs/tiny.yaml", [f"run.dir={sys.argv[1]}"]), DistEnv())
    trainer.train_step(); trainer.train_step(); trainer.save_checkpoint()
    write = checkpoint.write_safetensors

    def stalled(path, tensors, metadata):  # half a file on disk, then the process is killed
        write(path, tensors, metadata)
        with open(path, "r+b") as f:
            f.truncate(1000)
        print("WRITING", flush=True)
        time.sleep(600)

    checkpoint.write_safetensors = stalled
    trainer.train_step(); trainer.save_checkpoint()
""")


def test_process_killed_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout.readline().strip() == "WRITING"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    root = tmp_path / "checkpoints"
    assert (root / ".tmp-step_00000003").is_dir() and not (root / "step_00000003").exists()
    assert read_latest(root).name == "step_00000002"
    trainer = tiny_trainer(f"run.dir={tmp_path}")
    assert trainer.step == 2 and trainer.consumed_samples == 16
    assert not (root / ".tmp-step_00000003").exists()
    assert json.loads((root / "step_00000002" / "metadata.json").read_text())["step"] == 2
    assert Path(root / "latest").read_text().strip() == "step_00000002"
