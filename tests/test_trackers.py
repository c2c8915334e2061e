"""TensorBoard and W&B (engine/observe/trackers.py): the event files hold every metric of metrics.jsonl at every logged
step, once, across a crash and resume; W&B in offline mode writes the same keys to its run directory and keeps
one run id; a missing package or a tracker failing mid-run is one warning and the run finishes."""
import json
import struct
import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from engine.config.schema import load_config
from engine.observe.trackers import Trackers, scalars
import engine.observe.trackers
from engine.train import Trainer
from engine.train import main as train_main
from tests.helpers import TINY, read_metrics
SHORT = ["model.num_layers=2", "train.steps=6", "train.log_interval=1", "run.health_interval=0"]


def crash_after(monkeypatch, last_step: int) -> None:
    """Trainer.train_step raises once step `last_step` is done: a node lost between checkpoints."""
    step = Trainer.train_step

    def train_step(self):
        if self.step == last_step:
            raise RuntimeError("node lost")
        return step(self)
    monkeypatch.setattr(Trainer, "train_step", train_step)


def test_nested_values_become_group_name_scalars():
    record = {"step": 7, "loss": 2.5, "skipped": False, "eval_loss_by_dataset": {"wiki": 3.0},
              "attention_entropy": [1.0, 2.0], "gpu": [{"temperature_c": 60, "uuid": "GPU-1", "throttle": None}]}
    assert scalars(record) == {"loss": 2.5, "skipped": 0.0, "eval_loss_by_dataset/wiki": 3.0,
                               "attention_entropy/0": 1.0, "attention_entropy/1": 2.0, "gpu/0/temperature_c": 60.0}


def test_tensorboard_holds_every_metric_at_every_step_once_across_a_resume(tmp_path, monkeypatch):
    run_dir, tb = tmp_path / "run", tmp_path / "tb"
    args = ["--config", TINY, f"run.dir={run_dir}", f"run.tensorboard_dir={tb}", *SHORT, "checkpoint.interval=3",
            "train.eval_interval=3", "train.eval_iters=1", "run.monitor_interval=2"]
    with monkeypatch.context() as crash:
        crash_after(crash, 5)  # steps 4 and 5 are logged, then lost: the resume starts after step 3
        with pytest.raises(RuntimeError, match="node lost"):
            train_main(args)
    assert train_main(args) == 0
    written = read_metrics(run_dir)
    assert [r["step"] for r in written] == [1, 2, 3, 4, 5, 4, 5, 6]
    final = {r["step"]: r for r in written}  # the resumed run's records of steps 4 and 5
    events = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {name for r in written for name in scalars(r)}
    assert {"loss", "eval_loss", "attention_entropy/1", "head_grad_variance_ratio/0"} <= expected == tags
    for name in tags:
        points = events.Scalars(name)
        steps = [p.step for p in points]
        assert steps == sorted(set(steps)), (name, steps)  # each step once
        assert steps == [s for s in sorted(final) if name in scalars(final[s])], name
        for p in points:
            assert p.value == pytest.approx(scalars(final[p.step])[name], rel=1e-6, abs=1e-6), (name, p.step)


def wandb_history(run_file) -> list[dict]:
    """The history rows ({key: value}) of a W&B offline run file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2
    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, pending, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_writes_every_key_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    args = ["--config", TINY, f"run.dir={run_dir}", *SHORT, "checkpoint.interval=3", "run.wandb_project=trilith-test",
            "run.wandb_mode=offline", "run.wandb_tags=[tiny, test]"]
    with monkeypatch.context() as crash:
        crash_after(crash, 4)
        with pytest.raises(RuntimeError, match="node lost"):
            train_main(args)
    time.sleep(1.0)  # wandb names an offline sitting's folder by its start second: two in one second share one
    assert train_main(args) == 0
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2 and len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # one id, two sittings
    rows = [row for r in runs for row in wandb_history(r / f"run-{run_id}.wandb")]
    assert [row["_step"] for row in rows] == [1, 2, 3, 4, 4, 5, 6]
    for row, record in zip(rows, read_metrics(run_dir)):
        assert {k: v for k, v in row.items() if not k.startswith("_")} == pytest.approx(scalars(record))


def test_a_missing_package_is_one_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = load_config(TINY, ["run.wandb_project=p", f"run.tensorboard_dir={tmp_path / 'tb'}"])
    warnings = []
    trackers = Trackers(cfg, tmp_path, 0, True, warnings.append)
    assert [t.name for t in trackers.active] == ["TensorBoard"]
    assert len(warnings) == 1 and "wandb package is not installed" in warnings[0] and "run.wandb_project" in warnings[0]
    trackers.close()


def test_a_tracker_failing_mid_run_is_one_warning_and_the_run_finishes(tmp_path, monkeypatch, caplog):
    calls = []

    def failing(self, step, values):
        calls.append(step)
        if step >= 3:
            raise OSError("disk full")
    monkeypatch.setattr(engine.observe.trackers.TensorBoardTracker, "log", failing)
    assert train_main(["--config", TINY, f"run.dir={tmp_path / 'run'}", f"run.tensorboard_dir={tmp_path / 'tb'}",
                       *SHORT]) == 0
    assert calls == [1, 2, 3]  # dropped after the failure
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    log = (tmp_path / "run" / "logs" / "train.log").read_text()
    assert log.count("TensorBoard failed") == 1 and "OSError: disk full" in log
