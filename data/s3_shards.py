"""Token shards in an object store: a data.paths entry s3://bucket/dir/web names the objects dir/web.idx and
dir/web.bin (or .arrow), and dir/web.prov.npz when there is one, as tools/preprocess_data.py wrote them.

They are only ever read through the node-local cache (data/local_cache.py), which fetches each object once
per node and checks it. The rule for an object's bytes:
- its size must equal the size the store lists for it;
- when the sidecar dir/web.sha256 exists (`sha256sum web.idx web.bin > web.sha256`: one "<hex>  <name>" line a
  file), the object's SHA-256 must equal its line, and every shard file must have one;
- without a sidecar, the object's ETag must be the MD5 of what was read. That holds for an object uploaded in
  one part; one uploaded in parts has an ETag ("<hex>-N") that is no checksum of its bytes, and is refused
  unless a sidecar vouches for it.
An object is fetched again when its size or ETag changed since the cached copy was made.
"""
from __future__ import annotations

import io
import re

from data.s3_client import S3Error, client, describe, split_url, stream

SETTING = "data.paths"  # the key that names a bucket, for one that does not exist
SIDECAR = ".sha256"
SHARD_ENDINGS = (".idx", ".bin", ".arrow", ".prov.npz")
PLAIN_MD5 = re.compile(r"^[0-9a-f]{32}$")


def is_s3(prefix) -> bool:
    return str(prefix).startswith("s3://")


class S3Shards:
    """The objects of one dataset prefix s3://bucket/dir/name. Every failure raises S3Error with one line."""

    def __init__(self, url: str, s3=None):
        self.url = url.rstrip("/")
        self.bucket, key = split_url(self.url)
        self.dir, _, self.name = key.rpartition("/")
        self.s3 = s3
        self.objects: dict[str, dict] = {}  # file name (web.bin) -> {"size", "etag"}
        self.files: list[str] = []  # the shard files to fetch
        self.sums: dict[str, str] | None = None  # file name -> SHA-256 from the sidecar, read on first download

    def key(self, file: str) -> str:
        return f"{self.dir}/{file}" if self.dir else file

    def where(self, file: str) -> str:
        return f"s3://{self.bucket}/{self.key(file)}"

    def list(self) -> list[str]:
        """List the prefix's objects; the shard files to fetch, in order. Raises S3Error for a bucket or prefix
        that is not there, or credentials the store refuses."""
        self.s3 = self.s3 or client()
        wanted = {self.name + end for end in (*SHARD_ENDINGS, SIDECAR)}
        try:
            pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.key(self.name))
            for page in pages:
                for obj in page.get("Contents", []):
                    file = obj["Key"].rpartition("/")[2]
                    if file in wanted:
                        self.objects[file] = {"size": obj["Size"], "etag": obj.get("ETag", "").strip('"')}
        except Exception as exc:  # botocore's client and connection errors
            raise S3Error(describe(exc, f"{SETTING}: {self.url} (bucket {self.bucket})", SETTING)) from exc
        tokens = [self.name + end for end in (".bin", ".arrow") if self.name + end in self.objects]
        if self.name + ".idx" not in self.objects or not tokens:
            missing = self.name + (".bin" if self.name + ".idx" in self.objects else ".idx")
            raise S3Error(f"{SETTING}: {self.where(missing)} does not exist; an s3:// entry must name a prefix "
                          f"whose .idx and .bin (from tools/preprocess_data.py) were uploaded beside each other")
        self.files = [self.name + ".idx", *tokens] + [f for f in (self.name + ".prov.npz",) if f in self.objects]
        return self.files

    def _read_sidecar(self) -> dict[str, str]:
        sidecar = self.name + SIDECAR
        if sidecar not in self.objects:
            return {}
        body = io.BytesIO()
        self._stream(sidecar, body)
        sums = {}
        for line in body.getvalue().decode(errors="replace").splitlines():
            digest, _, file = line.strip().partition(" ")
            sums[file.strip().lstrip("*").rpartition("/")[2]] = digest.lower()  # sha256sum's "*" = binary mode
        unlisted = [f for f in self.files if not re.fullmatch(r"[0-9a-f]{64}", sums.get(f, ""))]
        if unlisted:
            raise S3Error(f"{SETTING}: {self.where(sidecar)} has no SHA-256 line for {', '.join(unlisted)}; "
                          f"write it again: sha256sum {' '.join(self.files)} > {sidecar}")
        return sums

    def _stream(self, file: str, sink) -> list[str]:
        try:
            return stream(self.s3, self.bucket, self.key(file), sink, SETTING, ("sha256", "md5"))
        except S3Error as exc:
            raise S3Error(f"{SETTING}: {exc}") from exc

    def stamp(self, file: str) -> dict:
        """What identifies this version of the object: a cached copy made from another is fetched again."""
        return {"source": self.where(file), "size": self.objects[file]["size"], "etag": self.objects[file]["etag"]}

    def download(self, file: str, sink) -> str:
        """Stream one object into `sink` and check it (the rule above); its SHA-256."""
        if self.sums is None:
            self.sums = self._read_sidecar()
        expected = self.objects[file]
        etag = expected["etag"]
        if file not in self.sums and not PLAIN_MD5.match(etag):
            raise S3Error(f"{SETTING}: {self.where(file)} was uploaded in parts, so its ETag is no checksum of its "
                          f"bytes; upload {self.name}{SIDECAR} beside it (sha256sum {' '.join(self.files)} > "
                          f"{self.name}{SIDECAR})")
        sha256, md5 = self._stream(file, sink)
        size = sink.tell()
        if size != expected["size"]:
            raise S3Error(f"{SETTING}: {self.where(file)} read {size} bytes, the store lists {expected['size']}; "
                          f"a connection cut short? run again")
        if file in self.sums and sha256 != self.sums[file]:
            raise S3Error(f"{SETTING}: {self.where(file)}'s SHA-256 differs from {self.name}{SIDECAR}'s: a corrupt "
                          f"object; upload it again (or the sidecar, if the shard changed)")
        if file not in self.sums and md5 != etag:
            raise S3Error(f"{SETTING}: {self.where(file)}'s MD5 differs from its ETag: a corrupt object or "
                          f"transfer; upload it again, with a {self.name}{SIDECAR} sidecar")
        return sha256
