"""Profiler traces (run.profile_steps, engine/observe/profiling.py): a 2-rank run writes one Chrome trace per rank, for
the chosen steps only, with Trilith's phases and collectives as named ranges; tools/profile_summary.py reads
them back per rank."""
import json
import subprocess
import sys

import pytest

from engine.config.schema import ConfigError, load_config, validate
from tests.distributed import worker_pools
from tests.helpers import ROOT, TINY, tiny_trainer
from tools.profile_summary import main as summary_main
from tools.profile_summary import phase_times, self_times


@pytest.fixture(scope="module")
def pool():
    with worker_pools(2) as made:
        yield made[2]


def profiled_run(rank, world, run_dir, *overrides):
    trainer = tiny_trainer("model.num_layers=2", f"run.dir={run_dir}", "run.profile_steps=[2, 3]", *overrides,
                           rank=rank, world=world, validated=True)
    for _ in range(4):
        trainer.train_step()
    trainer.loader.close()


@pytest.mark.parametrize("layout, collective", [([], "comm:all_reduce[dp]"),
                                                (["parallel.pipeline=2"], "comm:send/recv[pp]")])
def test_two_ranks_write_two_traces_with_the_named_ranges(pool, tmp_path, layout, collective):
    pool.run(profiled_run, str(tmp_path), *layout)
    micro_batches = 4 if layout else 2  # global batch 8 of micro-batches of 2, over DP 2 or one pipeline
    for rank in (0, 1):
        trace = json.loads((tmp_path / "profile" / f"rank_{rank}" / "trace.json").read_text())
        phases = phase_times(trace)
        assert phases["data wait"][1] == 2 and phases["optimizer"][1] == 2  # steps 2 and 3, not 1 or 4
        assert phases["forward"][1] == phases["backward"][1] == 2 * micro_batches
        assert collective in phases and all(ms >= 0 for ms, _ in phases.values())
    result = subprocess.run([sys.executable, "tools/profile_summary.py", str(tmp_path), "--top", "3"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("top CPU ops (self time):") == 2 and "rank 0 (" in out and "rank 1 (" in out
    assert collective in out and "backward" in out and "aten::" in out


def test_self_time_subtracts_the_ops_nested_inside():
    events = [{"name": "outer", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
              {"name": "inner", "ts": 2, "dur": 3, "pid": 1, "tid": 1},
              {"name": "inner", "ts": 6, "dur": 2, "pid": 1, "tid": 1},
              {"name": "other thread", "ts": 1, "dur": 4, "pid": 1, "tid": 2}]
    assert {(e["name"], e["ts"]): e["self"] for e in self_times(events)} == \
        {("outer", 0): 5, ("inner", 2): 3, ("inner", 6): 2, ("other thread", 1): 4}


@pytest.mark.parametrize("steps", ["[3, 2]", "[0, 2]", "[4]"])
def test_a_bad_step_range_is_one_line_naming_the_key(steps):
    with pytest.raises(ConfigError, match=r"run.profile_steps=.*1 ≤ first ≤ last"):
        validate(load_config(TINY, [f"run.profile_steps={steps}"]), 1)


def test_steps_past_the_end_of_the_run_are_one_line():
    with pytest.raises(ConfigError, match=r"run.profile_steps=\[19, 21\] ends after the run's last step, train.steps=20"):
        validate(load_config(TINY, ["run.profile_steps=[19, 21]"]), 1)


def test_a_run_dir_without_traces_is_one_line(tmp_path, capsys):
    assert summary_main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.profile_steps=[a, b]" in err
    (tmp_path / "profile" / "rank_0").mkdir(parents=True)
    (tmp_path / "profile" / "rank_0" / "trace.json").write_text("{not json")
    assert summary_main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank_0/trace.json: not a readable trace" in err
