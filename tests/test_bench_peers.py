"""tools/bench_peers.py: Trilith and its PyTorch-native peer (tools/peer_train.py) both train on a tiny shape,
the tool prints the table with positive ratios and collective counts, and a side that does not train fails it."""
from __future__ import annotations

import math
import re

import pytest

from tools import bench_peers

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "512",
        "--seq", "32", "--warmup", "1", "--steps", "2", "--rounds", "1", "--lr", "3e-3"]
ROW = re.compile(r"^\| (\w+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+)× \| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| "
                 r"([\d., ]+) \|$", re.MULTILINE)
ROUND = re.compile(r"^round 1 (\w+) +(trilith|peer) .* loss ([\d.]+) -> ([\d.]+) ", re.MULTILINE)


def test_both_sides_train_and_the_table_is_printed(capsys, tmp_path):
    # DTensor with sequence parallelism and the hand-split pipeline: the peer's paths furthest from plain torch
    # (all five modes would take minutes on two cores)
    modes = ["tp_sp", "pp"]
    assert bench_peers.main(TINY + ["--modes", ",".join(modes), "--workdir", str(tmp_path),
                                    "--trilith-set", "parallel.stage_balance=compute"]) == 0
    out = capsys.readouterr().out
    assert "Trilith with parallel.stage_balance=compute" in out.splitlines()[0]
    [pp_log] = tmp_path.glob("bench_peers_*/r0_pp_trilith/log.txt")
    assert "(parallel.stage_balance=compute)" in pp_log.read_text()  # the override reached Trilith's run
    rows = {m.group(1): m.groups()[1:] for m in ROW.finditer(out)}
    assert sorted(rows) == sorted(modes), out
    for mode, (ours, peer, ratio, ours_calls, peer_calls, ours_mb, peer_mb, rounds) in rows.items():
        assert rounds == ratio  # one round: its ratio is the median
        assert float(ratio) > 0 and int(ours.replace(",", "")) > 0 and int(peer.replace(",", "")) > 0, mode
        assert int(ours_calls) > 0 and int(peer_calls) > 0 and float(ours_mb) > 0 and float(peer_mb) > 0, mode
    readings = ROUND.findall(out)
    assert len(readings) == 2 * len(modes), out
    for mode, side, first, last in readings:
        assert abs(float(first) - math.log(512)) < bench_peers.LOSS_TOLERANCE and float(last) < float(first) - 0.06, \
            (mode, side)


def test_a_side_that_does_not_train_fails_the_tool(capsys):
    assert bench_peers.main(TINY + ["--modes", "ddp", "--lr", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Trilith ddp did not train" in err[0] and "last loss" in err[0], err


def test_check_trains_needs_a_uniform_start_and_a_fall():
    bench_peers.check_trains("peer", "tp", [math.log(512) + 0.1, 5.0], 512)
    bench_peers.check_trains("peer", "tp", [math.log(512), math.log(512) - 0.07], 512)
    with pytest.raises(bench_peers.BenchError, match="step-1 loss 9.000"):
        bench_peers.check_trains("peer", "tp", [9.0, 5.0], 512)  # a start far from ln V: not a fresh model
    with pytest.raises(bench_peers.BenchError, match="did not train"):
        bench_peers.check_trains("peer", "tp", [math.log(512), math.log(512) - 0.05], 512)  # batch noise
    with pytest.raises(bench_peers.BenchError, match="1 loss readings"):
        bench_peers.check_trains("peer", "tp", [6.2], 512)


def test_the_table_gives_the_median_of_the_per_round_ratios_and_each_of_them():
    def side(tok_s):
        return {"tokens_per_s": tok_s, "collectives": 4, "bytes": 2e6}
    runs = {"ddp": [(side(1100), side(1000)), (side(900), side(1000)), (side(1050), side(1000))],
            "pp": [(side(1300), side(1000)), (side(900), side(1000)), (side(1000), side(1000))]}
    text, warnings = bench_peers.table(runs)
    rows = {m.group(1): m.groups()[1:] for m in ROW.finditer(text)}
    assert rows["ddp"][2] == "1.05" and rows["ddp"][7] == "1.10, 0.90, 1.05"
    assert rows["pp"][2] == "1.00" and rows["pp"][7] == "1.30, 0.90, 1.00"
    assert [w.split()[1] for w in warnings] == ["pp"]  # 0.40 apart: more than 20% of the median


def test_buffer_bytes_counts_the_full_buffer_of_each_collective():
    gather = {"Input Dims": [[2000], [1000], [], [], []], "Input type": ["float", "float", "", "Scalar", "Scalar"]}
    assert bench_peers.buffer_bytes(gather) == 8000  # the gathered output, not the shard
    reduce = {"Input Dims": [[[1000]], [], [], [], [], []],
              "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"]}
    assert bench_peers.buffer_bytes(reduce) == 4000
    assert bench_peers.buffer_bytes({"Input Dims": [[4, 8]], "Input type": ["c10::BFloat16"]}) == 64


@pytest.mark.parametrize("argv, message", [
    (["--modes", "zero3,fsdp"], "unknown fsdp"),
    (["--batch", "7"], "multiple of --nproc"),
    (["--warmup", "0"], "at least 1"),
    (["--trilith-set", "parallel.stage_balance"], "is not KEY=VALUE"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_peers.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_zero_bubble_case_trains_on_both_sides(capsys, tmp_path):
    """Trilith's ZBV against torch's ScheduleZBVZeroBubble, two stages per rank as a V (one layer each): both
    train, and Trilith sends each of the 8 micro-batches' activations and gradients across the V's 2p − 2 = 2
    rank boundaries: 32 (1F1B would send 16, a looped placement 48)."""
    argv = TINY + ["--modes", "zbv", "--layers", "4", "--steps", "3", "--workdir", str(tmp_path)]
    assert bench_peers.main(argv) == 0
    out = capsys.readouterr().out
    [row] = [m.groups() for m in ROW.finditer(out)]
    assert row[0] == "zbv" and float(row[3]) > 0, out
    readings = ROUND.findall(out)
    assert len(readings) == 2, out
    for mode, side, first, last in readings:
        assert abs(float(first) - math.log(512)) < bench_peers.LOSS_TOLERANCE and float(last) < float(first) - 0.06
    sends = dict(re.findall(r"^round 1 zbv +(trilith|peer) .*send (\d+)\)$", out, re.MULTILINE))
    # the peer's first step also sends its stages' shapes (its profiled step here is the first)
    assert sends["trilith"] == "32" and int(sends["peer"]) >= 32, out
