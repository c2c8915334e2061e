"""Continued pretraining from a Hugging Face model directory: `checkpoint.load=<dir with config.json>`.

The run's `model.*` architecture comes from the directory's config.json (`fill_model_from_hf`), and each rank
reads only the tensors its layout holds, sliced for its TP rank (`HFWeights`), at whatever layout the run
uses; the optimizer state starts fresh. `tools/ckpt_convert.py --from hf` does the same conversion offline.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.hf_config import model_from_hf
from engine.checkpoint.manifest import MANIFEST, global_shape, local_from_global
from engine.config.schema import Config, ConfigError, ModelConfig
from engine.model import CausalLM

log = logging.getLogger("trilith")

# model.* keys a Hugging Face config decides; the others (seq_length, dropout, backends, loss chunking)
# stay the run's own.
ARCHITECTURE = ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                "rope_theta", "rope_scaling", "kv_channels", "attention_bias", "max_position_embeddings",
                "hf_model_type", "position_embedding", "norm_eps", "tie_embeddings", "init_std", "attention_window")


def is_hf_directory(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / MANIFEST).is_file()


def model_from_directory(path: Path, seq_length: int = 0) -> ModelConfig:
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path / 'config.json'} is not readable JSON ({exc})") from exc
    try:
        return model_from_hf(hf, seq_length)
    except ConfigError as exc:
        raise ConfigError(f"{path / 'config.json'}: {exc}") from exc
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{path / 'config.json'} lacks or mistypes the field {exc}") from exc


def fill_model_from_hf(cfg: Config) -> None:
    """With checkpoint.load naming a Hugging Face directory, take model.*'s architecture from its config.json
    (in place; the fields that differed are logged). Anything else: no change."""
    if not cfg.checkpoint.load or not is_hf_directory(Path(cfg.checkpoint.load)):
        return
    source = Path(cfg.checkpoint.load)
    found = model_from_directory(source, cfg.model.seq_length)
    replaced = [f"{k} (was {getattr(cfg.model, k)!r})" for k in ARCHITECTURE
                if getattr(found, k) != getattr(cfg.model, k)]
    cfg.model = dataclasses.replace(cfg.model, **{k: getattr(found, k) for k in ARCHITECTURE})
    log.info(f"model.* from {source / 'config.json'}: " + ", ".join(f"{k}={getattr(found, k)!r}" for k in ARCHITECTURE)
             + (f"; replaced the run's {', '.join(replaced)}" if replaced else ""))


class HFWeights:
    """The tensors of a Hugging Face directory (model.safetensors or an index of shards), read lazily and
    checked against the model: every parameter present with its shape, no tensor left over."""

    def __init__(self, path: Path, model: ModelConfig):
        from safetensors import safe_open
        self.path = path
        index = path / "model.safetensors.index.json"
        try:
            if index.is_file():
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            elif (path / "model.safetensors").is_file():
                files = ["model.safetensors"]
            else:
                raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json; convert "
                                      f"other formats with tools/ckpt_convert.py --from hf first")
            if any(Path(f).is_absolute() or ".." in Path(f).parts for f in files):
                raise CheckpointError(f"{index} names files outside {path}")
            self.files = {f: safe_open(str(path / f), framework="pt") for f in files}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: its weights are not readable ({exc})") from exc
        self.where = {k: f for f, handle in self.files.items() for k in handle.keys()
                      if not k.endswith("rotary_emb.inv_freq")}  # a buffer some exports carry; recomputed
        with torch.device("meta"):
            expected = {n: global_shape(p.full_shape, p.valid_rows) for n, p in CausalLM(model).named_parameters()}
        if model.tie_embeddings:
            self.where.pop("lm_head.weight", None)  # the tied copy some exports write
        shapes = {n: list(self.files[f].get_slice(n).get_shape()) for n, f in self.where.items()}
        missing, unknown = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
        wrong = [f"{n}: {shapes[n]} vs {s}" for n, s in expected.items() if n in shapes and shapes[n] != s]
        if missing or unknown or wrong:
            raise CheckpointError(f"{path} does not match its config.json: missing {missing[:5]}, unexpected "
                                  f"{unknown[:5]}, shape mismatches (file vs config) {wrong[:5]}")
        self._cached: tuple | None = None

    def read_local(self, name: str, full_shape, tp_dim, tp_size: int, tp_rank: int, start: int, end: int
                   ) -> torch.Tensor:
        """Elements [start, end) of this TP rank's flattened slice of `name`, in fp32."""
        if self._cached is None or self._cached[0] != name:
            self._cached = (name, self.files[self.where[name]].get_tensor(name).float())
        local = local_from_global(self._cached[1], full_shape, tp_dim, tp_size, tp_rank)
        return local.reshape(-1)[start:end].clone()

    def close(self) -> None:
        self._cached, self.files = None, {}
