"""What many test files need: the checkout's root, the tiny recipe, a Trainer on it, the launcher's metrics,
the tools run as users run them, JSONL files. Multi-process workers live beside it in tests/distributed.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = "launch/configs/tiny.yaml"  # relative to ROOT, where the tests and the launcher run
# The launcher in a plain shell environment: the venv's Python named explicitly, one thread per rank, and the
# collectives under NCCL's semantics (parallel/nccl_semantics.py), as in the worker pools.
LAUNCH_ENV = {"TRILITH_PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
              "TRILITH_COMM_SEMANTICS": "nccl"}


def tiny_trainer(*overrides: str, rank: int = 0, world: int = 1, validated: bool = False, config: str = TINY):
    """A Trainer on `config` (the tiny recipe) with `overrides`, as rank `rank` of `world` CPU ranks (gloo; with
    `world` > 1 the process group must already exist). `validated`: the configuration is first checked for
    `world` ranks, as a launched run checks it; without it, the Trainer meets the configuration as given."""
    from engine.config.schema import load_config, validate
    from engine.train import Trainer
    from parallel.distributed import DistEnv
    cfg = load_config(config, list(overrides))
    if validated:
        validate(cfg, world)
    return Trainer(cfg, DistEnv(rank, world))


def read_metrics(run_dir) -> list[dict]:
    """The records of `run_dir`/metrics.jsonl, in the order they were written."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def launch_command(run_dir, *overrides: str, nproc: int = 1, config: str = TINY) -> list[str]:
    return ["bash", "launch/run_pretrain.sh", "--nproc", str(nproc), "--config", config, f"run.dir={run_dir}",
            *overrides]


def launch_process(run_dir, *overrides: str, nproc: int = 1, config: str = TINY, timeout: float = 600,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    """launch/run_pretrain.sh with `nproc` local ranks, run.dir=`run_dir` and `overrides`, in LAUNCH_ENV plus
    `env`; output captured."""
    return subprocess.run(launch_command(run_dir, *overrides, nproc=nproc, config=config), cwd=ROOT,
                          capture_output=True, text=True, env={**LAUNCH_ENV, **(env or {})}, timeout=timeout)


def launch(run_dir, *overrides: str, nproc: int = 1, config: str = TINY, timeout: float = 600,
           env: dict | None = None) -> list[dict]:
    """`launch_process` that must exit 0 (else the test fails with the output's tail); returns the run's
    metrics.jsonl records."""
    done = launch_process(run_dir, *overrides, nproc=nproc, config=config, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return read_metrics(run_dir)


def run_tool(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python <args>` from the checkout's root (e.g. "tools/plot_metrics.py", ...), output captured as text."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def tool(*args, timeout: float = 300) -> str:
    """`run_tool` that must succeed; returns its standard output."""
    done = run_tool(*args, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def write_jsonl(path, records, ensure_ascii: bool = True) -> str:
    """One line per record: a string as it is (to write damaged lines), anything else as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=ensure_ascii)) + "\n")
    return str(path)


def single_losses(run_dir, *overrides: str, config: str = TINY) -> list[float]:
    """The losses of every step of a single-process run of `config` with `overrides`, trained here (the curve a
    launched run is held against, without a process that imports torch again)."""
    trainer = tiny_trainer(f"run.dir={run_dir}", *overrides, config=config)
    return [trainer.train_step()["loss"] for _ in range(trainer.cfg.train.steps)]
