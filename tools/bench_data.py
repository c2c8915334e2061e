"""Read speed of packed training samples from plain (.bin) and zstd-compressed (.arrow) token shards.

    python tools/bench_data.py --prefix demo_out/data/stdlib_text_document [--seq-length 4096]
    python tools/bench_data.py                     # a synthetic Zipf-distributed corpus of 8M tokens

Both kinds are made from the same tokens in a temporary directory (`merge`, as a user converts), then
the train split is read in training order (Megatron's shuffled, packed samples: what every data-parallel
rank's loader does) for `--seconds` each, one process. Printed: samples/s and tokens/s for each kind,
the compressed speed as a ratio of the plain baseline, the size on disk and the compression ratio, and
the headroom over a GPU's appetite: tokens/s that one H100/H200 consumes training a ~1B model at 45% MFU
(FLOPs per token 6N + 12·L·H·S, 989 TFLOP/s peak). The samples of both kinds are checked to be identical.
"""
import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from data.indexed import DEFAULT_BLOCK_TOKENS, IndexedDatasetBuilder, token_files  # noqa: E402
from data.loader import build_datasets  # noqa: E402
from tools.preprocess_data import merge  # noqa: E402

GPU_PEAK_FLOPS, GPU_MFU = 989e12, 0.45
ONE_B = dict(params=1.24e9, layers=16, hidden=2048)  # Llama-3.2-1B, the tools/bench_gpu.py shape


def gpu_tokens_per_second(seq_length):
    flops_per_token = 6 * ONE_B["params"] + 12 * ONE_B["layers"] * ONE_B["hidden"] * seq_length
    return GPU_PEAK_FLOPS * GPU_MFU / flops_per_token


def synthetic(prefix, tokens, seed=0):
    """Zipf-distributed ids (as natural text's are) in documents of 50-5,000 tokens, uint16."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    written = 0
    while written < tokens:
        lengths = rng.integers(50, 5000, 256)
        ids = np.minimum(rng.zipf(1.2, int(lengths.sum())), 50000) - 1
        builder.add_documents(ids, lengths)
        written += int(lengths.sum())
    builder.finalize()


def read_for(dataset, seconds, limit):
    """Samples read in training order within `seconds` (at most `limit`), and the elapsed time."""
    start, n = time.perf_counter(), 0
    while n < limit and time.perf_counter() - start < seconds:
        dataset[n]
        n += 1
    return n, time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", help="an existing dataset prefix (either kind); default: a synthetic corpus")
    p.add_argument("--synthetic-tokens", type=int, default=8_000_000)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    p.add_argument("--seconds", type=float, default=5.0, help="reading time per kind")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = args.prefix
        if source is None:
            source = os.path.join(tmp, "synthetic")
            synthetic(source, args.synthetic_tokens)
        plain, packed = os.path.join(tmp, "plain"), os.path.join(tmp, "zstd")
        merge([source], plain)
        merge([source], packed, "zstd", args.block_tokens)
        results = {}
        for name, prefix in (("plain .bin", plain), ("zstd .arrow", packed)):
            dataset = build_datasets([prefix], args.seq_length, seed=1234, cache_dir=tmp)["train"]
            n, elapsed = read_for(dataset, args.seconds, len(dataset))
            size = os.path.getsize(token_files(prefix)[0])
            results[name] = (dataset, n / elapsed, size)
        (plain_ds, plain_rate, plain_size), (packed_ds, packed_rate, packed_size) = results.values()
        for i in np.linspace(0, len(plain_ds) - 1, 50).astype(int):
            assert np.array_equal(plain_ds[i], packed_ds[i]), f"sample {i} differs between the two kinds"
        appetite = gpu_tokens_per_second(args.seq_length)
        print(f"# {len(plain_ds):,} train samples of {args.seq_length + 1} tokens; one process; "
              f"blocks of {args.block_tokens:,} tokens")
        print("| shards | MB on disk | samples/s | tokens/s | vs plain | × one GPU's need |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, (_, rate, size) in results.items():
            tokens = rate * (args.seq_length + 1)
            print(f"| {name} | {size / 1e6:,.1f} | {rate:,.0f} | {tokens:,.0f} | {rate / plain_rate:.2f}x | "
                  f"{tokens / appetite:,.0f}x |")
        print(f"compression {plain_size / packed_size:.2f}:1; one GPU training a ~1B model at {GPU_MFU:.0%} MFU "
              f"needs {appetite:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
