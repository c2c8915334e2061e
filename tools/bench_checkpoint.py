"""Checkpoint save/load throughput next to the raw sequential bandwidth of the same disk, in one run.

    python tools/bench_checkpoint.py [--dir /path/on/the/disk] [--hidden 512 --layers 4 --vocab 16000]

Raw write = the same number of bytes written in 16 MiB blocks and fsynced; raw read = reading them back.
Every file is dropped from the page cache (posix_fadvise DONTNEED) after it is written, so reads come
from the disk for both. Prints GB/s (best of --repeat) and the ratio checkpoint / raw (target ≥ 0.5).
"""
from __future__ import annotations

import argparse
import os
import shutil
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

BLOCK = 16 << 20


def drop_cache(path: Path) -> None:
    for f in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_bandwidth(directory: Path, nbytes: int) -> tuple[float, float]:
    path, block = directory / "raw.bin", os.urandom(BLOCK)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, nbytes, BLOCK):
            f.write(block[:min(BLOCK, nbytes - offset)])
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - start)
    drop_cache(path)
    start = time.perf_counter()
    with open(path, "rb") as f:
        got = sum(len(block) for block in iter(lambda: f.read(BLOCK), b""))
    read = nbytes / (time.perf_counter() - start)
    assert got == nbytes, f"read back {got} of {nbytes} bytes"
    path.unlink()
    return write, read


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir here)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--repeat", type=int, default=3, help="measurements per quantity; the best is shown")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir or "."))
    try:
        cfg = load_config(None, [f"run.dir={work / 'run'}", "data.mock=true", f"model.hidden_size={args.hidden}",
                                 f"model.num_layers={args.layers}", f"model.vocab_size={args.vocab}",
                                 "model.num_attention_heads=8", f"model.ffn_hidden_size={args.hidden * 8 // 3}"])
        trainer = Trainer(cfg, DistEnv())
        save_s = load_s = verify_s = blocked_s = float("inf")
        raw_write = raw_read = 0.0
        nbytes = 0
        for _ in range(args.repeat):  # best of N: the disk is shared, the fastest run is the least disturbed
            if nbytes:
                write, read = raw_bandwidth(work, nbytes)
                raw_write, raw_read = max(raw_write, write), max(raw_read, read)
            cfg.checkpoint.async_save = False
            trainer.step += 1
            start = time.perf_counter()
            path = trainer.save_checkpoint()
            save_s = min(save_s, time.perf_counter() - start)
            nbytes = sum(f.stat().st_size for f in path.iterdir())
            drop_cache(path)
            start = time.perf_counter()
            trainer.checkpointer.load(path)
            load_s = min(load_s, time.perf_counter() - start)
            drop_cache(path)
            start = time.perf_counter()
            assert not trainer.checkpointer.problems(path)
            verify_s = min(verify_s, time.perf_counter() - start)
            cfg.checkpoint.async_save = True
            trainer.step += 1
            start = time.perf_counter()
            trainer.save_checkpoint()
            blocked_s = min(blocked_s, time.perf_counter() - start)
            trainer.checkpointer.wait()
        write, read = raw_bandwidth(work, nbytes)
        raw_write, raw_read = max(raw_write, write), max(raw_read, read)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = nbytes / 1e9
    print(f"checkpoint: {gb:.3f} GB ({sum(p.numel() for _, p in trainer.named_params) / 1e6:.1f}M parameters, "
          f"fp32 master + Adam moments) in {work}")
    print(f"raw disk:   write {raw_write / 1e9:.2f} GB/s (fsync)   read {raw_read / 1e9:.2f} GB/s")
    print(f"save:       {gb / save_s:.2f} GB/s   ratio {gb / save_s / (raw_write / 1e9):.2f} of raw write")
    print(f"load:       {gb / load_s:.2f} GB/s   ratio {gb / load_s / (raw_read / 1e9):.2f} of raw read "
          f"(+ SHA-256 verification {gb / verify_s:.2f} GB/s)")
    print(f"async save: training blocked {blocked_s * 1e3:.0f} ms for the snapshot (sync save {save_s * 1e3:.0f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
