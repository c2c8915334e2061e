"""Real Hugging Face families in and out: configs with every field these models ship (sizes scaled down), in the
hub's transformers-4 layout (top-level rope_theta/rope_scaling) and in a transformers-5 `save_pretrained`
(rope_parameters). Each imports at TP2 x PP2 with transformers' logits, trains a first step at TP2 x PP2 with
transformers' loss, and exports back to identical tensors and config."""
import copy
import json
import math
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from engine.checkpoint.hf_config import IRRELEVANT, REQUIRED
from engine.checkpoint.manifest import CheckpointReader
from engine.config.schema import ModelConfig, load_config
from engine.mock_data import MockBatchLoader
from engine.model import CausalLM
from engine.train import Trainer
from parallel.distributed import DistEnv
from tests.distributed import WorkerPool
from tests.test_export_tokens import transformers4_python
from tests.hf_family_configs import (LLAMA_1_7B, LLAMA_2_LINEAR, LLAMA_3_2_1B, MISTRAL_7B, MISTRAL_NEMO,
                                     QWEN2_5_0_5B, QWEN2_5_YARN, SMOLLM2_135M, TINYLLAMA_1_1B)
from tools.ckpt_convert import main as convert

TINY = "launch/configs/tiny.yaml"
torch.set_num_threads(1)

FAMILIES = {"llama1": (LlamaConfig, LLAMA_1_7B), "llama3.2": (LlamaConfig, LLAMA_3_2_1B), "smollm2": (LlamaConfig, SMOLLM2_135M),
            "tinyllama": (LlamaConfig, TINYLLAMA_1_1B), "llama2_linear": (LlamaConfig, LLAMA_2_LINEAR),
            "mistral": (MistralConfig, MISTRAL_7B), "mistral_nemo": (MistralConfig, MISTRAL_NEMO),
            "qwen2.5": (Qwen2Config, QWEN2_5_0_5B), "qwen2.5_yarn": (Qwen2Config, QWEN2_5_YARN)}
LAYOUTS = ("hub_v4", "save_pretrained_v5")
SEQ, MICRO, GLOBAL = 32, 2, 4


@pytest.fixture(scope="module")
def pool():
    pool = WorkerPool(4)
    yield pool
    pool.close()


def make_hf_directory(path, family: str, layout: str):
    """A model with random weights saved as `layout`; returns the reference model. Weights are drawn wider
    than transformers' initialisation and biases nonzero, so that logits are far from uniform and a wrong
    import shows in the loss too."""
    cls, shipped = FAMILIES[family]
    config = cls(**copy.deepcopy(shipped))  # transformers writes into the dicts it is given
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif p.dim() == 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    if layout == "hub_v4":
        (path / "config.json").write_text(json.dumps(shipped, indent=2))
    else:
        assert "rope_parameters" in json.loads((path / "config.json").read_text())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_tensors(path) -> dict:
    return load_file(path / "model.safetensors")


def comparable(config: dict) -> dict:
    """A loaded config's fields that define the model: IRRELEVANT ones dropped, REQUIRED ones at their value,
    the legacy "type" alias and the top-level copies of rope_parameters left out."""
    out = {k: v for k, v in config.items() if k not in IRRELEVANT | set(REQUIRED) | {"rope_scaling", "rope_theta"}}
    out["rope_parameters"] = {k: v for k, v in config["rope_parameters"].items() if k != "type"}
    if config.get("model_type") == "qwen2" and not config.get("use_sliding_window"):
        out.pop("max_window_layers")  # only read with use_sliding_window
    return out


def v4_scaling(shipped: dict) -> dict | None:
    """The top-level rope_scaling a transformers-4 reader needs for the shipped config (rope_type spelled out,
    the original context that transformers fills in for llama3 and yarn written)."""
    scaling = shipped.get("rope_scaling")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling["type"]
    out = {"rope_type": kind, **{k: v for k, v in scaling.items() if k not in ("type", "rope_type")}}
    if kind in ("llama3", "yarn"):
        out.setdefault("original_max_position_embeddings", shipped["max_position_embeddings"])
    return out


def first_step_loss(rank, world, load: str, run_dir: str, model_overrides: list):
    cfg = load_config(TINY, [f"run.dir={run_dir}", f"checkpoint.load={load}", "parallel.tensor=2",
                             "parallel.pipeline=2", f"model.seq_length={SEQ}", f"train.micro_batch_size={MICRO}",
                             f"train.global_batch_size={GLOBAL}", *model_overrides])
    t = Trainer(cfg, DistEnv(rank, world, 0, torch.device("cpu"), "gloo"))
    assert t.step == 0 and t.optimizer.adam_step == 0
    return t.train_step()["loss"], t.cfg.model


def transformers_loss(hf, vocab_size: int, seed: int) -> float:
    batch = torch.cat(MockBatchLoader(vocab_size, SEQ, MICRO, GLOBAL, 0, 1, seed=seed).next_global_batch())
    with torch.no_grad():
        logits = hf(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), batch[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_imports_trains_and_exports_exactly(family, layout, tmp_path, pool):
    src = tmp_path / "hf"
    hf = make_hf_directory(src, family, layout)
    shipped = FAMILIES[family][1]

    # import at TP2 x PP2: logits equal transformers'
    assert convert(["--load-dir", str(src), "--save-dir", str(tmp_path / "tri"), "--from", "hf", "--tensor", "2",
                    "--pipeline", "2", "--seq-length", str(SEQ)]) == 0
    reader = CheckpointReader(tmp_path / "tri" / "step_00000000")
    assert reader.metadata["layout"]["tensor"] == 2 and reader.metadata["layout"]["pipeline"] == 2
    model = ModelConfig(**reader.metadata["config"]["model"])
    ours = CausalLM(model)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(reader.global_tensor(name))
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(input_ids=tokens).logits, rtol=0, atol=1e-4, check_dtype=False)

    # one training step at TP2 x PP2 from the converted checkpoint (hub layout: from the HF directory itself,
    # converted on the fly, model.* taken from its config.json)
    if layout == "hub_v4":
        load, overrides = src, []
    else:  # a Trilith checkpoint: the run states its model
        load = tmp_path / "tri"
        overrides = [f"model.{k}={json.dumps(v)}" for k, v in reader.metadata["config"]["model"].items()]
    (loss, trained_model), *_ = pool.run(first_step_loss, str(load), str(tmp_path / "run"), overrides)
    assert trained_model == model
    assert math.isclose(loss, transformers_loss(hf, 256, seed=1234), rel_tol=0, abs_tol=1e-5)

    # export back: identical tensors; identical config for transformers 5, and the fields transformers 4 reads
    assert convert(["--load-dir", str(tmp_path / "tri"), "--save-dir", str(tmp_path / "back"), "--to", "hf"]) == 0
    source, back = hf_tensors(src), hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(source) and all(torch.equal(back[k], source[k]) for k in source)
    assert comparable(AutoConfig.from_pretrained(tmp_path / "back").to_dict()) == \
        comparable(AutoConfig.from_pretrained(src).to_dict())
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert float(written["rope_theta"]) == float(shipped.get("rope_theta", 10000.0))
    assert written["rope_scaling"] == v4_scaling(shipped)
    assert written["model_type"] == shipped["model_type"] and written["architectures"] == shipped["architectures"]


READ_WITH_TRANSFORMERS4 = """
import json, sys
from transformers import AutoConfig
print(json.dumps({name: AutoConfig.from_pretrained(path).to_dict() for name, path in json.loads(sys.argv[1]).items()}))
"""


def test_transformers4_reads_each_export_as_the_shipped_config(tmp_path):
    """transformers 4.57 (a side environment, as llama.cpp's converter pins it) reads the exported config.json
    (its top-level rope_theta/rope_scaling; rope_parameters is unknown to it) exactly as the shipped one."""
    python = transformers4_python()
    dirs = {}
    for family in sorted(FAMILIES):
        make_hf_directory(tmp_path / family, family, "hub_v4")
        assert convert(["--load-dir", str(tmp_path / family), "--save-dir", str(tmp_path / f"{family}-tri"),
                        "--from", "hf"]) == 0
        assert convert(["--load-dir", str(tmp_path / f"{family}-tri"), "--save-dir", str(tmp_path / f"{family}-out"),
                        "--to", "hf"]) == 0
        dirs[family], dirs[f"{family}-out"] = str(tmp_path / family), str(tmp_path / f"{family}-out")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(python), "-c", READ_WITH_TRANSFORMERS4, json.dumps(dirs)], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    read = json.loads(result.stdout.strip().splitlines()[-1])

    def v4_fields(config: dict) -> dict:
        out = {k: v for k, v in config.items() if k not in IRRELEVANT | set(REQUIRED) | {"rope_parameters"}}
        if out.get("rope_scaling"):
            out["rope_scaling"] = {k: v for k, v in out["rope_scaling"].items() if k != "type"}
        else:  # absent and null read alike
            out.pop("rope_scaling", None)
        # transformers 4's attention takes a null head_dim as hidden_size / heads
        out["head_dim"] = out.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        if config["model_type"] == "qwen2" and not config.get("use_sliding_window"):
            out.pop("max_window_layers")  # only read with use_sliding_window
        return out
    for family in FAMILIES:
        assert v4_fields(read[f"{family}-out"]) == v4_fields(read[family]), family
