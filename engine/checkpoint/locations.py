"""Where copies of a run's checkpoints go (checkpoint.mirrors): directories (a shared file system) and
`s3://bucket/prefix` object stores, each with the same layout as run.dir/checkpoints (step_N/ with its
files and manifest.json, and `latest`).

Every location writes in the same order, so that none ever names an incomplete checkpoint: the data files
(each verified against the manifest's SHA-256), then manifest.json, then `latest`. A directory gets the
copy under a temporary name renamed into place; an object store has no rename, so a step without
manifest.json is incomplete there and is neither listed nor loaded. An entry may carry its own retention,
`PATH?keep=N&keep_every=M`; without it the location keeps what checkpoint.keep and keep_every say.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import parse_qs

from engine.checkpoint.files import (LATEST, STEP_DIR, TMP_PREFIX, CheckpointError, commit, copy_verified, doomed,
                                     read_latest, set_latest, step_dirs)
from engine.checkpoint.manifest import MANIFEST, check_manifest, load_json
from engine.checkpoint.s3_store import S3Store
from engine.config.schema import mirror_problem

log = logging.getLogger("trilith")


class DirLocation:
    """A directory, on any file system (a shared one, for the cluster)."""

    copies_in_child = False  # copy_verified's copying and hashing leave the interpreter lock to the step

    def __init__(self, path: str, keep: int, keep_every: int):
        self.root, self.name, self.keep, self.keep_every = Path(path), path, keep, keep_every

    def check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=self.root, prefix=TMP_PREFIX + "write-check-")
            probe.close()
        except OSError as exc:
            raise CheckpointError(f"{self.name}: cannot create or write the directory ({exc.strerror or exc}); "
                                  f"fix its permissions or name another in checkpoint.mirrors") from exc

    def latest(self) -> str | None:
        path = read_latest(self.root)
        return path.name if path is not None else None

    def steps(self) -> list[str]:
        return [d.name for d in step_dirs(self.root)]

    def describe(self, name: str) -> str:
        return str(self.root / name)

    def put(self, src: Path, name: str, files: dict) -> None:
        copy_verified(src, self.root, files)

    def fetch(self, name: str, dest_root: Path) -> None:
        manifest = load_json(self.root / name / MANIFEST, "checkpoint manifest")
        check_manifest(self.root / name, manifest)
        copy_verified(self.root / name, dest_root, manifest["files"])

    def prune(self, saved: list[str]) -> None:
        for name in doomed(self.steps(), self.keep, self.keep_every, saved, {self.latest()}):
            if not (self.root / name).is_symlink():
                shutil.rmtree(self.root / name)


class S3Location:
    """A prefix in a bucket of an S3-compatible object store."""

    copies_in_child = True  # boto3's upload is Python work: in the training process it slowed the step 2.4×

    def __init__(self, url: str, keep: int, keep_every: int, part_mb: int, threads: int):
        self.store, self.keep, self.keep_every = S3Store(url, part_mb, threads), keep, keep_every
        self.name = self.store.url

    def check_writable(self) -> None:
        self.store.check_writable()

    def latest(self) -> str | None:
        data = self.store.get_bytes(LATEST)
        if data is None:
            return None
        name = data.decode(errors="replace").strip()
        if not STEP_DIR.match(name):
            raise CheckpointError(f"{self.store.where(LATEST)} holds {name[:80]!r}, not the name of a step "
                                  f"directory; delete it to resume from the newest complete step")
        return name

    def _listing(self) -> tuple[list[str], list[str]]:
        """(complete, incomplete) step names, newest first."""
        found: dict[str, bool] = {}
        for key in self.store.sizes():
            step, _, rest = key.partition("/")
            if STEP_DIR.match(step):
                found[step] = found.get(step, False) or rest == MANIFEST
        names = sorted(found, reverse=True)
        return [n for n in names if found[n]], [n for n in names if not found[n]]

    def steps(self) -> list[str]:
        return self._listing()[0]

    def describe(self, name: str) -> str:
        return self.store.where(name)

    def put(self, src: Path, name: str, files: dict) -> None:
        if self.latest() != name:  # leftovers of an upload cut short; what `latest` names is never touched
            self.store.delete_below(name)
        for file in sorted(files):
            self.store.upload(src / file, name, file, sha256=files[file]["sha256"])
        self.store.put_bytes((src / MANIFEST).read_bytes(), name, MANIFEST)
        self.store.put_bytes(f"{name}\n".encode(), LATEST)

    def fetch(self, name: str, dest_root: Path) -> None:
        """A verified copy of step `name` in dest_root (committed there and named by its `latest`); a
        CheckpointError naming the object whose bytes differ from the manifest."""
        where = self.store.where(name)
        data = self.store.get_bytes(name, MANIFEST)
        if data is None:
            raise CheckpointError(f"{where} has no {MANIFEST} (missing, or an upload that never finished)")
        dest_root.mkdir(parents=True, exist_ok=True)
        tmp = dest_root / (TMP_PREFIX + name)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            (tmp / MANIFEST).write_bytes(data)
            try:
                manifest = json.loads(data)
                check_manifest(tmp, manifest)
            except (ValueError, RecursionError) as exc:
                raise CheckpointError(f"{where}/{MANIFEST} is not JSON ({exc})") from exc
            except CheckpointError as exc:
                raise CheckpointError(str(exc).replace(str(tmp), where)) from exc
            bad = [f"{where}/{file}: SHA-256 differs from the manifest (corrupt)"
                   for file, info in sorted(manifest["files"].items())
                   if self.store.download(tmp / file, name, file) != info["sha256"]]
            if bad:
                raise CheckpointError("; ".join(bad))
            commit(tmp, dest_root / name)
            set_latest(dest_root, name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def prune(self, saved: list[str]) -> None:
        complete, incomplete = self._listing()
        for name in doomed(complete, self.keep, self.keep_every, saved, {self.latest()}) + incomplete:
            self.store.delete_below(name)


def parse_location(entry: str, ck):
    """A checkpoint.mirrors entry as a location; retention from its `?keep=N&keep_every=M`, else the run's."""
    problem = mirror_problem(entry)
    if problem:
        raise CheckpointError(f"checkpoint.mirrors entry {entry!r}: {problem}")
    path, _, query = entry.partition("?")
    options = {k: int(v[-1]) for k, v in parse_qs(query).items()}
    keep, keep_every = options.get("keep", ck.keep), options.get("keep_every", ck.keep_every)
    if path.startswith("s3://"):
        return S3Location(path, keep, keep_every, ck.upload_part_mb, ck.upload_threads)
    return DirLocation(os.path.expanduser(path), keep, keep_every)


def mirror_entries(ck) -> list[str]:
    """checkpoint.mirrors, with the older checkpoint.mirror_dir first when it is set."""
    return ([ck.mirror_dir] if ck.mirror_dir and ck.mirror_dir not in ck.mirrors else []) + list(ck.mirrors)


MIRROR_DIR_NOTICE = "checkpoint.mirror_dir is read as the first entry of checkpoint.mirrors; write " \
                    "checkpoint.mirrors=[{}] instead"


def locations_of(ck) -> list:
    return [parse_location(entry, ck) for entry in mirror_entries(ck)]


def check_locations(ck) -> list[str]:
    """One line per location that cannot be written now (the pre-start check; launch/check.py)."""
    problems = []
    try:
        locations = locations_of(ck)
    except CheckpointError as exc:
        return [str(exc)]
    for location in locations:
        try:
            location.check_writable()
        except CheckpointError as exc:
            problems.append(str(exc))
    return problems


def fetch_s3_checkpoint(url: str, dest_root: Path) -> Path:
    """A verified copy in dest_root of s3://… naming one checkpoint, or a checkpoints prefix (its `latest`);
    what offline tools read (tools/ckpt_convert.py --load-dir s3://…)."""
    location = S3Location(url, 1, 0, 64, 4)
    if location.store.get_bytes(MANIFEST) is not None:
        parent, _, name = location.name.rpartition("/")
        location = S3Location(parent, 1, 0, 64, 4)
    else:
        name = location.latest()
        if name is None:
            raise CheckpointError(f"{url} is neither a checkpoint (with {MANIFEST}) nor a checkpoints prefix with "
                                  f"a '{LATEST}' object")
    location.fetch(name, dest_root)
    return dest_root / name
