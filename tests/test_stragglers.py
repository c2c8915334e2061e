"""Stragglers (engine/observe/stragglers.py) and the pre-flight's sniff test (engine/observe/rank_sniff.py) on 8 CPU ranks: a
pipeline whose last stage is heavier by design raises no alarm; a rank slowed by a sleep in its forward/backward
on two steps is named first, with its host, whatever its stage and the layout — against the ranks doing its
work, or against its own history when no other rank does it; one step behind is no alarm; the other ranks show
the delay as communication wait; metrics.jsonl holds the per-rank table at every timed step whatever
train.log_interval says. The sniff names the rank slow at its matmul or its all-reduce."""
import os
import time
from types import SimpleNamespace

import pytest
import torch

from engine.config.schema import ConfigError, load_config, validate
from engine.observe import rank_sniff
from engine.observe.metrics import MetricsLog
from engine.observe.stragglers import COLUMNS, MIN_HISTORY, StepTimer, work_of
from parallel import comm
from parallel.distributed import node_name
from tests.distributed import worker_pools
from tests.helpers import TINY, read_metrics, tiny_trainer

DELAY = 0.3  # a slow GPU or a busy host: one rank's compute takes this much longer
HEAVY = 0.15  # the last stage's output layer and loss, made costly enough to stand out of tiny steps' noise
STEPS = MIN_HISTORY + 2  # slowed on the last two steps (seen behind, then confirmed), after every rank has a history


@pytest.fixture(scope="module")
def pool():
    with worker_pools(8) as made:
        yield made[8]


def timed_run(rank, world, run_dir, layout, slow_ranks, delay, from_step):
    """Train STEPS steps, every one timed, sleeping `delay` in the forward/backward of `slow_ranks` from
    `from_step` on; returns the records and the warnings."""
    trainer = tiny_trainer(*layout, f"run.dir={run_dir}", f"train.steps={STEPS}", "train.log_interval=10",
                           "run.timing_interval=1", "run.health_interval=0", rank=rank, world=world, validated=True)
    if rank in slow_ranks:
        forward_backward = trainer.forward_backward

        def slow(micro_batches):
            if trainer.step + 1 >= from_step:
                time.sleep(delay)
            return forward_backward(micro_batches)
        trainer.forward_backward = slow
    warnings = []
    trainer.step_timer.console = warnings.append
    metrics = MetricsLog(run_dir, enabled=rank == 0, console=lambda line: None)
    try:
        records = trainer.train(metrics)
    finally:
        metrics.close()
        trainer.loader.close()
    return records, warnings


def test_a_pipeline_with_a_heavier_last_stage_raises_no_alarm(pool, tmp_path):
    # PP2 × DP4 (ranks 4-7 are the last stage), 1 layer against 3, and the output layer made slow on purpose
    results = pool.run(timed_run, str(tmp_path), ["parallel.pipeline=2", "parallel.stage_layers=[1,3]"],
                       {4, 5, 6, 7}, HEAVY, 1)
    records = results[0][0]
    assert all(min(r["rank_times"]["compute_s"][4:]) >= HEAVY for r in records)  # heavier on every step
    assert [r.get("stragglers") for r in records] == [None] * STEPS
    assert all(w == [] for _, w in results)
    assert records[-1]["rank_times"]["work"] == ["embedding + 1 layers"] * 4 + ["3 layers + output layer"] * 4


@pytest.mark.parametrize("layout, slow", [
    (["parallel.pipeline=2"], 0),  # PP2 × DP4, first stage
    (["parallel.tensor=2", "parallel.pipeline=2"], 5),  # TP2 × PP2 × DP2 (the demo), last stage
    (["parallel.pipeline=4"], 3),  # PP4 × DP2, a middle stage
    (["parallel.pipeline=8", "model.num_layers=8"], 7),  # PP8: the output layer's stage has no peer
], ids=["pp2xdp4", "tp2xpp2xdp2", "pp4xdp2", "pp8"])
def test_a_slowed_rank_is_named_first_with_its_host(pool, tmp_path, layout, slow):
    results = pool.run(timed_run, str(tmp_path), layout, {slow}, DELAY, STEPS - 1)
    records, warnings = results[0]
    timed = records[-1]
    table = timed["rank_times"]
    assert set(table) == {*COLUMNS, "host", "work"} and all(len(column) == 8 for column in table.values())
    assert table["host"] == [node_name()] * 8
    assert table["compute_s"][slow] >= DELAY
    assert all(table["comm_wait_s"][r] >= 0.5 * DELAY for r in range(8) if r != slow)  # they wait for it
    straggler = timed["stragglers"][0]
    assert straggler["rank"] == slow and straggler["host"] == node_name() and straggler["ratio"] > 2
    assert straggler["compute_s"] == table["compute_s"][slow] and straggler["work"] == table["work"][slow]
    if table["work"].count(table["work"][slow]) == 1:
        assert straggler["against"] == "history"
    assert len(warnings) >= 1 and f"rank {slow} on {node_name()} ({table['work'][slow]}) busy" in warnings[-1] and \
        "run.straggler_threshold=1.2" in warnings[-1]
    assert all(r[-1]["stragglers"] == timed["stragglers"] for r, _ in results)  # every rank agrees
    assert all(w == [] for _, w in results[1:])  # rank 0 alone logs
    written = read_metrics(tmp_path)
    assert [r["step"] for r in written] == list(range(1, STEPS + 1)) and written[-1]["rank_times"] == table


def timer(threshold: float, works: list[str]) -> StepTimer:
    cfg = load_config(TINY, [f"run.straggler_threshold={threshold}"]).run
    made = StepTimer(cfg, 0, len(works), torch.device("cpu"), tuple("abcdefgh"[:len(works)]), print)
    made.works = works
    return made


def row(busy: float) -> list[float]:
    return [0.0, busy, 0.5, 0.0]  # data wait, compute, communication wait, optimizer


def test_ranks_are_judged_against_the_ranks_doing_the_same_work():
    works = ["embedding + 2 layers"] * 2 + ["2 layers"] * 3 + ["2 layers + output layer"] * 2
    heavy_last = [row(b) for b in (1.0, 1.0, 1.0, 1.05, 0.95, 1.6, 1.6)]
    assert timer(1.2, works).behind(heavy_last) == []  # against the median of all, 5 and 6 would be 1.6×
    table = [row(b) for b in (1.0, 1.0, 1.0, 1.4, 1.5, 1.6, 1.6)]
    assert [(s["rank"], s["host"], s["against"], round(s["ratio"], 3)) for s in timer(1.2, works).behind(table)]\
        == [(4, "e", "group", 1.25)]  # its peers 1.0 and 1.4: median 1.2
    assert [s["rank"] for s in timer(1.1, works).behind(table)] == [4, 3]  # furthest behind first
    assert timer(1.3, works).behind(table) == []
    short = [row(b) for b in (0.02, 0.02, 0.02, 0.02, 0.1, 0.02, 0.02)]
    assert timer(1.2, works).behind(short) == []  # 5× but 80 ms: scheduling noise, not a slow part


def test_work_names_each_chunk_with_its_layers_embedding_and_output_layer():
    def chunk(layers, pre, post):
        return SimpleNamespace(pre_process=pre, post_process=post, model=SimpleNamespace(layers=range(layers)))
    assert work_of([chunk(4, True, True)]) == "embedding + 4 layers + output layer"
    assert work_of([chunk(1, True, False), chunk(2, False, False)]) == "embedding + 1 layers | 2 layers"  # interleaved


def test_a_rank_alone_in_its_work_is_judged_against_its_own_history():
    works = ["embedding + 1 layers", "1 layers", "1 layers", "1 layers + output layer"]
    steady = [row(b) for b in (1.0, 0.8, 0.8, 1.4)]
    timed = timer(1.2, works)
    for _ in range(MIN_HISTORY):
        assert timed.behind(steady) == []
    everyone_slower = [row(1.5 * b) for b in (1.0, 0.8, 0.8, 1.4)]  # a batch ramp, a recompute switch
    assert timed.behind(everyone_slower) == []
    first_slower = [row(b) for b in (1.3, 0.8, 0.8, 1.4)]
    assert [(s["rank"], s["against"], round(s["reference_s"], 3)) for s in timed.behind(first_slower)] == \
        [(0, "history", 1.0)]
    others_faster = [row(b) for b in (1.0, 0.4, 0.4, 0.7)]
    assert timed.behind(others_faster) == []  # it kept its pace: it holds no one back more than before


def test_a_rank_behind_on_one_step_is_a_suspect_named_only_when_behind_on_the_next():
    works = ["2 layers"] * 4
    timed = timer(1.2, works)
    one_slow, two_slow = [row(b) for b in (1.0, 1.0, 1.0, 1.5)], [row(b) for b in (1.0, 1.5, 1.0, 1.5)]
    assert timed.confirmed(timed.behind(one_slow)) == [] and timed.suspects == {3}  # the next step is timed
    timed.step_begins(7)
    assert timed.timed
    assert [s["rank"] for s in timed.confirmed(timed.behind(two_slow))] == [3] and timed.suspects == {1}
    assert timed.confirmed(timed.behind([row(1.0)] * 4)) == [] and timed.suspects == set()  # a passing hiccup
    timed.step_begins(7)
    assert not timed.timed


def test_a_threshold_below_one_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"run.straggler_threshold=0.5 must be a finite number ≥ 1"):
        validate(load_config(TINY, ["run.straggler_threshold=0.5"]), 1)


def sniffed(rank, world, slow_matmul, slow_all_reduce):
    """rank_sniff.sniff with a sleep added to one rank's matmul (20 ms; it takes a fraction of one on CPU) and to
    another's all-reduce (0.1 s; on 8 ranks sharing 2 cores it takes tens of milliseconds)."""
    mm, all_reduce = torch.mm, comm.all_reduce

    def late(call, delay):
        def slowed(*args, **kwargs):
            out = call(*args, **kwargs)
            time.sleep(delay)
            return out
        return slowed
    torch.mm = late(mm, 0.02) if rank == slow_matmul else mm
    comm.all_reduce = late(all_reduce, 0.1) if rank == slow_all_reduce else all_reduce
    try:
        return rank_sniff.sniff(torch.device("cpu"))
    finally:
        torch.mm, comm.all_reduce = mm, all_reduce


def test_the_sniff_names_the_rank_slow_at_the_matmul_or_the_all_reduce(pool):
    healthy = pool.run(sniffed, None, None)
    assert [ok for ok, _ in healthy[0]] == [True, True], healthy[0]
    assert healthy[0][0][1].startswith("matmul alike on 8 ranks") and "all-reduce alike on 8 ranks" in healthy[0][1][1]
    crowded = (os.cpu_count() or 1) < 8  # the 8 ranks share this host: the all-reduce's margin says why it is wider
    assert healthy[0][0][1].endswith("(limit ×1.5)")
    assert healthy[0][1][1].endswith(f"(limit ×2.5: {node_name()} (8 ranks on {os.cpu_count()} cores))" if crowded
                                     else "(limit ×1.5)"), healthy[0][1][1]
    results = pool.run(sniffed, 6, 3)
    (matmul_ok, matmul), (all_reduce_ok, all_reduce) = results[0]
    assert not matmul_ok and matmul.startswith(f"matmul alike on every rank: rank 6 on {node_name()} ")
    assert not all_reduce_ok and all_reduce.startswith(f"all-reduce alike on every rank: rank 3 on {node_name()} ")
    assert all(r == results[0] for r in results)  # every rank reaches the same verdict
