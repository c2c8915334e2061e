"""Property-based: arbitrary bytes and mutated valid manifest.json, safetensors headers and `latest` files
either load or fail with one CheckpointError line naming the file; never another exception, never a
read outside the checkpoint."""
import contextlib
import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.checkpoint.checkpointer import _rng_restore
from engine.checkpoint.files import STEP_DIR, CheckpointError, read_latest
from engine.checkpoint.manifest import SafetensorsRanges, open_verified
from parallel.random import TRACKER
from tests.test_checkpoint import saved_run

FUZZ = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RANK_FILE = "tp00-pp00-dp000.safetensors"
# Values a damaged or hostile file might hold in place of any other.
ODD = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 3),
                st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                st.sampled_from(["../step_00000001/" + RANK_FILE, "/etc/hostname", "manifest.json", "metadata.json",
                                 RANK_FILE, ".hidden", "a/b.safetensors", "F32", "U8", "float32"]),
                st.lists(st.integers(-2, 2**40), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(),
                                                                               max_size=2))


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    run = tmp_path_factory.mktemp("fuzz")
    saved_run(run, steps=1)
    return run / "checkpoints" / "step_00000001"


def paths(tree, prefix=()):
    """Every position in a JSON tree, as key/index tuples."""
    yield prefix
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield from paths(value, prefix + (key,))


def mutate(tree, data, times: int):
    """Replace, delete or nudge a few positions below the root of the tree (in place)."""
    for _ in range(times):
        inner = list(paths(tree))[1:]
        if not inner:
            break
        where = data.draw(st.sampled_from(inner))
        parent = tree
        for key in where[:-1]:
            parent = parent[key]
        key, action = where[-1], data.draw(st.sampled_from(["replace", "delete", "nudge"]))
        if action == "delete":
            del parent[key]
        elif action == "nudge" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] += data.draw(st.sampled_from([-2**40, -1, 1, 7, 2**40]))
        else:
            parent[key] = data.draw(ODD)
    return tree


def fails_cleanly(fn, *names) -> None:
    """fn() succeeds or raises a one-line CheckpointError naming one of `names`."""
    try:
        fn()
    except CheckpointError as exc:
        message = str(exc)
        assert "\n" not in message and any(str(n) in message for n in names), message


@contextlib.contextmanager
def rng_kept():
    """_rng_restore may succeed on a mutated file: keep the test process's random streams as they were."""
    states = TRACKER.state_dict(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        TRACKER.load_state_dict(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


def load_everything(directory) -> None:
    """What resuming with checkpoint.verify=false reads: sizes checked, then every piece of every tensor."""
    reader = open_verified(directory, checksums=False)
    try:
        for name, entry in reader.tensors.items():
            for key in entry["keys"]:
                reader.global_tensor(name, key)
    finally:
        reader.close()


def read_rank_file(path) -> None:
    f = SafetensorsRanges(path)
    try:
        for key in f.keys():
            f.tensor(key)
    finally:
        f.close()
    with rng_kept():
        _rng_restore(path)


@contextlib.contextmanager
def replaced(path, data: bytes):
    pristine = path.read_bytes()
    path.write_bytes(data)
    try:
        yield
    finally:
        path.write_bytes(pristine)


@FUZZ
@given(data=st.data())
def test_mutated_manifest_loads_or_names_the_checkpoint(step, data):
    manifest = json.loads((step / "manifest.json").read_text())
    if data.draw(st.booleans()):
        text = data.draw(st.binary(max_size=300))
    else:
        text = json.dumps(mutate(manifest, data, data.draw(st.integers(1, 3)))).encode()
    with replaced(step / "manifest.json", text):
        fails_cleanly(lambda: load_everything(step), step)


def test_a_dtype_that_is_not_a_string_names_the_checkpoint(step):
    """Found by the search above: a list where a tensor's dtype belongs once escaped as a TypeError."""
    manifest = json.loads((step / "manifest.json").read_text())
    next(iter(manifest["tensors"].values()))["dtype"] = []
    with replaced(step / "manifest.json", json.dumps(manifest).encode()):
        with pytest.raises(CheckpointError, match="has an invalid shape, split or dtype"):
            load_everything(step)


@FUZZ
@given(data=st.data())
def test_damaged_safetensors_header_reads_or_names_the_file(step, data):
    path = step / RANK_FILE
    blob = path.read_bytes()
    length = int.from_bytes(blob[:8], "little")
    kind = data.draw(st.sampled_from(["bytes", "length", "header"]))
    if kind == "bytes":  # anything at all in place of the start of the file
        head = data.draw(st.binary(max_size=64))
        damaged = head + blob[len(head):]
    elif kind == "length":
        damaged = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little") + blob[8:]
    else:  # a well-formed length in front of a mutated header
        header = mutate(json.loads(blob[8:8 + length]), data, data.draw(st.integers(1, 3)))
        text = json.dumps(header).encode()
        damaged = len(text).to_bytes(8, "little") + text + blob[8 + length:]
    with replaced(path, damaged):
        fails_cleanly(lambda: read_rank_file(path), path)


@FUZZ
@given(content=st.one_of(st.binary(max_size=64), st.sampled_from(
    ["step_00000001\n", "step_1", "/tmp/other/checkpoints/step_00000001", "../step_00000001",
     "step_00000001/../../x", " step_00000002 ", "step_00000001\0"]).map(str.encode)))
def test_latest_names_a_step_directory_here_or_itself(tmp_path_factory, content):
    root = tmp_path_factory.getbasetemp() / "latest-fuzz"
    root.mkdir(exist_ok=True)
    (root / "latest").write_bytes(content)
    try:
        found = read_latest(root)
    except CheckpointError as exc:
        assert "\n" not in str(exc) and str(root / "latest") in str(exc), exc
    else:
        assert found.parent == root and STEP_DIR.match(found.name), found
