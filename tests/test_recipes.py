"""The recipes in launch/configs: each GPU recipe is valid at the world size it is written for and asks for
CUDA; every recipe's pre-flight configuration is valid on 8 ranks as documented (launch/run_pretrain.sh
--preflight --nproc 8), settings sized for a larger world scaled by the pre-flight; and the 7B
recipe (TP 2 + SP × PP 2 × ZeRO-1 DP with hierarchical reduction, two-phase schedule, the mid-run recompute
switch, document masking, weighted datasets, per-dataset validation) passes its pre-flight on 8 CPU ranks
with the model shrunk by the pre-flight itself, and on the CPU: train.device=cpu, the vocabulary cut to 4096
and compilation off (minutes per rank on a CPU); its 32k continuation (TP 2 + SP × CP 4 × PP 2) passes its
pre-flight at CP 2, the most 8 ranks hold."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.indexed import IndexedDatasetBuilder
from engine.config.schema import data_parallel_size, load_config, validate
from engine.preflight import preflight_config
from tests.helpers import ROOT

BIN = Path(sys.executable).parent
# PYTHONPATH as launch/run_pretrain.sh sets it: launch/check.py imports this checkout, not an installed one
ENV = {"TRILITH_PYTHON": sys.executable, "PATH": f"{BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(ROOT)}


RECIPES = sorted(p.name for p in (ROOT / "launch" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name, world, dp, accumulation", [("llama3_1b", 8, 8, 16), ("llama_7b_64gpu", 64, 16, 32),
                                                           ("llama_7b_64gpu_long", 64, 4, 16)])
def test_recipe_is_valid_at_its_world_size(name, world, dp, accumulation):
    cfg = load_config(ROOT / "launch" / "configs" / f"{name}.yaml", [])
    validate(cfg, world)
    assert cfg.train.device == "cuda"  # no silent fallback to the CPU on a cluster
    assert data_parallel_size(cfg, world) == dp
    assert cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp) == accumulation
    assert cfg.train.global_batch_size * cfg.model.seq_length == 512 * 4096  # 2M tokens per step


def test_long_context_recipe_continues_the_7b_model():
    """The same architecture, so the 7B run's weights load; a longer sequence, a higher RoPE base, and CP."""
    base, long = (load_config(ROOT / "launch" / "configs" / f"{n}.yaml", []) for n in ("llama_7b_64gpu", "llama_7b_64gpu_long"))
    same = ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")
    assert all(getattr(base.model, k) == getattr(long.model, k) for k in same)
    assert long.model.seq_length == 8 * base.model.seq_length and long.model.rope_theta > base.model.rope_theta
    assert long.parallel.context == 4


PREFLIGHT_RANKS = {"llama_70b_1024gpu.yaml": 64}  # TP 8 × PP 8 split the model: 8 nodes, the fewest it fits


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipes_preflight_passes_the_launch_check_on_eight_ranks(name):
    """What `launch/run_pretrain.sh --preflight --nproc 8 --config RECIPE` checks before any rank starts (the
    data paths are only opened by the ranks); a recipe whose model is split over more ranks, on that many. A GPU
    recipe runs here with train.device=cpu, the documented way to train on the CPU on purpose."""
    recipe = f"launch/configs/{name}"
    device = ["train.device=cpu"] if load_config(ROOT / recipe, []).train.device == "cuda" else []
    world = str(PREFLIGHT_RANKS.get(name, 8))
    done = subprocess.run([sys.executable, "launch/check.py", "--world-size", world, "--preflight", "--config", recipe,
                           *device], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_preflight_scales_settings_sized_for_a_larger_world():
    seven_b = load_config(ROOT / "launch" / "configs" / "llama_7b_64gpu.yaml", [])
    real, small, notes = preflight_config(seven_b, 8, 40)
    assert real.parallel.hierarchical_node_size == small.parallel.hierarchical_node_size == 2
    assert notes == ["parallel.hierarchical_node_size=4 → 2: the pre-flight's data-parallel size is 2"]
    assert seven_b.parallel.hierarchical_node_size == 4  # the real run's configuration is left as it was
    hsdp = load_config(ROOT / "launch" / "configs" / "tiny.yaml", ["parallel.zero_stage=1", "parallel.hsdp_group_size=3",
                                                                   "train.global_batch_size=16", "train.batch_size_ramp=[4,4,64]"])
    real, small, notes = preflight_config(hsdp, 2, 10)
    assert small.parallel.hsdp_group_size == 0 and not small.train.batch_size_ramp
    assert notes == ["parallel.hsdp_group_size=3 → 0 (off): the pre-flight's data-parallel size is 2",
                     "train.batch_size_ramp=[4, 4, 64] → off: it ramps to the real run's global batch of 16, the "
                     "pre-flight's is 8"]
    long = load_config(ROOT / "launch" / "configs" / "llama_7b_64gpu_long.yaml", [])
    real, small, notes = preflight_config(long, 8, 40)  # TP 2 × PP 2 leave 2 of 8 ranks for CP 4
    assert notes == ["parallel.context=4 → 2: the pre-flight's 8 ranks hold TP 2 × PP 2 × CP 2 at most"]
    assert real.parallel.context == small.parallel.context == 2 and long.parallel.context == 4
    # at 16 ranks CP 4 fits: alltoall needs the shrunk model's query heads per TP rank to divide by 4
    real, small, notes = preflight_config(long, 16, 40)
    assert notes == [] and small.parallel.context == 4 and small.model.num_attention_heads // 2 % 4 == 0
    assert small.model.seq_length % (4 * 2) == 0  # 2c chunks, each CP rank's tokens over TP (sequence parallel)
    fits = load_config(ROOT / "launch" / "configs" / "tiny.yaml", ["parallel.zero_stage=1", "parallel.hsdp_group_size=2"])
    assert preflight_config(fits, 4, 10)[2] == [] and preflight_config(fits, 4, 10)[1].parallel.hsdp_group_size == 2


def write_documents(prefix: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix), np.int32)
    for _ in range(3000):  # the recipe keeps 0.2% for validation: a few documents
        start, stride, n = rng.integers(1, 4096), rng.integers(1, 8), rng.integers(20, 120)
        tokens = (start + stride * np.arange(n)) % 4095 + 1  # learnable: the loss must fall within the pre-flight
        builder.add_document(np.append(tokens, 0))  # 0 ends a document
    builder.finalize()


def test_7b_recipe_preflight_passes_on_eight_cpu_ranks(tmp_path):
    paths = []
    for i, (weight, domain) in enumerate((("0.55", "web"), ("0.25", "papers"), ("0.12", "code"), ("0.08", "domain"))):
        write_documents(tmp_path / domain, seed=i)
        paths += [weight, str(tmp_path / domain)]
    done = subprocess.run(
        ["bash", "launch/run_pretrain.sh", "--preflight", "--steps", "40", "--nproc", "8", "--config",
         "launch/configs/llama_7b_64gpu.yaml", f"data.paths=[{','.join(paths)}]", "data.tokenizer=",
         "data.eod_token_id=0", "train.device=cpu", "model.vocab_size=4096", "train.compile=false",
         f"run.dir={tmp_path / 'run'}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "PRE-FLIGHT PASSED" in out, out[-4000:]
    assert "8 ranks, TP 2 × PP 2" in out and "bf16, recompute switch at step 20" in out
    assert "pre-flight: parallel.hierarchical_node_size=4 → 2: the pre-flight's data-parallel size is 2" in out
    assert "PASS  memory steady" in out and "PASS  loss falls" in out


def test_long_context_recipe_preflight_passes_on_eight_cpu_ranks(tmp_path):
    """The 32k recipe's pre-flight trains at TP 2 + SP × CP 2 (alltoall) × PP 2 with document masking, on
    synthetic tokens (its data are real files) and without the base run's weights."""
    done = subprocess.run(
        ["bash", "launch/run_pretrain.sh", "--preflight", "--steps", "40", "--nproc", "8", "--config",
         "launch/configs/llama_7b_64gpu_long.yaml", "data.paths=[]", "data.mock=true", "data.tokenizer=",
         "data.eod_token_id=5", "train.eval_per_dataset=false", "checkpoint.load=", "train.device=cpu",
         "model.vocab_size=4096", "train.compile=false", f"run.dir={tmp_path / 'run'}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "PRE-FLIGHT PASSED" in out, out[-4000:]
    assert "pre-flight: parallel.context=4 → 2" in out and "8 ranks, TP 2 × CP 2 × PP 2" in out
