"""Config loading, overrides and validation errors that name the numbers and the fix."""
import pytest

from engine.config.schema import ConfigError, load_config, validate
from engine.optim.lr_schedule import lr_at

TINY = "launch/configs/tiny.yaml"


def test_overrides_are_typed_and_applied():
    cfg = load_config(TINY, ["optim.lr=3e-4", "parallel.tensor=2", "parallel.sequence_parallel=true",
                             "data.paths=[a, b]", "train.precision=bf16"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.parallel.tensor == 2 and cfg.parallel.sequence_parallel is True
    assert cfg.data.paths == ["a", "b"] and cfg.train.precision == "bf16"


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'. Did you mean 'lr'"),
    ("modle.hidden_size=3", "unknown config section 'modle'. Did you mean 'model'"),
    ("train.steps=abc", "train.steps: expected an integer"),
    ("train.precision=fp8", "train.precision='fp8' is not one of fp32, bf16, fp16"),
    ("optim.lr", "must look like section.key=value"),
])
def test_bad_keys_and_values_are_rejected(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(TINY, [override])


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.tensor=3"], 3, "num_attention_heads=4 is not divisible by parallel.tensor=3"),
    (["parallel.tensor=2"], 3, "world size 3 is not divisible by parallel.tensor × parallel.pipeline = 2×1"),
    (["parallel.pipeline=8"], 8, "num_layers=4 is fewer than parallel.pipeline × virtual_stages = 8×1"),
    (["train.global_batch_size=6"], 4, "global_batch_size=6 is not divisible by train.micro_batch_size × "
                                       "data-parallel size = 2×4 = 8"),
    (["parallel.sequence_parallel=true", "parallel.tensor=4", "model.seq_length=30"], 4,
     "seq_length=30 over parallel.tensor=4"),
    (["data.mock=false"], 1, "data.paths is empty"),
    (["model.num_kv_heads=3"], 1, "not divisible by model.num_kv_heads=3"),
    (["parallel.virtual_stages=2"], 1, "needs parallel.schedule=interleaved"),
])
def test_impossible_layouts_are_rejected(overrides, world, message):
    cfg = load_config(TINY, overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, world)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does-not-exist.yaml does not exist"):
        load_config(tmp_path / "does-not-exist.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_lr_schedules():
    cfg = load_config(TINY, ["optim.lr=1.0", "optim.warmup_steps=10", "optim.min_lr_ratio=0.15"]).optim
    assert lr_at(0, 110, cfg) == pytest.approx(0.1) and lr_at(9, 110, cfg) == pytest.approx(1.0)
    assert lr_at(10, 110, cfg) == pytest.approx(1.0)
    assert lr_at(110, 110, cfg) == pytest.approx(0.15)
    assert lr_at(60, 110, cfg) == pytest.approx(0.575)  # cosine midpoint
    cfg.schedule = "linear"
    assert lr_at(60, 110, cfg) == pytest.approx(0.575)
    cfg.schedule = "wsd"
    assert lr_at(80, 110, cfg) == pytest.approx(1.0) and lr_at(100, 110, cfg) == pytest.approx(0.575)
    cfg.schedule = "two_phase"
    knee = lr_at(90, 110, cfg)  # 80% of the 100 decay steps: end of the cosine phase
    assert knee == pytest.approx(0.15 + 0.85 * 0.5 * (1 + __import__("math").cos(0.8 * __import__("math").pi)))
    assert lr_at(100, 110, cfg) == pytest.approx((knee + 0.15) / 2) and lr_at(110, 110, cfg) == pytest.approx(0.15)
