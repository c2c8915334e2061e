"""train.batch_size_ramp: Megatron's --rampup-batch-size schedule, learning rate in samples, exact resume
mid-ramp, sample order unchanged by the ramp, and ramp values the layout cannot split refused by name."""
import random

import numpy as np
import pytest

from data.gpt_dataset import GPTDataset
from data.indexed import IndexedDataset
from data.loader import DistributedBatchLoader
from engine.batch_ramp import BatchRamp, lr_position
from engine.config.schema import ConfigError, load_config, validate
from engine.optim.lr_schedule import lr_at
from engine.train import Trainer
from parallel.distributed import DistEnv
from tests.test_data_loader import SEQ, make_dataset
from tests.test_train import TINY

RAMP = ["train.batch_size_ramp=[2, 2, 24]"]  # tiny.yaml: micro 2, global 8 -> batches 2, 4, 6, 8 every 8 samples


def megatron_batch(start, increment, ramp_samples, final, consumed):
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, in floating point as it does."""
    per_increment = ramp_samples / ((final - start) // increment)
    return min(start + int(consumed / per_increment) * increment, final)


def test_ramp_follows_megatron_and_counts_samples():
    rng = random.Random(0)
    for _ in range(300):
        start, increment = rng.randint(1, 16), rng.randint(1, 8)
        final = start + increment * rng.randint(0, 6)
        ramp = BatchRamp(start, increment, rng.randint(1, 500), final)
        consumed, seen = 0, []
        for steps in range(60):
            assert ramp.samples_after(steps) == consumed
            batch = ramp(consumed)
            if final > start:
                assert batch == megatron_batch(start, increment, ramp.ramp_samples, final, consumed)
            seen.append(batch)
            consumed += batch
        assert seen == sorted(seen) and set(seen) <= set(ramp.values())


def run(run_dir, steps, overrides=(), stop_after=None):
    """Records of an in-process tiny run from run.dir's own latest checkpoint (if any); saves and stops after
    step `stop_after`."""
    cfg = load_config(TINY, [f"run.dir={run_dir}", f"train.steps={steps}", *overrides])
    validate(cfg, 1)
    trainer = Trainer(cfg, DistEnv())
    records = []
    try:
        while trainer.step < steps:
            records.append(trainer.train_step())
            if trainer.step == stop_after:
                trainer.save_checkpoint()
                break
        trainer.checkpointer.wait()
    finally:
        trainer.loader.close()
    return records


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return run(tmp_path_factory.mktemp("straight"), 10, RAMP)


def test_batches_consumed_samples_and_lr_follow_the_ramp(straight):
    assert [r["global_batch_size"] for r in straight] == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8]
    assert [r["consumed_samples"] for r in straight] == list(np.cumsum([2, 2, 2, 2, 4, 4, 6, 6, 8, 8]))
    cfg = load_config(TINY, ["train.steps=10", *RAMP])
    total = 2 * 4 + 4 * 2 + 6 * 2 + 8 * 2  # samples of the 10 steps, in units of the final batch of 8
    for r in straight:
        after = r["consumed_samples"]
        assert lr_position(cfg.train, r["step"] - 1, after) == (after / 8 - 1, total / 8)
        assert r["lr"] == lr_at(after / 8 - 1, total / 8, cfg.optim)
    # in samples: warm-up (2 steps of the final batch = 16 samples) ends after 6 steps of the ramp's batches
    warm = [r["lr"] / cfg.optim.lr for r in straight[:6]]
    assert warm == pytest.approx([2 / 16, 4 / 16, 6 / 16, 8 / 16, 12 / 16, 1.0])
    assert max(r["lr"] for r in straight) == pytest.approx(cfg.optim.lr)
    fixed = load_config(TINY, ["train.steps=10"])
    assert lr_position(fixed.train, 3, 32) == (3, 10)  # without a ramp: the step, as before
    assert straight[-1]["loss"] < straight[0]["loss"]


@pytest.mark.parametrize("stop", [4, 5], ids=["at-a-batch-change", "mid-ramp"])
def test_resume_mid_ramp_repeats_the_straight_run(tmp_path, straight, stop):
    first = run(tmp_path, 10, RAMP, stop_after=stop)
    rest = run(tmp_path, 10, RAMP)
    assert [r["step"] for r in rest] == list(range(stop + 1, 11))
    for a, b in zip(first + rest, straight):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and a["global_batch_size"] == b["global_batch_size"]
        assert a["lr"] == b["lr"] and a["consumed_samples"] == b["consumed_samples"]


def test_sample_order_is_the_fixed_batch_order_at_any_dp(tmp_path):
    prefix, _ = make_dataset(tmp_path / "corpus", 60)
    ds = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ, 200, 0, str(tmp_path))
    expected = [tuple(ds[i].tolist()) for i in range(200)]
    ramp = BatchRamp(4, 4, 40, 12)
    for dp in (1, 2, 4):
        loaders = [DistributedBatchLoader(ds, 1, ramp, r, dp, prefetch=2 * (r % 2)) for r in range(dp)]
        seen, sizes = [], []
        while len(seen) < 150:
            for loader in loaders:
                seen += [tuple(row.tolist()) for mb in loader.next_global_batch() for row in mb]
            sizes.append(loaders[0].global_batch_size)
        for loader in loaders:
            loader.close()
        assert seen == expected[:len(seen)], f"dp={dp}"
        assert sizes[:9] == [4] * 5 + [8] * 3 + [12]  # a new size every 20 samples


@pytest.mark.parametrize("overrides,match", [
    (["parallel.tensor=1", "train.batch_size_ramp=[2, 2, 24]"], r"reaches a global batch of 2, not divisible by "
                                                                  r"micro batch × data-parallel size = 2×2 = 4"),
    (["train.batch_size_ramp=[4, 2, 24]"], r"global batch of 6, not divisible .* 2×2 = 4"),
    (["train.batch_size_ramp=[4, 3, 24]"], r"increment 3 must divide 8 - 4 = 4"),
    (["train.batch_size_ramp=[16, 4, 24]"], r"start 16 must be ≤ train.global_batch_size=8"),
    (["train.batch_size_ramp=[4, 4]"], r"must be \[start, increment, ramp_samples\]"),
    (["train.batch_size_ramp=[0, 4, 8]"], r"train.batch_size_ramp\[0\]=0"),
])
def test_ramp_values_the_layout_cannot_split_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        validate(load_config(TINY, overrides), 2)
    assert "\n" not in str(info.value)


def test_megatron_float_division_agrees_for_common_ramps():
    for start, increment, ramp_samples, final in [(32, 32, 2_000_000, 1536), (16, 16, 5_859_375, 2048)]:
        ramp = BatchRamp(start, increment, ramp_samples, final)
        for consumed in range(0, ramp_samples + 10_000, 997):
            assert ramp(consumed) == megatron_batch(start, increment, ramp_samples, final, consumed)
    assert BatchRamp(8, 8, 100, 8).samples_after(3) == 24 and BatchRamp(8, 8, 100, 8)(0) == 8  # no ramp left
