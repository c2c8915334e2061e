"""An S3-compatible object store as a checkpoint location: `s3://bucket/prefix`, through boto3 (the client and
its configuration from the environment: data/s3_client.py).

Every object is verified against the manifest's SHA-256 by reading it back: a server's own checksum is not
enough (`rclone serve s3` stores a client's ChecksumSHA256 without checking it, and an ETag is an MD5, of
parts for multipart uploads on AWS). Uploads are multipart with parallel parts; memory is bounded by
parts in flight × part size (boto3's TransferConfig).
"""
from __future__ import annotations

import os
from pathlib import Path

from data.s3_client import S3Error, client, split_url, stream
from data.s3_client import describe as describe_request
from engine.checkpoint.files import CheckpointError

PROBE = ".trilith-write-check"  # the object the pre-start check writes and deletes
SETTING = "checkpoint.mirrors"  # the key that names a bucket, for one that does not exist


def describe(exc: BaseException, where: str) -> str:
    return describe_request(exc, where, SETTING)


class S3Store:
    """Objects under one bucket and prefix; every method raises CheckpointError with one line on failure."""

    def __init__(self, url: str, part_mb: int = 64, threads: int = 4):
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_url(url)
        self.part_mb, self.threads = part_mb, threads
        self._s3 = None

    def __getstate__(self) -> dict:  # to the copy process (copy_process.py): a client is made there anew
        return {**self.__dict__, "_s3": None}

    @property
    def s3(self):
        if self._s3 is None:
            try:
                self._s3 = client()
            except S3Error as exc:
                raise CheckpointError(str(exc)) from None
        return self._s3

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def where(self, *parts: str) -> str:
        return f"s3://{self.bucket}/{self.key(*parts)}"

    def _call(self, what: str, fn, *args, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            return fn(*args, **kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise CheckpointError(describe(exc, what)) from exc

    # ---- checks ------------------------------------------------------------------------------------------
    def check_writable(self) -> None:
        """The bucket exists, the credentials are accepted, and an object can be written and deleted."""
        self._call(f"{self.url} (bucket {self.bucket})", self.s3.head_bucket, Bucket=self.bucket)
        self._call(f"{self.url} (writing)", self.s3.put_object, Bucket=self.bucket, Key=self.key(PROBE), Body=b"")
        self._call(f"{self.url} (deleting)", self.s3.delete_object, Bucket=self.bucket, Key=self.key(PROBE))

    # ---- objects ---------------------------------------------------------------------------------------------
    def upload(self, path: Path, *parts: str, sha256: str) -> None:
        """One file, multipart with parallel parts, then read back and hashed against `sha256`."""
        from boto3.s3.transfer import TransferConfig
        size = self.part_mb << 20
        config = TransferConfig(multipart_threshold=size, multipart_chunksize=size, max_concurrency=self.threads)
        where = self.where(*parts)
        self._call(f"uploading {where}", self.s3.upload_file, str(path), self.bucket, self.key(*parts),
                   Config=config)
        if self.sha256(*parts) != sha256:
            raise CheckpointError(f"{where}: read back, its SHA-256 differs from the manifest's (the store changed "
                                  f"the bytes)")

    def put_bytes(self, data: bytes, *parts: str) -> None:
        self._call(f"writing {self.where(*parts)}", self.s3.put_object, Bucket=self.bucket, Key=self.key(*parts),
                   Body=data)
        if self.get_bytes(*parts) != data:
            raise CheckpointError(f"{self.where(*parts)}: read back, it differs from what was written")

    def get_bytes(self, *parts: str) -> bytes | None:
        """An object's bytes; None when it does not exist."""
        from botocore.exceptions import ClientError
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self.key(*parts))["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise CheckpointError(describe(exc, f"reading {self.where(*parts)}")) from exc
        except Exception as exc:  # botocore's connection errors
            raise CheckpointError(describe(exc, f"reading {self.where(*parts)}")) from exc

    def _stream(self, parts: tuple, sink) -> str:
        """Read an object in blocks into `sink` (or nowhere), hashing them; its SHA-256."""
        try:
            return stream(self.s3, self.bucket, self.key(*parts), sink, SETTING)[0]
        except S3Error as exc:
            raise CheckpointError(str(exc)) from exc

    def sha256(self, *parts: str) -> str:
        return self._stream(parts, None)

    def download(self, dest: Path, *parts: str) -> str:
        """Stream an object to `dest` (fsynced); its SHA-256."""
        with open(dest, "wb") as f:
            digest = self._stream(parts, f)
            f.flush()
            os.fsync(f.fileno())
        return digest

    def sizes(self, *parts: str) -> dict[str, int]:
        """{key relative to prefix/parts: size} of every object below."""
        base = self.key(*parts)
        base = base + "/" if base else ""
        out = {}
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base)
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            for page in pages:
                for obj in page.get("Contents", []):
                    out[obj["Key"][len(base):]] = obj["Size"]
        except (BotoCoreError, ClientError) as exc:
            raise CheckpointError(describe(exc, f"listing {self.where(*parts)}")) from exc
        return out

    def delete_below(self, *parts: str) -> None:
        keys = [self.key(*parts, k) for k in self.sizes(*parts)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            self._call(f"deleting {self.where(*parts)}", self.s3.delete_objects, Bucket=self.bucket,
                       Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True})
