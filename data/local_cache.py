"""Node-local copies of the token shards a run reads (data.local_cache_dir).

One process per node (the caller decides which, and makes the others wait) calls fill_cache: every file of
every dataset prefix (.idx, .bin or .arrow, the .prov.npz provenance when present) and the sample-index
arrays already cached for it are copied into the local directory, each into a temporary file while its
SHA-256 is computed, re-read and checked against that digest, then renamed into place. manifest.json records,
per cached file, its source, the source's size and modification time, and the digest.

At a restart a cached file is reused only if its source is unchanged (size and mtime, a stat of the shared
file) and the local copy still hashes to the recorded digest (a read of local storage only); any other file
is copied again, never trusted. The dataset prefix /shared/web becomes <cache>/<hash of /shared>/web, so equal
names in different directories do not collide, and its index cache (index-cache/ beside the prefix) moves
with it.

A prefix may be an s3://bucket/dir/name URL (data/s3_shards.py): its objects are fetched the same way, each
checked against the store's listed size and its sidecar SHA-256 (or its single-part ETag) before it is renamed
into place, and reused at a restart while the store lists the same size and ETag and the local copy still
hashes to the recorded digest; only a listing is asked of the store then. Its sample-index arrays are built
in the cache, beside the copy.
"""
import hashlib
import json
import os
import socket
import time

from data.provenance import provenance_path
from data.s3_shards import S3Shards, is_s3

MANIFEST = "manifest.json"
CHUNK = 16 << 20
INDEX_ARRAYS = ("_doc.npy", "_sample.npy", "_shuffle.npy")


def local_prefix(prefix, cache_dir):
    """Where the node-local copy of dataset `prefix` (a path or an s3:// URL) lives."""
    source = prefix.rstrip("/") if is_s3(prefix) else os.path.abspath(prefix)
    parent, _, name = source.rpartition("/")
    folder = hashlib.sha256(parent.encode()).hexdigest()[:12]
    return os.path.join(cache_dir, folder, name)


def source_files(prefix, index_cache_dir=None):
    """The files of dataset `prefix` to cache, as (source path, path relative to the prefix's local folder).
    index_cache_dir: where its sample-index arrays are cached (None = index-cache/ beside the prefix)."""
    name = os.path.basename(prefix)
    idx = prefix + ".idx"
    tokens = [prefix + ext for ext in (".bin", ".arrow") if os.path.isfile(prefix + ext)]
    if not os.path.isfile(idx) or not tokens:
        missing = idx if not os.path.isfile(idx) else prefix + ".bin"
        raise FileNotFoundError(f"dataset file {missing} does not exist; data.paths must name prefixes made by "
                                f"tools/preprocess_data.py")
    files = [(path, os.path.basename(path)) for path in [idx, *tokens]]
    if os.path.isfile(provenance_path(prefix)):
        files.append((provenance_path(prefix), os.path.basename(provenance_path(prefix))))
    index_dir = index_cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")
    if os.path.isdir(index_dir):
        for entry in sorted(os.listdir(index_dir)):
            if entry.startswith(name + "_") and entry.endswith(INDEX_ARRAYS):
                files.append((os.path.join(index_dir, entry), os.path.join("index-cache", entry)))
    return files


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read_manifest(cache_dir):
    try:
        with open(os.path.join(cache_dir, MANIFEST)) as f:
            manifest = json.load(f)
        return manifest if isinstance(manifest, dict) else {}
    except (OSError, ValueError):  # none yet, or damaged: every file is then verified by copying it again
        return {}


def _write_manifest(cache_dir, manifest):
    path = os.path.join(cache_dir, MANIFEST)
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _intact(entry, stamp, local):
    """The manifest's `entry` was made from the source version `stamp` ({"source", "size", and "mtime_ns" or
    "etag"}) and the local copy still hashes to its digest."""
    return (isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()) and os.path.isfile(local)
            and os.path.getsize(local) == stamp["size"] and sha256_of(local) == entry.get("sha256"))


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _place(local, fill, source, fix):
    """Write `local` through a temporary file that fill(file) writes, returning the SHA-256 of what it wrote;
    the copy is re-read and checked against that digest before it is renamed into place. `fix`: what to do
    when it cannot be written."""
    tmp = f"{local}.tmp.{socket.gethostname()}.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with open(tmp, "wb") as dst:
            digest = fill(dst)
            dst.flush()
            os.fsync(dst.fileno())
        intact = sha256_of(tmp) == digest
    except OSError as exc:
        _remove(tmp)
        if getattr(exc, "strerror", None) is None:  # the source's own one line (a corrupt object, say)
            raise
        raise OSError(f"cannot copy {source} to {local}: {exc.strerror}; {fix}") from None
    if not intact:
        _remove(tmp)
        raise OSError(f"the copy of {source} in {os.path.dirname(local)} reads back differently (a failing local "
                      f"disk?); check the node or set data.local_cache_dir=\"\"")
    os.replace(tmp, local)
    return digest


def _copy(source, local):
    """Copy the shared file `source` to `local`; the SHA-256 of what was read."""
    def fill(dst):
        digest = hashlib.sha256()
        with open(source, "rb") as src:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                dst.write(chunk)
        return digest.hexdigest()
    return _place(local, fill, source, "free space there or set data.local_cache_dir=\"\" to read the shards "
                                       "in place")


def _fetch(shards, file, local):
    """Download one object of `shards` (an S3Shards) to `local`, checked; its SHA-256."""
    return _place(local, lambda dst: shards.download(file, dst), shards.where(file),
                  "free space there or set data.local_cache_dir to a larger local disk")


def _sources(prefix, index_cache_dir):
    """(stamp, path relative to the prefix's local folder, copy(local) -> SHA-256) of each file to cache."""
    if is_s3(prefix):
        shards = S3Shards(prefix)
        return [(shards.stamp(file), file, lambda local, file=file: _fetch(shards, file, local))
                for file in shards.list()]
    out = []
    for source, relative in source_files(prefix, index_cache_dir):
        stat = os.stat(source)
        stamp = {"source": os.path.abspath(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        out.append((stamp, relative, lambda local, source=source: _copy(source, local)))
    return out


def fill_cache(prefixes, cache_dir, index_cache_dir=None):
    """Copy (or verify the copies of) every file of `prefixes` into `cache_dir`; returns a report:
    {"copy_s", "files_copied", "bytes_copied", "files_reused", "bytes_reused"}."""
    start = time.perf_counter()
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create the node-local cache directory {cache_dir}: {exc.strerror}; set "
                      f"data.local_cache_dir to a writable local path") from None
    manifest = _read_manifest(cache_dir)
    report = {"files_copied": 0, "bytes_copied": 0, "files_reused": 0, "bytes_reused": 0}
    for prefix in dict.fromkeys(prefixes):
        folder = os.path.dirname(local_prefix(prefix, cache_dir))
        for stamp, relative, copy in _sources(prefix, index_cache_dir):
            local = os.path.join(folder, relative)
            key = os.path.relpath(local, cache_dir)
            if _intact(manifest.get(key), stamp, local):
                report["files_reused"] += 1
                report["bytes_reused"] += stamp["size"]
                continue
            manifest.pop(key, None)  # an interrupted copy must not leave a stale entry behind
            manifest[key] = {**stamp, "sha256": copy(local)}
            _write_manifest(cache_dir, manifest)
            report["files_copied"] += 1
            report["bytes_copied"] += stamp["size"]
    report["copy_s"] = time.perf_counter() - start
    return report
