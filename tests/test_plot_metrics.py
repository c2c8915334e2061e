"""tools/plot_metrics.py: the summary table (with the largest loss difference between runs), the figure, and
clear errors for bad input."""
import json
from pathlib import Path

from tests.helpers import run_tool


def write_run(directory: Path, losses, evals=None, extra=None) -> Path:
    directory.mkdir(parents=True)
    lines = []
    for step, loss in enumerate(losses, 1):
        record = {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0 * step}
        if evals and step in evals:
            record["eval_loss"] = evals[step]
        if extra and step in extra:
            record.update(extra[step])
        lines.append(json.dumps(record))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def tool(*args):
    return run_tool("tools/plot_metrics.py", *args, timeout=120)


def test_table_compares_runs_and_the_figure_is_written(tmp_path):
    single = write_run(tmp_path / "single", [5.0, 4.0, 3.0, 2.5], evals={2: 4.5, 4: 3.5},
                       extra={2: {"attention_entropy": [2.0, 3.0]}, 4: {"attention_entropy": [1.5, 2.9]}})
    layered = write_run(tmp_path / "3d", [5.0, 4.00002, 3.0, 2.5001])
    done = tool(single, layered, "--output", tmp_path / "fig.png", "--smooth", "0.5")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[1].startswith("| single | 4 | 2.5000 | 3.5000 | 2,500 | -")
    assert rows[2].startswith("| 3d | 4 | 2.5001 | - |") and "1.00e-04 over 4 steps" in rows[2]
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resumed_runs_keep_the_last_record_of_a_step_and_missing_keys_are_named(tmp_path):
    run = write_run(tmp_path / "r", [5.0, 4.0, 3.0])
    with open(run / "metrics.jsonl", "a") as f:  # a resume that redid step 3
        f.write(json.dumps({"step": 3, "loss": 2.0, "tokens_per_s": 10.0}) + "\n")
    done = tool(run, "--keys", "loss", "head_grad_variance_ratio")
    assert done.returncode == 0, done.stderr
    assert "| r | 3 | 2.0000 |" in done.stdout
    assert "not in the metrics (skipped): head_grad_variance_ratio" in done.stdout
    assert (run / "curves.png").exists()


def test_bad_input_is_named(tmp_path):
    run = write_run(tmp_path / "bad", [5.0, 4.0])
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    done = tool(run, "--no-plot")
    assert done.returncode == 1 and f"{run / 'metrics.jsonl'}:3 is not a JSON record" in done.stderr
    missing = tool(tmp_path / "nowhere")
    assert missing.returncode == 1 and "does not exist; give a run directory" in missing.stderr


def test_per_dataset_readings_are_one_series_each():
    from tools.plot_metrics import series
    records = [{"step": 2, "eval_loss_by_dataset": {"web": 4.0, "code": 5.0}}, {"step": 3, "loss": 1.0},
               {"step": 4, "eval_loss_by_dataset": {"web": 3.5, "code": 4.5}}]
    assert series(records, "eval_loss_by_dataset", "step") == {"web": ([2, 4], [4.0, 3.5]),
                                                                "code": ([2, 4], [5.0, 4.5])}
