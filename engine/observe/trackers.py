"""TensorBoard and Weights & Biases: every record written to metrics.jsonl, sent from rank 0.

    run.tensorboard_dir: runs/x/tensorboard     # event files (torch.utils.tensorboard)
    run.wandb_project: my-project               # run.wandb_mode: online | offline | disabled

The step is the x-axis; nested values become `group/name` scalars (`eval_loss_by_dataset/wiki`,
`attention_entropy/3`, `gpu/0/temperature_c`); text and missing values are left to metrics.jsonl. Both
packages are optional (`pip install -e '.[trackers]'`): a missing one, or a tracker that fails mid-run, costs
one warning and that tracker, never the run. A resumed run appends to the same TensorBoard directory, whose
events after the resumed step are purged (so a step redone after a crash is not drawn twice), and continues
the same W&B run, whose id is kept in `run.dir/wandb_run_id`.
"""
from __future__ import annotations

import uuid
from pathlib import Path

WANDB_ID_FILE = "wandb_run_id"


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """{`group/name`: number} of a metrics record's numbers at any depth (lists indexed by position); the step
    itself, text and None are left out."""
    out: dict[str, float] = {}
    items = record.items() if isinstance(record, dict) else enumerate(record)
    for key, value in items:
        name = f"{prefix}{key}"
        if not prefix and key == "step":
            continue
        if isinstance(value, (dict, list, tuple)):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, (bool, int, float)):
            out[name] = float(value)
    return out


class TensorBoardTracker:
    name = "TensorBoard"

    def __init__(self, log_dir: str, resumed_step: int):
        from torch.utils.tensorboard import SummaryWriter
        # purge_step: events at or after it, left by a run that went further than its last checkpoint, are
        # hidden by TensorBoard once this run writes its first event
        self.writer = SummaryWriter(log_dir, purge_step=resumed_step + 1 if resumed_step else None)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    name = "W&B"

    def __init__(self, cfg, run_dir: Path):
        import wandb
        from engine.config.schema import to_dict
        r = cfg.run
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=r.wandb_project, mode=r.wandb_mode, name=r.wandb_name or run_dir.name,
                              tags=list(r.wandb_tags), config=to_dict(cfg), dir=str(run_dir), id=run_id,
                              resume="allow", settings=wandb.Settings(silent=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        import wandb
        self.run.finish()
        # W&B flushes and uploads in a service process and waits for it only at interpreter exit, which a rank
        # skips (parallel.distributed.exit_now): wait here, or the last records can be lost.
        wandb.teardown()


class Trackers:
    """The run's trackers; rank 0 builds them (elsewhere this holds none). `warn(text)` is told once per
    tracker that cannot start or stops working."""

    def __init__(self, cfg, run_dir: Path, resumed_step: int, enabled: bool, warn):
        self.warn, self.active = warn, []
        if not enabled:
            return
        r = cfg.run
        if r.tensorboard_dir:
            self._start(lambda: TensorBoardTracker(r.tensorboard_dir, resumed_step), "TensorBoard",
                        "tensorboard", "run.tensorboard_dir")
        if r.wandb_project and r.wandb_mode != "disabled":
            self._start(lambda: WandbTracker(cfg, Path(run_dir)), "W&B", "wandb", "run.wandb_project")

    def _start(self, make, name: str, package: str, key: str) -> None:
        try:
            self.active.append(make())
        except ImportError:
            self.warn(f"WARNING: {key} is set but the {package} package is not installed (pip install -e "
                      f"'.[trackers]'); training continues without {name}")
        except Exception as exc:  # a tracker is worth a warning, never the run
            self.warn(f"WARNING: {name} could not start ({type(exc).__name__}: {exc}); training continues without it")

    def log(self, record: dict) -> None:
        if not self.active:
            return
        values = scalars(record)
        for tracker in list(self.active):
            try:
                tracker.log(record["step"], values)
            except Exception as exc:
                self._drop(tracker, exc)

    def _drop(self, tracker, exc: Exception) -> None:
        self.active.remove(tracker)
        self.warn(f"WARNING: {tracker.name} failed ({type(exc).__name__}: {exc}); training continues without it")
        try:
            tracker.close()
        except Exception:  # already broken: the warning above said so
            pass

    def close(self) -> None:
        for tracker in list(self.active):
            try:
                tracker.close()
            except Exception as exc:
                self.active.remove(tracker)
                self.warn(f"WARNING: {tracker.name} failed to close ({type(exc).__name__}: {exc})")
        self.active = []
