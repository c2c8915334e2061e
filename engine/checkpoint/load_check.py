"""Is checkpoint.load a checkpoint the run can start from? The pre-flight's PASS/FAIL line (engine/preflight.py),
which trains a shrunk model and so never loads it."""
from __future__ import annotations

import json
from pathlib import Path

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.hf_weights import is_hf_directory
from engine.checkpoint.manifest import MANIFEST, check_manifest, open_verified
from engine.checkpoint.resume_plan import load_plan


def check_load(load: str) -> str:
    """What checkpoint.load holds, verified (a local checkpoint: every file's SHA-256; one in an object store:
    its manifest and every object's size, the SHA-256 being checked as the run restores it); a
    CheckpointError naming what is wrong otherwise."""
    from engine.checkpoint.locations import S3Location
    if load.startswith("s3://"):
        sources: list = []
        (_, index, name), *_ = load_plan(load, False, sources, lambda url: S3Location(url, 1, 0, 64, 4))
        store = sources[index].store
        data = store.get_bytes(name, MANIFEST)
        if data is None:
            raise CheckpointError(f"{store.where(name)} has no {MANIFEST}")
        try:
            manifest = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{store.where(name, MANIFEST)} is not JSON ({exc})") from exc
        try:
            check_manifest(Path(name), manifest)
        except CheckpointError as exc:
            raise CheckpointError(str(exc).replace(f"{name}/{MANIFEST}", store.where(name, MANIFEST))) from exc
        sizes = store.sizes(name)
        wrong = [f"{store.where(name, f)}: {sizes.get(f, 'missing')} bytes, manifest says {info['bytes']}"
                 for f, info in sorted(manifest["files"].items()) if sizes.get(f) != info["bytes"]]
        if wrong:
            raise CheckpointError("; ".join(wrong))
        return f"checkpoint.load: {store.where(name)} complete (step {manifest['step']}, {len(sizes)} objects of the " \
               f"manifest's sizes; SHA-256 checked as the run restores it)"
    path = Path(load)
    if is_hf_directory(path):
        return f"checkpoint.load: {path} is a Hugging Face model directory"
    (_, found), *_ = load_plan(load, False, [], None)
    reader = open_verified(Path(found))
    reader.close()
    return f"checkpoint.load: {found} verified (step {reader.metadata['step']}, every file's SHA-256)"
