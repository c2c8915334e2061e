"""Model weights for evaluation and generation from any saved form: a Trilith checkpoint (any saved layout;
a full checkpoint or a light snapshot), a checkpoints directory (its `latest`), or a Hugging Face directory.

`ModelSource` knows the architecture and reads each parameter's slice for whatever layout the reading
process uses (`fill`), so tools/evaluate.py and tools/generate.py run on one process or at any layout.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.checkpoint.files import CheckpointError, read_latest
from engine.checkpoint.hf_weights import HFWeights, is_hf_directory, model_from_directory
from engine.checkpoint.manifest import MANIFEST, CheckpointReader, open_verified
from engine.config.schema import ModelConfig


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory itself, or the one a checkpoints directory's `latest` names."""
    if (path / MANIFEST).is_file() or is_hf_directory(path):
        return path
    latest = read_latest(path) if path.is_dir() else None
    if latest is None:
        raise CheckpointError(f"{path} is neither a Trilith checkpoint (with {MANIFEST}), a checkpoints directory "
                              f"with a 'latest' file, nor a Hugging Face directory (with config.json)")
    return latest


class ModelSource:
    def __init__(self, path: str | Path, verify: bool = True, seq_length: int = 0):
        self.path = resolve_checkpoint(Path(path))
        if is_hf_directory(self.path):
            self.model = model_from_directory(self.path, seq_length)
            self.metadata = None
            self._hf = HFWeights(self.path, self.model)
        else:
            self.reader = open_verified(self.path) if verify else CheckpointReader(self.path)
            self.metadata = self.reader.metadata
            self.model = ModelConfig(**self.metadata["config"]["model"])
            self._hf = None

    @property
    def step(self) -> int | None:
        return None if self.metadata is None else self.metadata["step"]

    @property
    def tokenizer(self) -> str:
        """The tokenizer file that belongs to these weights ('' when none is known)."""
        if self.metadata is None:
            found = [self.path / n for n in ("tokenizer.json", "tokenizer.model") if (self.path / n).is_file()]
            return str(found[0]) if found else ""
        return self.metadata["config"]["data"].get("tokenizer", "")

    @property
    def eod_id(self) -> int | None:
        """End-of-document id: data.eod_token_id of the checkpoint, else the tokenizer's, else None."""
        if self.metadata is not None and self.metadata["config"]["data"].get("eod_token_id", -1) >= 0:
            return self.metadata["config"]["data"]["eod_token_id"]
        if not self.tokenizer:
            return None
        from data.eod import eod_id_from_tokenizer
        try:
            return eod_id_from_tokenizer(self.tokenizer)
        except (OSError, ValueError):
            return None

    def fill(self, chunks, tp_size: int = 1, tp_rank: int = 0) -> None:
        """Copy each chunk parameter's slice for TP rank `tp_rank` of `tp_size` (tied pipeline copies read
        the embedding they duplicate)."""
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                source = p.init_name if getattr(p, "pipeline_duplicate", False) else name
                if self._hf is not None:
                    flat = self._hf.read_local(source, p.full_shape, p.tp_dim, tp_size, tp_rank, 0, p.numel())
                else:
                    if not self.reader.has(source, "master"):
                        raise CheckpointError(f"{self.path} has no weights for {source}")
                    flat = self.reader.read_local(source, "master", p.full_shape, p.tp_dim, tp_size, tp_rank, 0,
                                                  p.numel())
                with torch.no_grad():
                    p.copy_(flat.view(p.shape))

    def close(self) -> None:
        if self._hf is not None:
            self._hf.close()
        else:
            self.reader.close()


def load_single_model(source: ModelSource, device="cpu", dtype=torch.float32):
    """The whole model on one process (TP 1, no pipeline), in eval mode."""
    from engine.model import CausalLM
    model = CausalLM(source.model)  # parameters start uninitialised: every one is filled below
    source.fill([model])
    return model.to(device=device, dtype=dtype).eval()
