"""The GPU recipes in launch/configs: each is valid at the world size it is written for, and a 7B field
report's recipe (TP 2 + SP × PP 2 × ZeRO-1 DP with hierarchical reduction, two-phase schedule, the mid-run recompute
switch, document masking, weighted datasets, per-dataset validation) passes its pre-flight on 8 CPU ranks
with the model shrunk by the pre-flight itself, the vocabulary cut to 4096 and compilation off."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.indexed import IndexedDatasetBuilder
from engine.config import data_parallel_size, load_config, validate
from tests.helpers import ROOT

BIN = Path(sys.executable).parent
ENV = {"TRILITH_PYTHON": sys.executable, "PATH": f"{BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("name, world, dp, accumulation", [("llama3_1b", 8, 8, 16), ("llama_7b_seed", 64, 16, 32)])
def test_recipe_is_valid_at_its_world_size(name, world, dp, accumulation):
    cfg = load_config(ROOT / "launch" / "configs" / f"{name}.yaml", [])
    validate(cfg, world)
    assert data_parallel_size(cfg, world) == dp
    assert cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp) == accumulation
    assert cfg.train.global_batch_size * cfg.model.seq_length == 512 * 4096  # the field report's 2M-token batch


def write_documents(prefix: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix), np.int32)
    for _ in range(3000):  # the recipe keeps 0.2% for validation: a few documents
        start, stride, n = rng.integers(1, 4096), rng.integers(1, 8), rng.integers(20, 120)
        tokens = (start + stride * np.arange(n)) % 4095 + 1  # learnable: the loss must fall within the pre-flight
        builder.add_document(np.append(tokens, 0))  # 0 ends a document
    builder.finalize()


def test_seed_recipe_preflight_passes_on_eight_cpu_ranks(tmp_path):
    paths = []
    for i, (weight, domain) in enumerate((("0.55", "web"), ("0.25", "papers"), ("0.12", "code"), ("0.08", "domain"))):
        write_documents(tmp_path / domain, seed=i)
        paths += [weight, str(tmp_path / domain)]
    done = subprocess.run(
        ["bash", "launch/run_pretrain.sh", "--preflight", "--steps", "40", "--nproc", "8", "--config",
         "launch/configs/llama_7b_seed.yaml", f"data.paths=[{','.join(paths)}]", "data.tokenizer=",
         "data.eod_token_id=0", "model.vocab_size=4096", "train.compile=false", "parallel.hierarchical_node_size=2",
         f"run.dir={tmp_path / 'run'}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "PRE-FLIGHT PASSED" in out, out[-4000:]
    assert "8 ranks, TP 2 × PP 2" in out and "bf16, recompute switch at step 20" in out
    assert "PASS  memory steady" in out and "PASS  loss falls" in out
