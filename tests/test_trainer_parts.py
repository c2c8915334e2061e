"""The Trainer's small collaborators on their own: the recompute switch (engine/recompute_switch.py) and the
evaluation schedule (engine/evaluate/validation.py)."""
import dataclasses

from engine.config.schema import TrainConfig
from engine.evaluate.validation import evaluation_due
from engine.recompute_switch import RecomputeSwitch


def test_recompute_switch_changes_mode_and_micro_batch_at_its_step_only():
    t = dataclasses.replace(TrainConfig(), recompute="none", micro_batch_size=2, recompute_switch_step=5,
                            recompute_after_switch="full", micro_batch_size_after_switch=4)
    switch = RecomputeSwitch.of(t)
    assert [switch.at(step) for step in (1, 4, 5, 9)] == [("none", 2), ("none", 2), ("full", 4), ("full", 4)]
    kept = RecomputeSwitch.of(dataclasses.replace(t, micro_batch_size_after_switch=0))
    assert kept.at(5) == ("full", 2)  # 0: the micro batch is unchanged
    never = RecomputeSwitch.of(dataclasses.replace(t, recompute_switch_step=0))
    assert never.at(1) == never.at(10**6) == ("none", 2)


def test_evaluation_every_interval_and_after_the_last_step():
    t = dataclasses.replace(TrainConfig(), steps=10, eval_interval=4)
    assert [s for s in range(1, 11) if evaluation_due(s, t)] == [4, 8, 10]
    assert not any(evaluation_due(s, dataclasses.replace(t, eval_interval=0)) for s in range(1, 11))
