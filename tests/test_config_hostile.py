"""Hostile and damaged configuration input: every bad value, file or override is one ConfigError line naming
the key (or the file), never a traceback, never a hang; a fuzz test holds the loader to that."""
import dataclasses
import math
import tempfile
import threading
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.paths import parse_paths
from engine.config.ranges import RANGES, field_range
from engine.config.schema import Config, ConfigError, load_config, save_config, validate

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "launch" / "configs" / "tiny.yaml"
RECIPES = sorted((ROOT / "launch" / "configs").glob("*.yaml"))
SLOTS = [(s.name, f.name, typing.get_type_hints(s.default_factory)[f.name])  # (section, key, type) of every field
         for s in dataclasses.fields(Config) for f in dataclasses.fields(s.default_factory)]
NUMERIC = [(section, key, typ) for section, key, typ in SLOTS if typ in (int, float)]


def config_error(overrides=(), path=TINY, world=1) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config(path, list(overrides)), world)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("override, shown", [
    ("train.steps=nan", "train.steps"), ("train.steps=inf", "train.steps"),
    ("train.log_interval=0", "train.log_interval=0"),
    ("optim.lr=nan", "optim.lr=nan"), ("optim.lr=-1", "optim.lr=-1.0"), ("optim.beta2=1.0", "optim.beta2=1.0"),
    ("model.num_kv_heads=-2", "model.num_kv_heads=-2"), ("model.vocab_size=0", "model.vocab_size=0"),
    # these two trained "successfully" on nothing
    ("model.hidden_size=0", "model.hidden_size=0"), ("model.seq_length=0", "model.seq_length=0"),
])
def test_out_of_range_values_name_the_key_and_value(override, shown):
    message = config_error([override])
    assert shown in message and override.split("=")[1].lstrip("-") in message


def test_the_same_values_in_a_file_are_refused_the_same_way(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: .nan\noptim:\n  beta2: 1.0\n")
    assert "train.steps" in config_error(path=path)


@pytest.mark.parametrize("section, key, typ", NUMERIC)
def test_every_numeric_field_is_bounded(section, key, typ):
    """A rule over the dataclass fields, not a list: a field added later is covered without being named."""
    bounds = field_range(section, key)
    assert getattr(getattr(Config(), section), key) in bounds  # the default itself is valid
    step = 1 if typ is int else 0.5
    outside = [bounds.low if bounds.open_low else bounds.low - step]
    if bounds.high < math.inf:
        outside.append(bounds.high if bounds.open_high else bounds.high + step)
    for value in outside + (["1e30"] if typ is int else ["nan", "-inf", "inf"]):
        with pytest.raises(ConfigError, match=f"{section}.{key}="):
            load_config(TINY, [f"{section}.{key}={value}"])


def test_declared_bounds_name_real_fields():
    assert set(RANGES) <= {(section, key) for section, key, typ in SLOTS if typ in (int, float, list[int], list[float])}


@pytest.mark.parametrize("text", ["model:\n  1: 2\n", "1:\n  a: 2\n", "model:\n  null: 3\n", "true: {}\n"])
def test_non_string_keys_are_named(tmp_path, text):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    assert "key" in config_error(path=path)


def test_a_directory_is_not_a_config_file(tmp_path):
    assert "is not a regular file" in config_error(path=tmp_path)


def test_non_utf8_file_is_named(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run:\n  dir: runs/caf\xe9\n".encode("latin-1"))
    message = config_error(path=path)
    assert str(path) in message and "UTF-8" in message


@pytest.mark.parametrize("text, problem", [
    ("model: [unclosed", "line 1, column 17"),
    ("train:\n  seed: !!bool maybe\n", "line 2"),
    ("run:\n  dir: 2024-13-01\n", "timestamp"),
    ("train:\n  steps: !!timestamp x\n", "timestamp"),
    ("[" * 5000, "levels deep"),
    ("a: &a [*a]\n", "levels deep"),
    ("train: 3\n---\ntrain: 4\n", "single document"),
])
def test_yaml_failures_are_one_line_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    message = config_error(path=path)
    assert str(path) in message and problem in message


def test_alias_bomb_is_refused_quickly(tmp_path):
    """A few hundred bytes of aliases of aliases stand for 9**9 strings; the loader hung walking them."""
    anchors = ["&a [l, l, l, l, l, l, l, l, l]"] + [f"&{b} [{', '.join(['*' + a] * 9)}]"
                                                     for a, b in zip("abcdefgh", "bcdefghi")]
    path = tmp_path / "bomb.yaml"
    path.write_text(f"data:\n  paths: [{', '.join(anchors)}]\n")
    assert path.stat().st_size < 400
    errors = []

    def load():
        try:
            load_config(path)
        except ConfigError as exc:
            errors.append(str(exc))

    worker = threading.Thread(target=load, daemon=True)  # daemon: a hang fails the test, not the session
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive() and len(errors) == 1
    assert str(path) in errors[0] and "aliases" in errors[0]


@pytest.mark.parametrize("overrides, shown", [
    (["optim.lr=[1,"], "optim.lr"),
    (["model.hidden_size=a: b: c"], "model.hidden_size"),
    (["data.paths=&a [*a]"], "data.paths"),
])
def test_override_parse_failures_name_the_override(overrides, shown):
    assert shown in config_error(overrides)


@pytest.mark.parametrize("text", ["- a\n- b\n", "model: 5\n", "just text\n"])
def test_overrides_into_a_file_that_is_not_a_mapping(tmp_path, text):
    path = tmp_path / "shape.yaml"
    path.write_text(text)
    assert "mapping" in config_error(["model.hidden_size=64"], path=path)


@pytest.mark.parametrize("override, shown", [
    ("data.split=nan,1,1", "data.split"), ("data.split=inf,1,0", "data.split"), ("data.split=0,0,0", "data.split"),
    ("data.split=abc", "data.split"), ("parallel.rank_order=tp-tp-pp", "parallel.rank_order"),
])
def test_values_parsed_from_text_are_checked_before_start(override, shown):
    assert shown in config_error([override])


@pytest.mark.parametrize("paths", [["nan", "a"], ["inf", "a", "1", "b"], ["0", "a", "0", "b"],
                                   ["1e308", "a", "1e308", "b"]])
def test_blend_weights_are_finite_with_a_positive_sum(paths):
    with pytest.raises(ValueError, match="data.paths weight"):  # training names it as a ConfigError on data.paths
        parse_paths(paths)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_still_load(recipe):
    assert isinstance(load_config(recipe), Config)


# --- fuzz: only a valid Config or one ConfigError line ---

def one_line(exc: ConfigError) -> None:
    message = str(exc)
    assert message and "\n" not in message and len(message) < 1000, message


def outcome(path: Path, overrides=()) -> None:
    try:
        cfg = load_config(path, list(overrides))
    except ConfigError as exc:
        return one_line(exc)
    for section, key, typ in NUMERIC:  # accepted: every number has its type and lies in its range
        value = getattr(getattr(cfg, section), key)
        assert type(value) is typ and value in field_range(section, key), (section, key, value)
    saved = path.with_name("saved.yaml")  # what a run writes to its directory reads back as the same Config
    save_config(cfg, saved)
    assert load_config(saved) == cfg
    for world in (1, 8, 64):
        try:
            validate(cfg, world)
        except ConfigError as exc:
            one_line(exc)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=4), st.dictionaries(SCALARS, SCALARS, max_size=3))
# values of the field's own type, mostly plausible, so that a good share of the mutated recipes load
TYPED = {int: st.integers(-2, 64), float: st.floats(-0.5, 4), bool: st.booleans(),
         str: st.text(max_size=20), list: st.lists(st.text(max_size=8), max_size=3),
         list[int]: st.lists(st.integers(-1, 8), max_size=4),
         list[float]: st.lists(st.floats(-1, 8), max_size=6), dict: st.dictionaries(SCALARS, SCALARS, max_size=3),
         list[dict]: st.lists(st.one_of(st.fixed_dictionaries({"until_step": st.integers(-1, 64),
                                                                "paths": st.lists(st.text(max_size=8), max_size=3)}),
                                        st.dictionaries(SCALARS, SCALARS, max_size=3)), max_size=3)}


def test_every_field_type_has_a_typed_strategy():
    assert {typ for _, _, typ in SLOTS} <= set(TYPED)


YAMLISH = st.lists(st.sampled_from(list("ab1.-:[]{},&*!? \n#'\"|>%@`\t\\e") + ["!!", "&x", "*x", "nan", ".inf",
                                                                                "model:", "  steps: "]),
                   max_size=40).map("".join)


@FUZZ
@given(data=st.one_of(st.binary(max_size=200), YAMLISH.map(str.encode)))
def test_fuzz_arbitrary_bytes(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_bytes(data)
        outcome(path)


@settings(FUZZ, max_examples=80)
@given(recipe=st.sampled_from(RECIPES), data=st.data(), as_override=st.booleans())
def test_fuzz_mutated_recipes(recipe, data, as_override):
    """Values replaced (in the file or as overrides): of the field's type, of any type, or raw YAML-ish text."""
    raw = yaml.safe_load(recipe.read_text())
    overrides = []
    if data.draw(st.integers(0, 3)) == 0:
        section, key, _ = data.draw(st.sampled_from(SLOTS))
        overrides.append(f"{section}.{key}={data.draw(YAMLISH)}")
    for _ in range(data.draw(st.integers(0, 3))):
        section, key, typ = data.draw(st.sampled_from(SLOTS))
        value = data.draw(VALUES if data.draw(st.integers(0, 3)) == 0 else TYPED[typ])
        if as_override:
            overrides.append(f"{section}.{key}={yaml.safe_dump(value, default_flow_style=True).strip()}")
        else:
            raw.setdefault(section, {})[key] = value
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_text(yaml.safe_dump(raw))
        outcome(path, overrides)
