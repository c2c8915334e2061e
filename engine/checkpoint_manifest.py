"""The manifest: checkpoints described as global tensors, so any layout can read what any layout wrote.

For every parameter name the manifest stores the global (TP=1, unpadded) shape and dtype, how the saving
layout split it (`tp_dim`, `tp_size`, TP-local shape) and the pieces: which file holds which flat range
[start, end) of which TP rank's local tensor, for the keys `master`, `exp_avg`, `exp_avg_sq`. Inside a
file the tensor `"{key}/{name}"` is that 1-D fp32 range. The manifest also lists every file with its
SHA-256 and size. `CheckpointReader` answers "elements [a, b) of my TP-local tensor" for any target
layout: directly from the matching pieces when the TP split is the same, otherwise through the global
tensor.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from engine.checkpoint_io import CheckpointError, sha256_file

FORMAT, VERSION = "trilith-checkpoint", 1
KEYS = ("master", "exp_avg", "exp_avg_sq")
MANIFEST, METADATA = "manifest.json", "metadata.json"


def rank_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"tp{tp_rank:02d}-pp{pp_rank:02d}-dp{dp_rank:03d}.safetensors"


def global_shape(full_shape, valid_rows) -> list[int]:
    """The stored shape: the full TP=1 shape without vocabulary padding rows."""
    return [valid_rows or full_shape[0], *full_shape[1:]]


def local_shape(full_shape, tp_dim, tp_size: int) -> list[int]:
    shape = list(full_shape)
    if tp_dim is not None:
        shape[tp_dim] //= tp_size
    return shape


def padded_full_shape(shape, tp_dim, tp_size: int) -> list[int]:
    """The TP=1 shape a layout holds: vocabulary rows padded to a multiple of the TP size."""
    full = list(shape)
    if tp_dim == 0:
        full[0] = math.ceil(full[0] / tp_size) * tp_size
    return full


def local_from_global(tensor: torch.Tensor, full_shape, tp_dim, tp_size: int, tp_rank: int) -> torch.Tensor:
    if tensor.shape[0] < full_shape[0]:  # padding rows are zeros (never used, never updated)
        pad = torch.zeros([full_shape[0] - tensor.shape[0], *tensor.shape[1:]], dtype=tensor.dtype)
        tensor = torch.cat([tensor, pad])
    if tp_dim is None:
        return tensor
    return tensor.chunk(tp_size, dim=tp_dim)[tp_rank]


def tensor_entry(full_shape, tp_dim, tp_size: int, valid_rows, keys) -> dict:
    return {"shape": global_shape(full_shape, valid_rows), "dtype": "float32", "tp_dim": tp_dim,
            "tp_size": tp_size if tp_dim is not None else 1, "local_shape": local_shape(full_shape, tp_dim, tp_size),
            "keys": list(keys), "pieces": []}


def merge_entries(per_rank: list[dict]) -> dict:
    """Combine each rank's {name: entry with its own pieces} into one entry per name."""
    tensors: dict[str, dict] = {}
    for entries in per_rank:
        for name, entry in entries.items():
            if name not in tensors:
                tensors[name] = {**entry, "pieces": []}
            tensors[name]["pieces"].extend(entry["pieces"])
    for entry in tensors.values():
        entry["pieces"].sort(key=lambda p: (p["tp_rank"], p["start"]))
    return dict(sorted(tensors.items()))


def load_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} ({what}) is missing or unreadable: {exc}") from exc


class SafetensorsRanges:
    """Reads element ranges of 1-D fp32 tensors of a safetensors file straight into new tensors (one copy,
    no memory map shared between callers)."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "rb")
        size = int.from_bytes(self.file.read(8), "little")
        self.header = json.loads(self.file.read(size))
        self.base = 8 + size

    def read(self, key: str, start: int, end: int) -> torch.Tensor:
        info = self.header.get(key)
        if info is None or info["dtype"] != "F32":
            raise CheckpointError(f"{self.path} has no fp32 tensor {key}")
        out = torch.empty(end - start, dtype=torch.float32)
        self.file.seek(self.base + info["data_offsets"][0] + 4 * start)
        if self.file.readinto(memoryview(out.numpy()).cast("B")) != 4 * (end - start):
            raise CheckpointError(f"{self.path} ends inside tensor {key} (truncated)")
        return out

    def close(self) -> None:
        self.file.close()


def verify(directory: Path, manifest: dict, names, checksums: bool = True) -> list[str]:
    """Problems with the given files of a checkpoint ('<file>: <what>'); empty when they are intact."""
    problems = []
    for name in names:
        expected, path = manifest["files"][name], directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != expected["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, manifest says {expected['bytes']} (truncated?)")
        elif checksums and sha256_file(path) != expected["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the manifest (corrupt)")
    return problems


class CheckpointReader:
    """Reads ranges of TP-local tensors of any layout from one committed checkpoint directory."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.manifest = load_json(self.dir / MANIFEST, "checkpoint manifest")
        if self.manifest.get("format") != FORMAT:
            raise CheckpointError(f"{self.dir / MANIFEST} is not a Trilith checkpoint manifest")
        self.metadata = load_json(self.dir / METADATA, "checkpoint metadata")
        self.tensors = self.manifest["tensors"]
        self._files: dict[str, SafetensorsRanges] = {}
        self._cached: tuple | None = None

    def _file(self, name: str):
        if name not in self._files:
            self._files[name] = SafetensorsRanges(self.dir / name)
        return self._files[name]

    def has(self, name: str, key: str) -> bool:
        return name in self.tensors and key in self.tensors[name]["keys"]

    def _source_local(self, name: str, key: str, tp_rank: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the saving layout's flattened TP-local tensor on `tp_rank` (a new tensor)."""
        for piece in self.tensors[name]["pieces"]:
            if piece["tp_rank"] == tp_rank and piece["start"] <= start and end <= piece["end"]:
                return self._file(piece["file"]).read(f"{key}/{name}", start - piece["start"], end - piece["start"])
        out = torch.empty(end - start, dtype=torch.float32)
        covered = 0
        for piece in self.tensors[name]["pieces"]:
            lo, hi = max(start, piece["start"]), min(end, piece["end"])
            if piece["tp_rank"] != tp_rank or lo >= hi:
                continue
            out[lo - start:hi - start] = self._file(piece["file"]).read(f"{key}/{name}", lo - piece["start"],
                                                                        hi - piece["start"])
            covered += hi - lo
        if covered != end - start:
            raise CheckpointError(f"{self.dir}: pieces of {name}/{key} on TP rank {tp_rank} cover {covered} of the "
                                  f"{end - start} elements [{start}, {end}) (incomplete manifest)")
        return out

    def global_tensor(self, name: str, key: str = "master") -> torch.Tensor:
        if self._cached and self._cached[:2] == (name, key):
            return self._cached[2]
        entry = self.tensors[name]
        numel = math.prod(entry["local_shape"])
        locals_ = [self._source_local(name, key, r, 0, numel).view(entry["local_shape"])
                   for r in range(entry["tp_size"])]
        full = locals_[0] if entry["tp_dim"] is None else torch.cat(locals_, dim=entry["tp_dim"])
        full = full[:entry["shape"][0]].contiguous()
        self._cached = (name, key, full)
        return full

    def read_local(self, name: str, key: str, full_shape, tp_dim, tp_size: int, tp_rank: int,
                   start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the target layout's flattened TP-local tensor of `name` (a new tensor)."""
        entry = self.tensors[name]
        want_local = local_shape(full_shape, tp_dim, tp_size)
        same_split = (tp_dim is None and entry["tp_dim"] is None) or (
            tp_dim == entry["tp_dim"] and tp_size == entry["tp_size"] and want_local == entry["local_shape"])
        if same_split:
            return self._source_local(name, key, tp_rank if tp_dim is not None else 0, start, end)
        local = local_from_global(self.global_tensor(name, key), full_shape, tp_dim, tp_size, tp_rank)
        return local.reshape(-1)[start:end].clone()

    def check_model(self, expected: dict[str, list[int]]) -> None:
        """Every expected parameter is in the checkpoint with the expected global shape."""
        missing = sorted(set(expected) - set(self.tensors))
        wrong = [f"{n}: checkpoint {self.tensors[n]['shape']} vs model {s}" for n, s in sorted(expected.items())
                 if n in self.tensors and list(self.tensors[n]["shape"]) != list(s)]
        if missing or wrong:
            raise CheckpointError(
                f"{self.dir} does not fit this model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                f"shape mismatches {wrong[:5]}. The model.* config must equal the checkpoint's (its metadata.json "
                f"has the config it was saved with)")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._cached = None
