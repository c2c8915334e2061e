"""Stragglers (engine/stragglers.py): on 4 data-parallel ranks, one slowed by a sleep in its forward/backward is
named, with its host, in the timed step's record and log line; the other ranks show the same time as
communication wait; metrics.jsonl holds the per-rank table at that step whatever train.log_interval says."""
import time

import pytest

from engine.config import ConfigError, load_config, validate
from engine.metrics import MetricsLog
from engine.stragglers import COLUMNS, StepTimer
from parallel.distributed import node_name
from tests.distributed import worker_pools
from tests.helpers import TINY, read_metrics, tiny_trainer

SLOW_RANK, DELAY = 2, 0.4


@pytest.fixture(scope="module")
def pool():
    with worker_pools(4) as made:
        yield made[4]


def slowed_run(rank, world, run_dir):
    trainer = tiny_trainer("model.num_layers=2", f"run.dir={run_dir}", "train.steps=3", "train.log_interval=10",
                           "run.timing_interval=2", "run.health_interval=0", rank=rank, world=world, validated=True)
    if rank == SLOW_RANK:  # a slow GPU or a busy host: this rank's compute takes longer
        forward_backward = trainer.forward_backward

        def slow(micro_batches):
            time.sleep(DELAY)
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


def test_a_slowed_rank_is_named_with_its_host(pool, tmp_path):
    results = pool.run(slowed_run, str(tmp_path))
    records, warnings = results[0]
    assert "rank_times" not in records[0] and "rank_times" not in records[2]  # only every run.timing_interval
    timed = records[1]
    table = timed["rank_times"]
    assert set(table) == {*COLUMNS, "host"} and all(len(column) == 4 for column in table.values())
    assert table["host"] == [node_name()] * 4
    assert table["compute_s"][SLOW_RANK] >= DELAY
    for r in {0, 1, 3}:  # the others wait for it in the gradient all-reduce
        assert table["comm_wait_s"][r] >= 0.5 * DELAY
    # slowest first (on a loaded test machine another rank may also be past 1.2× the median of tiny steps)
    straggler = timed["stragglers"][0]
    assert straggler["rank"] == SLOW_RANK and straggler["host"] == node_name() and straggler["ratio"] > 2
    assert straggler["compute_s"] == table["compute_s"][SLOW_RANK]
    assert len(warnings) == 1 and f"rank {SLOW_RANK} on {node_name()} busy" in warnings[0] and \
        "run.straggler_threshold=1.2" in warnings[0]
    assert all(r[1]["stragglers"] == timed["stragglers"] for r, _ in results)  # every rank agrees
    assert all(w == [] for _, w in results[1:])  # rank 0 alone logs
    written = read_metrics(tmp_path)
    assert [r["step"] for r in written] == [2, 3] and written[0]["rank_times"] == table


def timer(threshold: float) -> StepTimer:
    cfg = load_config(TINY, [f"run.straggler_threshold={threshold}"]).run
    return StepTimer(cfg, 0, 4, None, ("a", "b", "c", "d"), print)


def test_only_ranks_past_the_threshold_are_named_slowest_first():
    # rows: data wait, compute, communication wait, optimizer; busy = all but communication wait
    table = [[0.0, 1.0, 0.5, 0.0], [0.0, 1.3, 0.2, 0.0], [0.5, 1.0, 0.0, 0.1], [0.0, 1.1, 0.4, 0.0]]
    assert [(s["rank"], s["host"], round(s["ratio"], 3)) for s in timer(1.2).stragglers(table)] == \
        [(2, "c", round(1.6 / 1.2, 3))]  # busy 1.0, 1.3, 1.6, 1.1: median 1.2
    assert [s["rank"] for s in timer(1.05).stragglers(table)] == [2, 1]
    assert timer(1.5).stragglers(table) == []


def test_a_threshold_below_one_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"run.straggler_threshold=0.5 must be a finite number ≥ 1"):
        validate(load_config(TINY, ["run.straggler_threshold=0.5"]), 1)
