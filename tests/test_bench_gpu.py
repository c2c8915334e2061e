"""tools/bench_gpu.py runs end to end (tiny shape on CPU) and prints one well-formed row per configuration."""
import json
import subprocess
import sys

from tests.helpers import ROOT


def test_bench_gpu_tiny_prints_its_table(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "tools/bench_gpu.py", "--tiny", "--steps", "1", "--warmup", "0",
                           "--accum", "1", "--attention", "reference", "sdpa", "cudnn", "flash", "--recompute", "none",
                           "full", "--loss", "chunked", "fused", "--profile", "3", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].split(" | ")[0] == "| attention" and rows[1].startswith("| ---")
    table = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]
    assert len(table) == 4 * 2 * 2 * 2  # attention × norm × recompute × loss
    assert all(len(cells) == 10 for cells in table)
    assert table[0][:5] == ["reference", "torch", "none", "no", "chunked"] and table[0][9] == "1.00x"
    measured = [cells for cells in table if not cells[5].startswith("skipped")]
    assert {tuple(c[:3]) + (c[4],) for c in measured} >= {("sdpa", "torch", "none", "fused"),
                                                          ("reference", "torch", "full", "chunked")}
    for cells in measured:
        assert float(cells[5].replace(",", "")) > 0 and cells[9].endswith("x")
    skipped = [cells for cells in table if cells[5].startswith("skipped")]
    assert all(c[0] in ("flash", "cudnn") or c[1] == "apex" for c in skipped)
    assert len(json.loads(out.read_text())) == len(measured)
    lines = done.stdout.splitlines()
    profiles = [i for i, line in enumerate(lines) if line.startswith("  profile of 2 steps: CPU operators")]
    assert len(profiles) == len(measured)  # one profile after every measured row, with its 3 costliest ops
    for i in profiles:
        assert lines[i - 1].startswith("| ") and "matmul" in lines[i] and "% of " in lines[i]
        assert all(lines[i + k].strip().split()[0].endswith("%") for k in (1, 2, 3))
