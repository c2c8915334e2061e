"""Durable file operations for checkpoints: safetensors written and hashed in one pass, fsync, atomic
directory commit, the `latest` pointer, retention.

No pickle anywhere: tensors go to safetensors files, everything else to JSON. A checkpoint directory only
ever appears under its final name complete: it is written as `.tmp-<name>`, fsynced, then renamed, and
`latest` is replaced (write + fsync + rename) only after that.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

LATEST = "latest"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step_(\d{8})$")
CHUNK = 16 << 20
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
          torch.int64: "I64", torch.int32: "I32"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file and the fix. Always one line:
    messages quote names read from damaged files, which may hold line breaks."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).splitlines()))


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@contextlib.contextmanager
def writing(path: Path):
    """A failed write (a full disk, a quota) as a CheckpointError naming the file: the OS error alone does not."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"writing {path} failed: {exc.strerror or exc}") from exc


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, int]:
    """Write a safetensors file, hashing the bytes as they go out; fsync it. Returns (sha256, size)."""
    header, offset, blobs = {"__metadata__": metadata}, 0, []
    for key, t in tensors.items():
        t = t.detach().contiguous().cpu()
        if t.dtype not in DTYPES:
            raise CheckpointError(f"tensor {key} has dtype {t.dtype}, which checkpoints do not store")
        size = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        blobs.append(t.reshape(-1).view(torch.uint8).numpy())
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    # Hash block i on a second thread while block i+1 is written (both release the GIL).
    with writing(path), open(path, "wb") as f, ThreadPoolExecutor(1) as hasher:
        pending = None
        for piece in [len(text).to_bytes(8, "little"), text, *blobs]:
            view = memoryview(piece).cast("B")
            for start in range(0, len(view), CHUNK):
                part = view[start:start + CHUNK]
                f.write(part)
                if pending is not None:
                    pending.result()
                pending = hasher.submit(digest.update, part)
        if pending is not None:
            pending.result()
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest(), 8 + len(text) + offset


def write_json(path: Path, obj) -> tuple[str, int]:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    with writing(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest(), len(data)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Rename a fully written, fsynced temporary directory to its final name (replacing an older one)."""
    fsync_dir(tmp)
    aside = final.with_name(TMP_PREFIX + "replaced-" + final.name)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def set_latest(root: Path, name: str) -> None:
    tmp = root / (TMP_PREFIX + LATEST)
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def read_latest(root: Path) -> Path | None:
    """The checkpoint `latest` names: only ever a step directory's plain name, so that it cannot lead out of
    this checkpoints directory (to another run's checkpoint, say)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer} is unreadable ({exc}); delete it to resume from the newest intact "
                              f"step directory") from exc
    if not STEP_DIR.match(name):
        raise CheckpointError(f"{pointer} holds {name[:80]!r}, not the name of a step directory in {root} "
                              f"(step_<8 digits>); delete it to resume from the newest intact step directory, or "
                              f"name another run's checkpoint with checkpoint.load")
    return root / name


def step_dirs(root: Path) -> list[Path]:
    """Committed checkpoint directories under root, newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def remove_stale_tmp(root: Path) -> None:
    """Leftovers of saves that were killed midway (never loadable: they were never renamed)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def doomed(names: list[str], keep: int, keep_every: int, saved: list[str], protected: set) -> list[str]:
    """Which of a location's step names retention deletes: all but the `keep` most recently saved, except
    steps that are multiples of `keep_every` and the `protected` names. `saved` names this run's saves in the
    order they were made: they are newer than anything found there, whatever their step numbers (a run
    resumed from an older step saves lower numbers than the directories it abandoned)."""
    mine = {name: i for i, name in enumerate(saved)}
    found = sorted(names, key=lambda n: (n in mine, mine.get(n, 0), n), reverse=True)
    protected = protected | {saved[-1] if saved else None}
    return [name for i, name in enumerate(found) if not (
        i < keep or (keep_every > 0 and int(STEP_DIR.match(name).group(1)) % keep_every == 0) or name in protected)]


def apply_retention(root: Path, keep: int, keep_every: int, saved: list[str], protected: frozenset = frozenset()) \
        -> list[Path]:
    """Delete the checkpoints `doomed` names in root. Never deleted: `latest`'s target, the last save, the
    `protected` names (still being copied to other locations) and symlinked directories (their target is not
    ours to delete)."""
    try:
        latest = read_latest(root)
    except CheckpointError:
        latest = None
    keep_names = set(protected) | {latest.name if latest else None}
    removed = []
    for name in doomed([d.name for d in step_dirs(root)], keep, keep_every, saved, keep_names):
        path = root / name
        if path.is_symlink():
            continue
        shutil.rmtree(path)
        removed.append(path)
    return removed


def copy_verified(src: Path, dst_root: Path, files: dict[str, dict]) -> Path:
    """Copy a committed checkpoint to another root, checking every copied byte against the manifest."""
    dst_root.mkdir(parents=True, exist_ok=True)
    tmp = dst_root / (TMP_PREFIX + src.name)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name in sorted(files) + ["manifest.json"]:
            digest = hashlib.sha256()
            with open(src / name, "rb") as fin, open(tmp / name, "wb") as fout:
                while block := fin.read(CHUNK):
                    fout.write(block)
                    digest.update(block)
                fout.flush()
                os.fsync(fout.fileno())
            if name in files and digest.hexdigest() != files[name]["sha256"]:
                raise CheckpointError(f"mirror copy of {src / name} does not match its SHA-256 in the manifest")
    except BaseException:  # a full or failing mirror: leave no half copy behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit(tmp, dst_root / src.name)
    set_latest(dst_root, src.name)
    return dst_root / src.name
