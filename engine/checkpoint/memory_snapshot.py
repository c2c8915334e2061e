"""Memory snapshots: the format and the node-local store (checkpoint.memory_interval).

A memory snapshot of step N is every rank's shard of the training state: its optimizer's whole local state
(fp32 masters and moments of every range it holds, so that a rank restores from its own shard alone), its RNG
states, and the metadata a checkpoint's metadata.json holds (step, consumed samples, Adam step, loss scaler).
The store keeps them in node-local shared memory, which outlives the processes but not the node:

    <checkpoint.memory_dir>/<node>/<run id>/rank_<owner>/step_<N>/state.safetensors
                                                                 /manifest.json
    <checkpoint.memory_dir>/<node>/<run id>/progress_rank_<r>     the last step rank r finished

`owner` is the rank whose shard it is: a node holds its own ranks' shards and its partners' copies
(parallel/snapshot_exchange.py). A snapshot is written as `.tmp-step_N`, its manifest (size, CRC-32, step,
world size, config hash, run.dir and its token) last, then renamed into place; the two newest generations per owner are
kept, so a failure during a snapshot leaves the previous one whole. A snapshot whose manifest names another
run.dir, world size or configuration is never used: `held()` names it and ignores it.

The state file is safetensors: the training thread copies the state into one buffer laid out as its data, which is
written as it is (no encoding), and it is read straight into new tensors (no decoding copy). Its checksum is
CRC-32, not the disk checkpoint's SHA-256: a snapshot never leaves the node's memory or the partner's, so what it
must catch is a flipped or lost byte (a torn write, bad memory), not a forged file; CRC-32 catches every burst of
up to 32 bits and all but 2^-32 of the rest, and on a quiet host ran 4× faster than SHA-256 here.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint.files import DTYPES, CheckpointError
from engine.checkpoint.manifest import SafetensorsRanges
from engine.config.schema import to_dict

FORMAT = "trilith-memory-snapshot"
STATE, MANIFEST = "state.safetensors", "manifest.json"
KEEP = 2  # generations per owner
STEP = re.compile(r"^step_(\d{8})$")
OWNER = re.compile(r"^rank_(\d{5})$")


def run_id(run_dir: str) -> str:
    """The directory name of a run's snapshots: run.dir's name and a hash of its absolute path."""
    path = Path(run_dir).resolve()
    name = re.sub(r"[^A-Za-z0-9._-]", "_", path.name) or "run"
    return f"{name}-{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"


def config_hash(cfg) -> str:
    """What a snapshot must share with the run that restores it: every section but run and checkpoint (where
    the run is, how it saves), which may change across restarts without changing the training."""
    sections = {k: v for k, v in to_dict(cfg).items() if k not in ("run", "checkpoint")}
    return hashlib.sha256(json.dumps(sections, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Identity:
    """The run a snapshot belongs to."""
    run_dir: str
    world_size: int
    config_hash: str
    token: str = ""  # run.dir/checkpoints/memory_snapshots.token: a run.dir deleted and started afresh is another run

    def mismatch(self, manifest: dict) -> str:
        """Why a snapshot's manifest is not this run's ("" when it is)."""
        if manifest.get("format") != FORMAT:
            return f"format {manifest.get('format')!r}"
        for key, want in (("run_dir", self.run_dir), ("world_size", self.world_size),
                          ("config_hash", self.config_hash), ("token", self.token)):
            if manifest.get(key) != want:
                return f"{key} {manifest.get(key)!r}, this run's is {want!r}"
        return ""


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, uncopied."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def encode(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    """A safetensors file as two buffers: its header, and one new buffer that copies every tensor (from any device)
    in, wider elements first so that each tensor is aligned. The writer then hands the whole state to each C call
    (write, CRC-32) at once: a call per tensor took and gave back the GIL hundreds of times per snapshot, and on a
    busy host each handover can keep the training thread waiting."""
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())
    header, offset = {}, 0
    for key in order:
        t = tensors[key]
        size = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    flat = torch.empty(offset, dtype=torch.uint8)
    for key in order:
        start, end = header[key]["data_offsets"]
        flat[start:end].view(tensors[key].dtype).copy_(tensors[key].reshape(-1))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [memoryview(len(text).to_bytes(8, "little") + text), byte_view(flat)]


def decode(path: Path, size: int, crc: int) -> dict[str, torch.Tensor]:
    """The tensors of the state file `path`, each read into a new tensor and added to the CRC-32 while it is
    still in the cache (one pass over the bytes); a CheckpointError unless the file has `size` bytes and
    CRC-32 `crc`."""
    f = SafetensorsRanges(path)
    try:
        if f.size != size:
            raise CheckpointError(f"{path} has {f.size} bytes, its manifest says {size}")
        f.file.seek(0)
        got, offset, tensors = zlib.crc32(f.file.read(f.base)), 0, {}
        for start, key in sorted((f._entry(k)[2], k) for k in f.keys()):
            if start != offset:  # the checksum covers the file only if the tensors tile it
                raise CheckpointError(f"{path} is damaged: tensor {key[:80]!r} does not follow the one before it")
            tensors[key] = f.tensor(key)
            view = byte_view(tensors[key])
            got, offset = zlib.crc32(view, got), offset + len(view)
        if f.base + offset != f.size or got != crc:
            raise CheckpointError(f"{path} does not match its manifest's CRC-32")
        return tensors
    finally:
        f.close()


def frame(manifest: dict, size: int) -> tuple[bytearray, int]:
    """(a buffer for one shard of `size` state bytes, where they go in it): the manifest's length, the manifest,
    then the state file, as one buffer for one transfer."""
    head = json.dumps(manifest).encode()
    out = bytearray(8 + len(head) + size)
    out[:8], out[8:8 + len(head)] = len(head).to_bytes(8, "little"), head
    return out, 8 + len(head)


def pack(manifest: dict, parts) -> bytearray:
    """`frame()` filled from the state file's pieces."""
    out, offset = frame(manifest, sum(len(p) for p in parts))
    for part in parts:
        out[offset:offset + len(part)] = part
        offset += len(part)
    return out


def unpack(data) -> tuple[dict, memoryview]:
    view = memoryview(data).cast("B")
    size = int.from_bytes(view[:8], "little")
    return json.loads(bytes(view[8:8 + size])), view[8 + size:]


def file_matches(path: Path, size: int, crc: int) -> bool:
    """The file has `size` bytes and CRC-32 `crc`: checked in place through a memory map, nothing copied."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != size:
            return False
        if size == 0:
            return crc == 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return zlib.crc32(data) == crc


class SnapshotStore:
    """One node's memory snapshots of one run."""

    def __init__(self, root: str, node: str, identity: Identity):
        self.identity = identity
        self.dir = Path(root) / node / run_id(identity.run_dir)
        self.kept: dict = {}  # {path: (manifest, tensors)}: the snapshot held() read for load()
        self.older: list = []  # [(owner, step)] that held(newest=True) left unchecked

    def owner_dir(self, owner: int) -> Path:
        return self.dir / f"rank_{owner:05d}"

    def write(self, owner: int, step: int, manifest: dict, parts, between=lambda: None,
              crc: int | None = None) -> dict:
        """Commit `owner`'s shard of `step` (the state file from the buffers `parts`, then the manifest with its
        size and CRC-32, then the rename), prune to the two newest generations and return the manifest written.
        `between()` runs after the state file, before the manifest (fault injection: a rank killed
        mid-snapshot). `crc`: the checksum the sender's manifest states (a partner's copy), checked before the
        commit."""
        base = self.owner_dir(owner)
        tmp, final = base / f".tmp-step_{step:08d}", base / f"step_{step:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        size, written = 0, 0
        with open(tmp / STATE, "wb") as f:
            for part in parts:
                f.write(part)
                written, size = zlib.crc32(part, written), size + len(part)
        if crc is not None and written != crc:
            raise CheckpointError(f"the copy of rank {owner}'s step {step} snapshot was damaged in transfer (CRC-32 "
                                  f"{written:08x}, its manifest says {crc:08x})")
        between()
        manifest = {**manifest, "format": FORMAT, "rank": owner, "step": step, "run_dir": self.identity.run_dir,
                    "world_size": self.identity.world_size, "config_hash": self.identity.config_hash,
                    "token": self.identity.token, "files": {STATE: {"bytes": size, "crc32": written}}}
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        shutil.rmtree(final, ignore_errors=True)  # the same step again, after a restart: the same values
        tmp.rename(final)
        for old in self._steps(owner)[KEEP:]:
            shutil.rmtree(base / f"step_{old:08d}", ignore_errors=True)
        return manifest

    def _steps(self, owner: int) -> list[int]:
        base = self.owner_dir(owner)
        found = [int(m.group(1)) for p in base.iterdir() if (m := STEP.match(p.name))] if base.is_dir() else []
        return sorted(found, reverse=True)

    def held(self, select=lambda owner: True, keep: int | None = None, newest: bool = False,
             above: int = -1) -> tuple[list[tuple[int, int]], list[str]]:
        """([(owner, step)] of the intact snapshots of this run here whose owner `select` takes, [why each other
        one of those is ignored]). The newest intact snapshot of owner `keep` is verified while it is read into
        tensors, which `load()` then returns without reading it again; the others are checked in place.
        `newest`: per owner only down to its newest intact snapshot, the older ones left to `held_older()`.
        Snapshots of step `above` or older are neither checked nor reported (the disk checkpoint is as new)."""
        held, ignored = [], []
        self.kept, self.older = {}, []
        if not self.dir.is_dir():
            return held, ignored
        for base in sorted(self.dir.iterdir()):
            match = OWNER.match(base.name)
            if not match or not select(int(match.group(1))):
                continue
            owner = int(match.group(1))
            steps = [s for s in self._steps(owner) if s > above]
            for i, step in enumerate(steps):
                problem = self.problem(base / f"step_{step:08d}", owner == keep and not self.kept)
                if problem:
                    ignored.append(f"{base / f'step_{step:08d}'} ({problem})")
                    continue
                held.append((owner, step))
                if newest:
                    self.older += [(owner, s) for s in steps[i + 1:]]
                    break
        return held, ignored

    def held_older(self) -> tuple[list[tuple[int, int]], list[str]]:
        """`held()` for the snapshots the last `held(newest=True)` left unchecked."""
        held, ignored = [], []
        for owner, step in self.older:
            path = self._path(owner, step)
            problem = self.problem(path)
            if problem:
                ignored.append(f"{path} ({problem})")
            else:
                held.append((owner, step))
        self.older = []
        return held, ignored

    def problem(self, path: Path, read: bool = False) -> str:
        """Why the snapshot in `path` cannot be used ("" when it is whole and this run's). `read`: verify it by
        reading it into tensors, kept for `load()`."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            mismatch = self.identity.mismatch(manifest)
            if mismatch:
                return f"another run's or layout's snapshot: {mismatch}"
            want = manifest["files"][STATE]
            if read:
                try:
                    self.kept[path] = manifest, decode(path / STATE, want["bytes"], want["crc32"])
                except CheckpointError:
                    return f"{STATE} does not match its manifest's size and CRC-32"
            elif not file_matches(path / STATE, want["bytes"], want["crc32"]):
                return f"{STATE} does not match its manifest's size and CRC-32"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"unreadable: {exc}"
        return ""

    def _path(self, owner: int, step: int) -> Path:
        return self.owner_dir(owner) / f"step_{step:08d}"

    def manifest(self, owner: int, step: int) -> dict:
        return json.loads((self._path(owner, step) / MANIFEST).read_text())

    def load(self, owner: int, step: int) -> tuple[dict, dict[str, torch.Tensor]]:
        """(manifest, tensors) of a snapshot: the one `held()` read, else its state file read and checked (a
        copy received since, or an older step)."""
        path = self._path(owner, step)
        kept, self.kept = self.kept.get(path), {}
        if kept is not None:
            return kept
        manifest = self.manifest(owner, step)
        want = manifest["files"][STATE]
        return manifest, decode(path / STATE, want["bytes"], want["crc32"])

    def packed(self, owner: int, step: int) -> bytearray:
        """A snapshot as `pack()` makes it, for sending: the state file read straight into the buffer."""
        manifest, path = self.manifest(owner, step), self._path(owner, step) / STATE
        out, offset = frame(manifest, manifest["files"][STATE]["bytes"])
        with open(path, "rb", buffering=0) as f:
            if f.readinto(memoryview(out)[offset:]) != len(out) - offset:
                raise CheckpointError(f"{path} is shorter than its manifest says")
        return out

    def drop_after(self, step: int) -> None:
        """Remove snapshots newer than `step` (an attempt's that no complete set covers), before training redoes
        those steps."""
        if not self.dir.is_dir():
            return
        for base in self.dir.iterdir():
            if OWNER.match(base.name):
                for p in base.iterdir():
                    m = STEP.match(p.name)
                    if (m and int(m.group(1)) > step) or p.name.startswith(".tmp-"):
                        shutil.rmtree(p, ignore_errors=True)

    def set_progress(self, rank: int, step: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"progress_rank_{rank}").write_text(str(step))

    def progress(self, rank: int) -> int:
        """The last step `rank` finished here before this start (-1 when unknown)."""
        try:
            return int((self.dir / f"progress_rank_{rank}").read_text())
        except (OSError, ValueError):
            return -1

    def bytes_held(self) -> int:
        return sum(p.stat().st_size for p in self.dir.rglob("*") if p.is_file()) if self.dir.is_dir() else 0
