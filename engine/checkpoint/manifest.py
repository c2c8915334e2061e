"""The manifest: checkpoints described as global tensors, so any layout can read what any layout wrote.

For every parameter name the manifest stores the global (TP=1, unpadded) shape and dtype, how the saving
layout split it (`tp_dim`, `tp_size`, TP-local shape) and the pieces: which file holds which flat range
[start, end) of which TP rank's local tensor, for the keys `master`, `exp_avg`, `exp_avg_sq` (AdamW's) or
`master`, `momentum` (Muon's matrices, optim.name=muon). Inside a
file the tensor `"{key}/{name}"` is that 1-D fp32 range. The manifest also lists every file with its
SHA-256 and size. `CheckpointReader` answers "elements [a, b) of my TP-local tensor" for any target
layout: directly from the matching pieces when the TP split is the same, otherwise through the global
tensor.

Nothing read is trusted: `check_manifest` confines every file a manifest names to its own listed (and so
verified) files and every piece to its tensor, and `SafetensorsRanges` checks each header field against
the file's size; anything else is one CheckpointError line naming the file.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from engine.checkpoint.files import CheckpointError, sha256_file
from parallel.tensor import padded_vocab_size

FORMAT, VERSION = "trilith-checkpoint", 1
KEYS = ("master", "exp_avg", "exp_avg_sq", "momentum")
MANIFEST, METADATA = "manifest.json", "metadata.json"
ENTRY_FIELDS = ("shape", "dtype", "tp_dim", "tp_size", "local_shape", "keys", "pieces")
ENTRY_BYTES = {"float32": 4, "bfloat16": 2}  # stored element sizes: full checkpoints fp32, light snapshots bf16


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
        full[0] = padded_vocab_size(full[0], tp_size)
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
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} ({what}) is missing or unreadable: {exc}") from exc


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dims(value) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(_count(v) and v > 0 for v in value)


def plain_name(name) -> bool:
    """A file directly inside the checkpoint: no directories, no `..`, not absolute, not hidden."""
    return isinstance(name, str) and name not in ("", MANIFEST) and Path(name).name == name and \
        not name.startswith(".") and "\\" not in name and "\0" not in name


def check_manifest(directory: Path, manifest) -> None:
    """Everything loading relies on, before anything is read: every file a manifest names is a listed (and so
    verified) file directly inside this checkpoint, every piece lies inside its tensor, the pieces of each
    TP rank tile its local tensor exactly, and no file is asked for more bytes than it has."""
    where = directory / MANIFEST

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{where} is damaged: {what}; restore this checkpoint from a copy (or resume "
                                  f"from another with checkpoint.fallback=true)")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a Trilith checkpoint manifest")
    files, tensors = manifest.get("files"), manifest.get("tensors")
    need(isinstance(files, dict) and isinstance(tensors, dict), "it needs the objects 'files' and 'tensors'")
    for name, info in files.items():
        need(plain_name(name), f"file {name[:80]!r} is not a plain file name inside the checkpoint")
        need(isinstance(info, dict) and isinstance(info.get("sha256"), str) and _count(info.get("bytes")),
             f"files[{name!r}] needs a 'sha256' string and a 'bytes' count")
    need(METADATA in files, f"{METADATA} is not among its files")
    budget = {name: info["bytes"] for name, info in files.items()}
    for name, entry in tensors.items():
        need(isinstance(entry, dict) and all(k in entry for k in ENTRY_FIELDS),
             f"tensors[{name[:80]!r}] is not an object with the fields {', '.join(ENTRY_FIELDS)}")
        shape, local, tp_dim, tp_size = (entry.get(k) for k in ("shape", "local_shape", "tp_dim", "tp_size"))
        keys, pieces = entry.get("keys"), entry.get("pieces")
        need(_dims(shape) and _dims(local) and len(shape) == len(local) and isinstance(tp_size, int)
             and tp_size >= 1 and ((tp_dim is None and tp_size == 1) or (_count(tp_dim) and tp_dim < len(shape)))
             and isinstance(entry.get("dtype"), str) and entry["dtype"] in ENTRY_BYTES,
             f"tensor {name[:80]!r} has an invalid shape, split or dtype")
        full = list(local)
        if tp_dim is not None:
            full[tp_dim] *= tp_size
        need(shape[1:] == full[1:] and shape[0] <= full[0], f"tensor {name[:80]!r}: shape {shape} does not fit "
                                                            f"local_shape {local} split {tp_size} ways")
        need(isinstance(keys, list) and all(isinstance(k, str) and k in KEYS for k in keys) and
             len(set(keys)) == len(keys), f"tensor {name[:80]!r}: keys must be distinct, among {list(KEYS)}")
        need(isinstance(pieces, list) and all(isinstance(q, dict) for q in pieces) and tp_size <= len(pieces),
             f"tensor {name[:80]!r}: 'pieces' is not a list of objects, at least one per TP rank")
        numel = math.prod(local)
        for rank in range(tp_size):
            covered = 0
            mine = [q for q in pieces if q.get("tp_rank") == rank]
            for q in sorted(mine, key=lambda q: q.get("start") if _count(q.get("start")) else -1):
                need(isinstance(q.get("file"), str) and q["file"] in files and q["file"].endswith(".safetensors"),
                     f"tensor {name[:80]!r}: a piece names {str(q.get('file'))[:80]!r}, which is not among its "
                     f"safetensors files")
                need(_count(q.get("start")) and _count(q.get("end")) and q["start"] == covered
                     and covered < q["end"] <= numel, f"tensor {name[:80]!r}: the pieces of TP rank {rank} do not "
                                                      f"tile its {numel} elements")
                covered = q["end"]
                budget[q["file"]] -= ENTRY_BYTES[entry["dtype"]] * (q["end"] - q["start"]) * len(keys)
                need(budget[q["file"]] >= 0, f"its pieces ask more bytes of {q['file']} than it has")
            need(covered == numel, f"tensor {name[:80]!r}: the pieces of TP rank {rank} cover {covered} of its "
                                   f"{numel} elements")
        need(len(pieces) == sum(q.get("tp_rank") in range(tp_size) for q in pieces),
             f"tensor {name[:80]!r}: a piece's tp_rank is outside 0..{tp_size - 1}")


def _scaler(value) -> bool:
    if value is None:  # converted checkpoints: the run's own scaler starts fresh
        return True
    scale = value.get("scale") if isinstance(value, dict) else None
    return isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0 \
        and _count(value.get("good_steps"))


def check_metadata(path: Path, meta) -> None:
    """The fields resuming uses, with their types (a damaged value would fail later, mid-training)."""
    fields = {"step": _count, "consumed_samples": _count, "adam_step": _count, "scaler": _scaler,
              "layout": lambda v: isinstance(v, dict), "config": lambda v: isinstance(v, dict)}
    bad = [k for k, ok in fields.items() if not isinstance(meta, dict) or not ok(meta.get(k))]
    if bad:
        raise CheckpointError(f"{path} is damaged: {', '.join(bad)} missing or invalid")


TENSOR_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8,
                 "I64": torch.int64, "I32": torch.int32}


class SafetensorsRanges:
    """Reads tensors, or element ranges of 1-D fp32 tensors, of a safetensors file straight into new tensors
    (one copy, no memory map shared between callers). Every header field is checked against the file's
    size before it is used, so a damaged file is a CheckpointError naming it, never a huge allocation."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.file = open(path, "rb")
        except OSError as exc:
            raise CheckpointError(f"{path} is unreadable: {exc}") from exc
        try:
            self.header, self.base, self.size = self._read_header()
        except BaseException:
            self.file.close()
            raise

    def _read_header(self) -> tuple[dict, int, int]:
        size = os.fstat(self.file.fileno()).st_size
        length = int.from_bytes(self.file.read(8), "little")
        if size < 8 or length > size - 8:
            raise CheckpointError(f"{self.path} is damaged: its header length {length} exceeds the file's {size} "
                                  f"bytes (a flipped bit or a truncated file)")
        try:
            header = json.loads(self.file.read(length))
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{self.path} is damaged: its header is not JSON ({exc})") from exc
        meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CheckpointError(f"{self.path} is damaged: its header is not a safetensors header")
        return header, 8 + length, size

    @property
    def metadata(self) -> dict:
        return self.header.get("__metadata__", {})

    def keys(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def _entry(self, key: str, dtype=None) -> tuple[torch.dtype, list[int], int]:
        info = self.header.get(key) if key != "__metadata__" else None
        if not isinstance(info, dict):
            raise CheckpointError(f"{self.path} has no tensor {key[:80]!r}")
        kind, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        ok = isinstance(kind, str) and kind in TENSOR_DTYPES and (dtype is None or TENSOR_DTYPES[kind] == dtype) \
            and isinstance(shape, list) and all(_count(n) for n in shape) and isinstance(offsets, list) and \
            len(offsets) == 2 and all(_count(o) for o in offsets) and \
            offsets[0] + math.prod(shape) * TENSOR_DTYPES[kind].itemsize == offsets[1] <= self.size - self.base
        if not ok:
            raise CheckpointError(f"{self.path} is damaged: the header entry of tensor {key[:80]!r} (dtype, shape, "
                                  f"data_offsets) does not fit the file" + (" or is not fp32" if dtype else ""))
        return TENSOR_DTYPES[kind], shape, offsets[0]

    def _read_into(self, out: torch.Tensor, offset: int, what: str) -> torch.Tensor:
        self.file.seek(self.base + offset)
        if self.file.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")) != \
                out.numel() * out.element_size():
            raise CheckpointError(f"{self.path} ends inside tensor {what} (truncated)")
        return out

    def read(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the 1-D fp32 (or, in light snapshots, bf16) tensor `key`, as fp32."""
        dtype, shape, offset = self._entry(key)
        if dtype not in (torch.float32, torch.bfloat16):
            raise CheckpointError(f"{self.path} is damaged: tensor {key[:80]!r} is neither fp32 nor bf16")
        if not 0 <= start <= end <= math.prod(shape):
            raise CheckpointError(f"{self.path}: elements [{start}, {end}) lie outside tensor {key[:80]!r} of "
                                  f"{math.prod(shape)} elements")
        out = torch.empty(end - start, dtype=dtype)
        return self._read_into(out, offset + dtype.itemsize * start, key).float()

    def tensor(self, key: str) -> torch.Tensor:
        dtype, shape, offset = self._entry(key)
        return self._read_into(torch.empty(shape, dtype=dtype), offset, key)

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


def open_verified(directory: Path, checksums: bool = True) -> "CheckpointReader":
    """A reader for a checkpoint whose every file was checked first, in one process (what offline tools use;
    training splits the same checks over its ranks)."""
    manifest = load_json(directory / MANIFEST, "checkpoint manifest")
    check_manifest(directory, manifest)
    problems = verify(directory, manifest, sorted(manifest["files"]), checksums)
    if problems:
        raise CheckpointError(f"checkpoint {directory} is unusable: {'; '.join(problems)}")
    return CheckpointReader(directory)


class CheckpointReader:
    """Reads ranges of TP-local tensors of any layout from one committed checkpoint directory."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.manifest = load_json(self.dir / MANIFEST, "checkpoint manifest")
        check_manifest(self.dir, self.manifest)
        self.metadata = load_json(self.dir / METADATA, "checkpoint metadata")
        check_metadata(self.dir / METADATA, self.metadata)
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
