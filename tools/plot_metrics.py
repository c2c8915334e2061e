"""Plot and compare training runs from their metrics.jsonl: loss, validation loss, learning rate, gradient
norm, throughput, attention entropy, per-head gradient variance.

    python tools/plot_metrics.py demo_out/run                               # curves.png beside it
    python tools/plot_metrics.py runs/single runs/3d --output compare.png  # overlaid, with |Δ loss|
    python tools/plot_metrics.py runs/a --keys loss eval_loss grad_norm --x tokens --smooth 0.9

Each argument is a run directory (or a metrics.jsonl). One panel per key, every run overlaid; records
without the key are skipped (evaluation and monitor readings come every N steps). Per-layer lists
(`attention_entropy`, `head_grad_variance_ratio`) become one line per layer, and per-dataset readings
(`eval_loss_by_dataset`) one line per dataset. A summary table is printed:
steps, final loss, best validation loss, median tokens/s, and, for every run after the first, the largest
|loss difference| from the first at the steps both logged (layouts that must agree, e.g. TP×PP×DP vs 1
process). Needs matplotlib (`pip install -e .[plot]`) for the figure; `--no-plot` prints the table only.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

DEFAULT_KEYS = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "attention_entropy")
X_AXES = {"step": "step", "tokens": "consumed_tokens"}


def metrics_file(path: str) -> Path:
    p = Path(path)
    file = p / "metrics.jsonl" if p.is_dir() else p
    if not file.is_file():
        raise SystemExit(f"plot_metrics: {file} does not exist; give a run directory (run.dir) or a metrics.jsonl")
    return file


def read_records(file: Path) -> list[dict]:
    records = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise SystemExit(f"plot_metrics: {file}:{number} is not a JSON record ({exc.msg}); "
                             f"metrics.jsonl has one object per line") from None
    # A resumed run appends: the last record of a step wins (the steps redone after a crash).
    by_step = {r["step"]: r for r in records if "step" in r}
    return [by_step[s] for s in sorted(by_step)]


def smoothed(values: list[float], weight: float) -> list[float]:
    """Exponential moving average, bias-corrected so the curve starts at the first value."""
    out, average = [], 0.0
    for i, v in enumerate(values, 1):
        average = weight * average + (1 - weight) * v
        out.append(average / (1 - weight ** i) if weight else v)
    return out


def series(records: list[dict], key: str, x_key: str) -> dict[str, tuple[list, list]]:
    """{label: (xs, ys)}: one series for a scalar key, one per layer for a per-layer list, one per dataset
    for a per-dataset dict."""
    rows = [r for r in records if key in r and x_key in r]
    if not rows:
        return {}
    if isinstance(rows[0][key], list):
        layers = len(rows[0][key])
        return {f"layer {i}": ([r[x_key] for r in rows], [r[key][i] for r in rows]) for i in range(layers)}
    if isinstance(rows[0][key], dict):
        return {name: ([r[x_key] for r in rows], [float(r[key][name]) for r in rows]) for name in rows[0][key]}
    return {"": ([r[x_key] for r in rows], [float(r[key]) for r in rows])}


def summary(runs: dict[str, list[dict]]) -> list[str]:
    header = ["run", "steps", "final loss", "best eval loss", "median tokens/s", "max |Δ loss| vs first"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    first = None
    for name, records in runs.items():
        losses = {r["step"]: r["loss"] for r in records if "loss" in r}
        evals = [r["eval_loss"] for r in records if "eval_loss" in r]
        speed = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
        if first is None:
            first, delta = losses, "-"
        else:
            common = sorted(set(first) & set(losses))
            delta = f"{max(abs(first[s] - losses[s]) for s in common):.2e} over {len(common)} steps" \
                if common else "no common steps"
        cells = [name, str(max(losses, default=0)), f"{losses[max(losses)]:.4f}" if losses else "-",
                 f"{min(evals):.4f}" if evals else "-", f"{statistics.median(speed):,.0f}" if speed else "-", delta]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(runs: dict[str, list[dict]], keys: list[str], x: str, smooth: float, output: Path) -> list[str]:
    """Draw one panel per key that some run has; returns the keys no run logged."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed on a cluster login node
    import matplotlib.pyplot as plt

    present = [k for k in keys if any(series(r, k, X_AXES[x]) for r in runs.values())]
    if not present:
        raise SystemExit(f"plot_metrics: none of {', '.join(keys)} is in the metrics")
    cols = min(3, len(present))
    rows = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        for name, records in runs.items():
            for label, (xs, ys) in series(records, key, X_AXES[x]).items():
                ys = smoothed(ys, smooth) if smooth and key in ("loss", "grad_norm", "tokens_per_s") else ys
                ax.plot(xs, ys, label=" ".join(p for p in (name if len(runs) > 1 else "", label) if p),
                        marker="o" if len(xs) < 20 else None, markersize=3)
        ax.set_title(key)
        ax.set_xlabel(X_AXES[x])
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.set_visible(False)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return [k for k in keys if k not in present]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories (run.dir) or metrics.jsonl files")
    ap.add_argument("--output", help="figure file (default: curves.png in the first run's directory)")
    ap.add_argument("--keys", nargs="+", default=list(DEFAULT_KEYS), help="metrics to plot, one panel each")
    ap.add_argument("--x", choices=sorted(X_AXES), default="step", help="horizontal axis")
    ap.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1) for loss/grad_norm/speed")
    ap.add_argument("--no-plot", action="store_true", help="print the summary table only")
    args = ap.parse_args(argv)
    if not 0.0 <= args.smooth < 1.0:
        raise SystemExit(f"plot_metrics: --smooth {args.smooth} must be in [0, 1)")
    files = [metrics_file(r) for r in args.runs]
    runs = {}
    for file in files:
        name = file.parent.name if file.name == "metrics.jsonl" else file.stem
        while name in runs:  # two runs with the same directory name
            name += "'"
        runs[name] = read_records(file)
    print("\n".join(summary(runs)))
    if args.no_plot:
        return 0
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("plot_metrics: the figure needs matplotlib: pip install -e '.[plot]' "
                         "(or use --no-plot for the table)")
    output = Path(args.output) if args.output else files[0].parent / "curves.png"
    missing = plot(runs, args.keys, args.x, args.smooth, output)
    if missing:
        print(f"not in the metrics (skipped): {', '.join(missing)}")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
