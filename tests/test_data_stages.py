"""data.stages: the blend switches at step boundaries, each stage's samples follow its stated blend once per
epoch, resume at and across a boundary repeats the straight run, validation follows the stage."""
import numpy as np
import pytest

from data.blend import blending_indices
from data.indexed import IndexedDatasetBuilder
from engine.config.schema import ConfigError, load_config, validate
from engine.data_stages import DataStages
from engine.train import build_split_datasets
from tests.test_batch_ramp import run
from tests.test_train import TINY, launch

BASES = {"web": 0, "code": 100, "math": 200}  # each dataset's tokens lie in [base, base + 50)


def source(tokens):
    return next(name for name, base in BASES.items() if base <= int(tokens[0]) < base + 50)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    rng = np.random.RandomState(0)
    for name, base in BASES.items():
        b = IndexedDatasetBuilder(str(root / name), np.int32)
        for _ in range(40):
            b.add_document(base + rng.randint(0, 50, rng.randint(5, 40)))
        b.finalize()
    return {name: str(root / name) for name in BASES}


def stages_override(c, first=3, steps=6):
    return (f"data.stages=[{{until_step: {first}, paths: ['0.75', {c['web']}, '0.25', {c['code']}]}}, "
            f"{{until_step: {steps}, paths: ['0.25', {c['code']}, '0.75', {c['math']}]}}]")


def config(corpora, *overrides, steps=6):
    cfg = load_config(TINY, ["data.mock=false", "data.split=80,20,0", f"train.steps={steps}",
                             stages_override(corpora, steps=steps), *overrides])
    validate(cfg, 1)
    return cfg


@pytest.mark.parametrize("ramp", [[], ["train.batch_size_ramp=[2, 2, 24]"]], ids=["fixed-batch", "ramp"])
def test_sample_order_is_each_stages_blend_read_once(corpora, ramp):
    stages = DataStages(config(corpora, *ramp))
    first = 24 if not ramp else 6  # samples of the first 3 steps: 3 × 8, or 2 + 2 + 2 while ramping
    end = 48 if not ramp else 6 + 2 + 4 + 4
    assert stages.train.bounds == [first, end] == build_split_datasets(config(corpora, *ramp))["train"].bounds
    got = [source(stages.train[i]) for i in range(end)]
    want = []
    for names, weights, size in ((("web", "code"), [0.75, 0.25], first), (("code", "math"), [0.25, 0.75],
                                                                             end - first)):
        which, _ = blending_indices(weights, size)
        want += [names[k] for k in which]
    assert got == want
    for s, start in enumerate((0, first)):  # within a stage: its blend's samples 0, 1, 2, ... in order
        blend = stages.splits[s]["train"]
        assert [stages.train.locate(start + j) == (blend, j) for j in range(3)] == [True] * 3


@pytest.fixture(scope="module")
def straight(corpora, tmp_path_factory):
    return run(tmp_path_factory.mktemp("straight"), 6, ["data.mock=false", "data.split=80,20,0",
                                                        stages_override(corpora)])


@pytest.mark.parametrize("stop", [3, 2], ids=["at-the-boundary", "across-the-boundary"])
def test_resume_at_and_across_a_stage_boundary_repeats_the_straight_run(corpora, straight, tmp_path, stop):
    overrides = ["data.mock=false", "data.split=80,20,0", stages_override(corpora)]
    first = run(tmp_path, 6, overrides, stop_after=stop)
    rest = run(tmp_path, 6, overrides)
    assert [r["step"] for r in first + rest] == list(range(1, 7))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(first + rest, straight)) <= 1e-5
    assert [r["consumed_samples"] for r in first + rest] == [r["consumed_samples"] for r in straight]


def test_validation_follows_the_current_stage(corpora):
    stages = DataStages(config(corpora, "train.eval_interval=3", "train.eval_per_dataset=true"))
    assert list(stages.validation_sets(0)) == ["web", "code"] == list(stages.validation_sets(3))
    assert list(stages.validation_sets(4)) == ["code", "math"] == list(stages.validation_sets(6))
    for completed, names in ((3, {"web", "code"}), (4, {"code", "math"})):
        valid = stages.datasets(completed)["valid"]
        assert {source(valid[i]) for i in range(len(valid))} == names


@pytest.mark.parametrize("overrides,match", [
    (["data.paths=[/d/web]"], "leave data.paths empty"),
    (["train.steps=7"], r"ends at step 6 .* train.steps=7"),
    (["train.steps=3"], r"data.stages\[1\] starts at step 3, at or after train.steps=3"),
    (["data.stages=[{until_step: 4, paths: [a]}, {until_step: 4, paths: [b]}]", "train.steps=4"],
     r"data.stages\[1\].until_step=4 must be greater than the previous stage's 4"),
    (["data.stages=[{until_step: 6, path: [a]}]"], r"data.stages\[0\] must be a mapping with exactly the keys"),
    (["data.stages=[{until_step: 6, paths: ['0.5', a, b]}]"], r"data.stages\[0\].paths: .*alternating"),
    (["data.stages=[7]"], r"data.stages: expected a list of mappings"),
])
def test_malformed_stages_are_one_line_naming_the_stage(corpora, overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        config(corpora, *overrides)
    assert "\n" not in str(info.value)


def test_missing_stage_shard_names_the_stage(corpora, tmp_path):
    cfg = config(corpora, f"data.stages=[{{until_step: 6, paths: [{tmp_path / 'gone'}]}}]")
    with pytest.raises(ConfigError, match=r"data.stages\[0\].paths: .*gone"):
        DataStages(cfg)


def test_two_data_parallel_ranks_resume_stages_and_ramp_exactly(corpora, tmp_path):
    """DP=2 ranks, stages switching where the ramp reaches the full batch (step 4: batches 4, 4, 4, 4, then 8):
    stopped there and resumed equals the straight run, which follows the single process."""
    overrides = ["data.mock=false", "data.split=80,20,0", "train.steps=8", "train.batch_size_ramp=[4, 4, 16]",
                 stages_override(corpora, first=4, steps=8)]
    straight = launch(tmp_path / "straight", *overrides, nproc=2)
    launch(tmp_path / "resumed", *overrides, "checkpoint.exit_after=4", nproc=2)
    resumed = launch(tmp_path / "resumed", *overrides, nproc=2)
    assert [r["global_batch_size"] for r in straight] == [4] * 4 + [8] * 4
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, straight)) <= 1e-5
    single = run(tmp_path / "single", 8, overrides)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(single, straight)) <= 1e-4


def test_training_evaluates_on_the_stage_it_trained(corpora, tmp_path):
    from engine.observe.metrics import MetricsLog
    from engine.train import Trainer
    from parallel.distributed import DistEnv
    cfg = config(corpora, f"run.dir={tmp_path}", "train.eval_interval=3", "train.eval_per_dataset=true",
                 "train.eval_iters=1")
    trainer = Trainer(cfg, DistEnv())
    metrics = MetricsLog(tmp_path, enabled=True, console=lambda line: None)
    try:
        records = trainer.train(metrics)
    finally:
        trainer.loader.close()
        metrics.close()
    evaluated = {r["step"]: r["eval_loss_by_dataset"] for r in records if "eval_loss" in r}
    assert {step: list(losses) for step, losses in evaluated.items()} == {3: ["web", "code"], 6: ["code", "math"]}
