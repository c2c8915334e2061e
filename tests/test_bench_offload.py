"""tools/bench_offload.py --accum K --overlap false,auto: each overlap setting timed at each fraction, with K
micro-batches per step; --step-repeats R: the optimizer step alone, under ZeRO and DDP (the ratios themselves are
measured in docs/benchmarks.md, not asserted)."""
import re

from tests.helpers import tool


def test_bench_offload_compares_overlap_settings_with_accumulation():
    out = tool("tools/bench_offload.py", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn",
               "64", "--vocab", "64", "--seq", "16", "--batch", "1", "--accum", "3", "--steps", "2", "--warmup", "1",
               "--fractions", "1", "--overlap", "false,auto")
    assert "batch 1 × 3 micro-batches" in out
    for variant in ("0", "1, overlap false", "1, overlap auto"):
        assert re.search(rf"^optimizer step at offload_fraction {variant}: median [\d.]+ ms \(ratio [\d.]+\)", out, re.M)
    # a CPU device computes on the host's cores, so auto does not speculate there: it is overlap false
    assert re.search(r"^offload_fraction 1, overlap auto: host AdamW", out, re.M) is None


def test_bench_offload_times_the_optimizer_step_alone_on_restored_gradients():
    for stage in ("1", "0"):  # ZeRO units' gradient shards; DDP parameters' .grad
        out = tool("tools/bench_offload.py", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                   "--ffn", "64", "--vocab", "64", "--seq", "16", "--batch", "1", "--steps", "2", "--warmup", "1",
                   "--fractions", "1", "--clip", "0.01", "--zero-stage", stage, "--step-repeats", "3")
        for variant in ("0", "1"):
            assert re.search(rf"^optimizer step alone \(3 repeats\) at offload_fraction {variant}: median [\d.]+ ms "
                             rf"\(ratio [\d.]+\), fastest", out, re.M), out
