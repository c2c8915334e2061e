"""tools/bench_train.py runs and reports both throughputs and their ratio (speed itself is not asserted)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_train_prints_ratio():
    out = subprocess.run([sys.executable, "tools/bench_train.py", "--hidden", "32", "--layers", "1", "--heads", "2",
                          "--kv-heads", "1", "--ffn", "64", "--vocab", "64", "--seq", "16", "--batch", "2",
                          "--steps", "2", "--warmup", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^trilith\s+[\d,]+ tokens/s$", out.stdout, re.M)
    assert re.search(r"^transformers\s+[\d,]+ tokens/s$", out.stdout, re.M)
    assert float(re.search(r"ratio trilith/transformers: ([\d.]+)", out.stdout).group(1)) > 0
