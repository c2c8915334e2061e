"""tools/bench_goodput.py: the failures it counts, the steps lost and the tiers it reads from rank 0's train.log, on
a written log and on one real launch at the tiny shape (rank 1 killed at step 3, snapshots every 2 steps: one
restart from memory, one step lost). The goodput itself is measured in docs/benchmarks.md, not asserted."""
import json
import os
import shutil
import subprocess

import pytest

from tests.helpers import tool
from tools.bench_goodput import ColdDisk, attempts, failures, summary

BANNER = "Trilith: 2 ranks = TP 1 × PP 1 × DP 2 on cpu"
LOG = f"""2026-12-06 03:00:00,000 {BANNER}
2026-12-06 03:00:01,000 step      1 | loss 5.5 | lr 1e-3 | grad_norm 1.0
2026-12-06 03:00:02,000 step      2 | loss 5.4 | lr 1e-3 | grad_norm 1.0
2026-12-06 03:00:03,000 step      3 | loss 5.3 | lr 1e-3 | grad_norm 1.0
2026-12-06 03:00:20,000 {BANNER}
2026-12-06 03:00:21,500 step      1 | loss 5.5 | lr 1e-3 | grad_norm 1.0
2026-12-06 03:00:22,500 step      2 | loss 5.4 | lr 1e-3 | grad_norm 1.0
2026-12-06 03:00:23,500 step      3 | loss 5.3 | lr 1e-3 | grad_norm 1.0
2026-12-06 03:00:24,500 step      4 | loss 5.2 | lr 1e-3 | grad_norm 1.0
2026-12-06 03:00:25,500 step      5 | loss 5.1 | lr 1e-3 | grad_norm 1.0
2026-12-06 03:00:45,000 {BANNER}
2026-12-06 03:00:45,250 recovery: from the disk checkpoint (checkpoint.memory_interval=0) at step 4: \
steps lost unknown, 0.250 s
2026-12-06 03:00:46,500 step      5 | loss 5.1 | lr 1e-3 | grad_norm 1.0
2026-12-06 03:00:50,000 {BANNER}
2026-12-06 03:00:50,100 recovery: from memory (partner copies for rank 1) at step 5: 0 steps lost, 0.050 s + 0.020 s \
snapshot set-up
"""


def test_each_restart_is_read_with_its_tier_steps_lost_and_times():
    got = failures(attempts(LOG))
    assert [(f["failed_after"], f["resumed_at"], f["lost"], f["tier"], f["stated_lost"]) for f in got] == [
        (3, 0, 3, "fresh start", None), (5, 4, 1, "disk", None), (5, 5, 0, "memory", 0)]
    assert [f["restore_s"] for f in got] == [0.0, 0.25, 0.05]
    assert [f["setup_s"] for f in got] == [0.0, 0.0, 0.02]  # the snapshots' set-up the line states beside it
    assert [round(f["restart_s"], 3) for f in got] == [18.5, 19.75, 3.6]  # last step → recovery line (or first step)


def test_the_summary_judges_the_goals_from_the_numbers():
    class Args:
        shape, nproc, steps, rank, fail_every, checkpoint_interval, memory_interval = "tiny", 2, 10, 1, 3, 4, 2
        disk_cache = "cold"

    def result(mode, lost, tier, restore, setup=0.0):
        fails = [{"lost": lost, "tier": tier, "restore_s": restore, "setup_s": setup, "restart_s": 20.0}]
        return {"mode": mode, "round": 1, "memory_interval": 2 if mode == "memory" else 0, "wall_s": 50.0,
                "cpu_s": 60.0, "load": [1.0, 2.0], "steps": 10,
                "goodput_steps_per_s": 0.2, "useful_share": 0.2, "step_s": 1.0, "failures": fails,
                "redone_equal": True, "curve": {1: (5.0, 1.0)}}
    lines = summary(Args, [result("disk", 3, "disk", 0.4), result("memory", 1, "memory", 0.1, setup=0.1)])
    assert "steps lost per failure with snapshots: at most 1 (goal ≤ memory_interval=2: met)" in lines
    assert ("restore from memory 0.100 s, from the disk checkpoint 0.400 s (medians of 1 and 1): 4.0× (goal ≥ 3×: met)"
            in lines)
    assert "with each start's snapshot set-up counted in: 0.200 s and 0.400 s: 2.0×" in lines
    slow_once = [result("memory", 1, "memory", restore) for restore in (0.1, 0.9, 0.1)]
    lines = summary(Args, [result("disk", 3, "disk", 0.4)] + slow_once)  # a mean (0.37 s) would say 1.1×
    assert ("restore from memory 0.100 s, from the disk checkpoint 0.400 s (medians of 3 and 1): 4.0× (goal ≥ 3×: met)"
            in lines)
    lines = summary(Args, [result("disk", 3, "disk", 0.2), result("memory", 3, "memory", 0.1)])
    assert "steps lost per failure with snapshots: at most 3 (goal ≤ memory_interval=2: MISSED)" in lines
    assert ("restore from memory 0.100 s, from the disk checkpoint 0.200 s (medians of 1 and 1): 2.0× "
            "(goal ≥ 3×: MISSED)") in lines


def test_interleaved_rounds_give_each_rounds_step_time_ratio():
    class Args:
        shape, nproc, steps, rank, fail_every, checkpoint_interval, memory_interval = "tiny", 2, 10, 1, 0, 0, 1
        disk_cache = "warm"

    def result(mode, n, step_s):
        return {"mode": mode, "round": n, "memory_interval": 1 if mode == "memory" else 0, "wall_s": 50.0,
                "cpu_s": 60.0, "load": [1.0, 2.0], "steps": 10, "goodput_steps_per_s": 0.2, "useful_share": 0.2,
                "step_s": step_s, "failures": [], "redone_equal": True, "curve": {1: (5.0, 1.0)}}
    lines = summary(Args, [result("disk", 1, 1.0), result("memory", 1, 1.1), result("disk", 2, 2.0),
                           result("memory", 2, 2.0), result("disk", 3, 1.0), result("memory", 3, 1.02)])
    assert lines[0].endswith("checkpoint.interval=0, disk cache warm")
    assert "median step time with snapshots every 1 and without: round 1: 1.100 s against 1.000 s (+10.0%), round 2: " \
           "2.000 s against 2.000 s (+0.0%), round 3: 1.020 s against 1.000 s (+2.0%); median of the rounds +2.0%" \
           in lines, lines
    assert "same loss and gradient norm at every step in both modes: yes" in lines


@pytest.mark.skipif(not shutil.which("fincore"), reason="util-linux fincore counts a file's pages in the cache")
def test_cold_disk_evicts_each_committed_checkpoint_once(tmp_path):
    """A committed checkpoint (its manifest written) leaves the page cache; one still being written does not."""
    def cached(path):
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[0])
    committed, pending = tmp_path / "checkpoints" / "step_00000004", tmp_path / "checkpoints" / ".tmp-step_00000008"
    for d in (committed, pending):
        d.mkdir(parents=True)
        (d / "rank.safetensors").write_bytes(os.urandom(1 << 20))
    (committed / "manifest.json").write_text("{}")
    assert cached(committed / "rank.safetensors") == 1 << 20
    cold = ColdDisk(tmp_path)
    cold.sweep()
    cold.sweep()
    assert cold.seen == {"step_00000004"} and cold.bytes == (1 << 20) + 2
    assert cached(committed / "rank.safetensors") == 0 and cached(pending / "rank.safetensors") == 1 << 20


def test_a_killed_rank_costs_at_most_memory_interval_steps(tmp_path):
    out = tool("tools/bench_goodput.py", "--shape", "tiny", "--modes", "memory", "--steps", "5", "--fail-every", "3",
               "--checkpoint-interval", "0", "--memory-interval", "2", "--dir", tmp_path, "--json",
               tmp_path / "goodput.json", timeout=600)
    (result,) = json.loads((tmp_path / "goodput.json").read_text())
    (failure,) = result["failures"]
    assert (failure["failed_after"], failure["resumed_at"], failure["lost"], failure["stated_lost"],
            failure["tier"]) == (3, 2, 1, 1, "memory"), failure
    assert 0 < failure["restore_s"] < failure["restart_s"], failure
    assert result["faults_fired"] == 1 and result["reached"] == 5 and result["redone_equal"], result
    assert abs(result["goodput_steps_per_s"] - 5 / result["wall_s"]) < 1e-9
    assert "steps lost per failure with snapshots: at most 1 (goal ≤ memory_interval=2: met)" in out, out
    assert "steps trained twice gave the same values both times: yes" in out, out
