"""The boto3 client for s3://bucket/prefix URLs, shared by the token shards (data/s3_shards.py) and the
checkpoint locations (engine/checkpoint/s3_store.py), which may import data/ but not the other way round.

The client is configured as S3 users expect, never from Trilith's config: AWS_ENDPOINT_URL (or
AWS_ENDPOINT_URL_S3) for a store that is not AWS, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or AWS_PROFILE
with ~/.aws/config and ~/.aws/credentials. No credential is ever logged or written anywhere.
"""
from __future__ import annotations

import hashlib
import logging
import urllib.parse

CHUNK = 16 << 20  # bytes read per block when streaming an object


class S3Error(OSError):
    """One line naming the object or URL and the variable or setting that fixes it."""


def split_url(url: str) -> tuple[str, str]:
    """('bucket', 'prefix') of s3://bucket/prefix (the prefix without its trailing slash)."""
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


def credentials_hint() -> str:
    return "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for a store " \
           "that is not AWS"


def client(max_attempts: int = 2):
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise S3Error("s3:// URLs need boto3: pip install boto3 (the s3 extra: pip install -e '.[s3]')") from None
    # botocore says at INFO where it found the credentials and the endpoint: noise in every rank's log.
    logging.getLogger("botocore").setLevel(max(logging.WARNING, logging.getLogger("botocore").level))
    # The callers retry with their own back-off and a warning each; boto3's own retries stay few and quick.
    config = Config(retries={"max_attempts": max_attempts, "mode": "standard"}, connect_timeout=5, read_timeout=30)
    return boto3.session.Session().client("s3", config=config)


def describe(exc: BaseException, where: str, setting: str) -> str:
    """One line for a failed request: what failed and which variable fixes it (`setting`: the config key that
    named the bucket, for a bucket that does not exist)."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
    if isinstance(exc, NoCredentialsError):
        return f"{where}: no S3 credentials found; {credentials_hint()}"
    if isinstance(exc, EndpointConnectionError):
        url = urllib.parse.urlsplit(str(exc.kwargs.get("endpoint_url", "")))
        return f"{where}: cannot reach the S3 endpoint {url.scheme}://{url.netloc}; check that the store is " \
               f"up and that AWS_ENDPOINT_URL names it"
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchBucket",) or (code == "404" and "bucket" in where):
            return f"{where}: the bucket does not exist; create it, or name another in {setting}"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403") or status == 403:
            return f"{where}: the store refused the credentials ({code}); {credentials_hint()}"
        return f"{where}: {code or status} {exc.response.get('Error', {}).get('Message', '')}".strip()
    return f"{where}: {type(exc).__name__}: {exc}"


def stream(s3, bucket: str, key: str, sink, setting: str, algorithms=("sha256",)) -> list[str]:
    """Read one object in CHUNK blocks into `sink` (a file, or None), hashing them; the hex digests in the
    order of `algorithms`. Raises S3Error with describe()'s line."""
    digests = [hashlib.new(name) for name in algorithms]
    where = f"reading s3://{bucket}/{key}"
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"]
        while block := body.read(CHUNK):
            for digest in digests:
                digest.update(block)
            if sink is not None:
                sink.write(block)
    except Exception as exc:  # botocore's request, connection and read errors
        raise S3Error(describe(exc, where, setting)) from exc
    return [digest.hexdigest() for digest in digests]
