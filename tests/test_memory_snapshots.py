"""Memory snapshots (checkpoint.memory_interval) and recovery from them, in a pool of 4 CPU ranks posing as two
nodes of two (torchrun's GROUP_RANK, as `--nnodes 2` on one host sets it): partner pairing r <-> (r + 2) mod 4.

Each case trains 6 steps with snapshots every 2, "fails" after step 5 (a step-end check raises, as a dead
peer's collective would), damages the snapshots as the fault would (a lost node's shared memory gone, a
corrupt file, a snapshot cut short, another run's snapshots), starts a new Trainer in the same run.dir and
trains to the end. The resumed steps' losses and gradient norms must equal the uninterrupted run's exactly
(same process, same layout: bit for bit), and the recovery line must name the tier and the step.
"""
import contextlib
import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path

import pytest
import torch.distributed as dist

from engine.checkpoint.memory_snapshot import Identity, SnapshotStore, unpack
from engine.checkpoint.snapshot_recovery import agree
from engine.config.schema import from_dict, validate
from engine.observe.metrics import MetricsLog
from engine.train import Trainer
from parallel.distributed import DistEnv
from parallel.snapshot_exchange import partners
from tests.distributed import worker_pools

STEPS, FAIL_AT = 6, 5
BASE = {"model": dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                      vocab_size=61, seq_length=16),
        "train": dict(micro_batch_size=1, global_batch_size=8, steps=STEPS, seed=7),
        "optim": dict(lr=3e-3, warmup_steps=2), "data": dict(mock=True)}


class Failure(Exception):
    """The injected failure that ends the first run."""


class FailAfter:
    """A StopControl stand-in whose step-end check fails after `step` (None: never)."""

    def __init__(self, step):
        self.step = step

    def check(self, step):
        if step == self.step:
            raise Failure(f"injected after step {step}")
        return None, 0


def trainer(rank, world, tmp, run, parallel, **checkpoint):
    os.environ.update(GROUP_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))  # two "nodes" of two ranks
    raw = {k: dict(v) for k, v in BASE.items()}
    raw.update(parallel=dict(parallel), run={"dir": f"{tmp}/{run}", "replica_check_interval": 0},
               checkpoint={"memory_interval": 2, "memory_dir": f"{tmp}/shm", **checkpoint})
    cfg = from_dict(raw)
    validate(cfg, world)
    return Trainer(cfg, DistEnv(rank, world))


def curve(history):
    return [(h["step"], h["loss"], h["grad_norm"]) for h in history]


def damage(rank, tmp, run, case):
    """What the fault leaves behind, done on the ranks whose node it hits."""
    node = Path(f"{tmp}/shm/{os.uname().nodename}.node{rank // 2}")
    runs = list(node.glob(f"{run}-*"))
    if case == "lost_node" and rank == 2:  # one rank of the node: two removing one tree at once race
        shutil.rmtree(node)  # node 1 is gone: its ranks restart on a node with empty shared memory
    if case == "corrupt_own" and rank == 1:
        for state in runs[0].glob("rank_00001/step_*/state.safetensors"):
            data = bytearray(state.read_bytes())
            data[len(data) // 2] ^= 0xFF
            state.write_bytes(bytes(data))
    if case == "cut_short" and rank in (1, 3):  # rank 1 died writing step 4: no manifest in either copy
        for manifest in runs[0].glob("rank_00001/step_00000004/manifest.json"):
            manifest.unlink()
    if case == "foreign" and rank in (0, 2):  # another layout's snapshots on both nodes: every manifest says 8 ranks
        for manifest in runs[0].glob("rank_*/step_*/manifest.json"):
            manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "world_size": 8}))


@contextlib.contextmanager
def trilith_lines():
    """The messages logged to the trilith logger (INFO and above) while the block runs."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("trilith").addHandler(handler)
    logging.getLogger("trilith").setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logging.getLogger("trilith").removeHandler(handler)


def run_case(rank, world, tmp, parallel, case, interval):
    with trilith_lines() as lines:
        run = f"{case}-{parallel.get('tensor', 1)}"
        first = trainer(rank, world, tmp, run, parallel, interval=interval)
        with contextlib.suppress(Failure):
            first.train(MetricsLog(Path(tmp), enabled=False), FailAfter(FAIL_AT))
        first.memory.wait()
        dist.barrier()
        damage(rank, tmp, run, case)
        dist.barrier()
        lines.clear()
        second = trainer(rank, world, tmp, run, parallel, interval=interval)
        return second.step, curve(second.train(MetricsLog(Path(tmp), enabled=False))), lines


def reference(rank, world, tmp, parallel):
    return curve(trainer(rank, world, tmp, f"ref-{parallel.get('tensor', 1)}", parallel).train(
        MetricsLog(Path(tmp), enabled=False)))


@pytest.fixture(scope="module")
def pool():
    with worker_pools(4) as made:
        yield made[4]


# FailAfter fails in step 5's end check, before that step's progress mark: step 4 is the last one finished.
CASES = [  # (case, checkpoint.interval, step resumed at, what the recovery line says)
    ("lost_node", 3, 4, "from memory (partner copies for ranks 2, 3) at step 4: 0 steps lost"),
    ("corrupt_own", 3, 4, "from memory (partner copies for rank 1) at step 4: 0 steps lost"),
    ("cut_short", 5, 2, "from memory (own shards) at step 2: 2 steps lost"),  # no disk checkpoint yet
    ("foreign", 3, 3, "from the disk checkpoint (no complete memory snapshot newer than it) at step 3: 1 step lost"),
]


@pytest.mark.parametrize("parallel", [{"zero_stage": 0}, {"tensor": 2, "zero_stage": 1}], ids=["dp4", "tp2-zero1"])
def test_recovery_resumes_on_the_uninterrupted_curve(pool, tmp_path, parallel):
    want = pool.run(reference, str(tmp_path), parallel)[0]
    cases = CASES if parallel.get("tensor", 1) == 1 else CASES[:1]  # the second layout: a lost node
    for case, interval, step, line in cases:
        results = pool.run(run_case, str(tmp_path), parallel, case, interval)
        resumed, got, lines = results[0]
        assert all(r[0] == resumed for r in results) and resumed == step, (case, resumed, lines)
        assert got == want[step:], (case, got, want[step:])  # losses and gradient norms, exactly
        recovery = [x for x in lines if x.startswith("recovery:")]
        assert len(recovery) == 1 and recovery[0].startswith(f"recovery: {line}, "), (case, lines)
        if case == "corrupt_own":
            assert any("does not match its manifest's size and CRC-32" in x for x in lines), lines
        if case == "foreign":
            assert any("another run's or layout's snapshot: world_size 8, this run's is 4" in x for x in lines), lines


def test_pairing_and_agreement():
    assert partners(["a", "a", "b", "b"]) == [2, 3, 0, 1]  # rank r -> (r + ranks per node) mod world
    assert partners(["a", "b", "a", "b"]) == [1, 0, 3, 2]  # by local index on the next node, whatever the order
    assert partners(["a", "a"]) == [None, None] and partners(["a", "a", "b"]) == [None] * 3
    reports = [{"held": [(0, 4), (2, 4), (0, 2)]}, {"held": [(1, 4), (1, 2)]}, {"held": [(2, 2)]}]
    assert agree(reports, 3) == (4, {0: 0, 1: 1, 2: 0})  # rank 2's step-4 shard survives only on rank 0
    assert agree([{"held": [(0, 4)]}, {"held": []}], 2) == (-1, {})


def test_store_keeps_two_generations_and_names_what_it_ignores(tmp_path):
    ident = Identity(str(tmp_path / "run"), 2, "abc", "t1")
    store = SnapshotStore(str(tmp_path / "shm"), "node0", ident)
    for step in (2, 4, 6):
        store.write(0, step, {"meta": {}, "ranges": {}, "rng": {}}, [f"state {step}".encode()])
    assert store.held() == ([(0, 6), (0, 4)], [])
    manifest, state = unpack(store.packed(0, 6))
    assert state == b"state 6" and manifest["step"] == 6 and manifest["files"]["state.safetensors"]["bytes"] == 7
    other = SnapshotStore(str(tmp_path / "shm"), "node0", Identity(ident.run_dir, 2, "abc", "t2"))
    held, ignored = other.held()
    assert held == [] and len(ignored) == 2 and "token 't1', this run's is 't2'" in ignored[0]
    store.drop_after(4)
    assert store.held()[0] == [(0, 4)]


def one_rank(tmp, *overrides):
    from tests.helpers import tiny_trainer
    return tiny_trainer(f"run.dir={tmp}/run", "train.steps=6", "run.replica_check_interval=0",
                        "checkpoint.memory_interval=2", "checkpoint.interval=3", f"checkpoint.memory_dir={tmp}/shm",
                        *overrides)


def logged(build):
    """(what `build()` returned, the lines it logged to the trilith logger)."""
    with trilith_lines() as lines:
        return build(), lines


def test_another_configurations_snapshots_are_named_and_ignored(tmp_path):
    """One rank fails in step 5 (disk checkpoint of 3, memory snapshots of 2 and 4). Restarted with the same
    configuration, it resumes from memory at step 4; restarted with another learning rate (another config hash),
    it names the snapshot newer than the disk checkpoint (step 2's is not even checked), ignores it and resumes
    from the disk checkpoint."""
    first = one_rank(tmp_path)
    with contextlib.suppress(Failure):
        first.train(MetricsLog(tmp_path, enabled=False), FailAfter(5))
    first.memory.wait()
    same, lines = logged(lambda: one_rank(tmp_path))
    assert same.step == 4 and any(x.startswith("recovery: from memory (own shards) at step 4: 0 steps lost, ")
                                  for x in lines), lines
    other, lines = logged(lambda: one_rank(tmp_path, "optim.lr=1e-3"))
    ignored = [x for x in lines if x.startswith("memory snapshot: ignoring ")]
    assert len(ignored) == 1 and re.search(r"rank_00000/step_00000004 \(another run's or layout's snapshot: "
                                           r"config_hash '\w+', this run's is '\w+'\)$", ignored[0]), lines
    assert other.step == 3 and any(x.startswith("recovery: from the disk checkpoint (no complete memory snapshot newer "
                                                "than it) at step 3: 1 step lost, ") for x in lines), lines


def test_the_host_memory_count_is_three_state_files_of_own_and_partner_shards(tmp_path):
    """The estimate's shard equals the bytes a rank's snapshot holds (one rank, AdamW: master and two moments
    of every parameter); the node's count is 3 (2 generations and the one being written) × (own + partner's) ×
    its ranks, and a node too small for it is one line naming checkpoint.memory_interval."""
    from engine.checkpoint.snapshot_writer import space_needed, state_bytes
    from engine.memory_estimate import host_problem, report, snapshot_host_bytes, snapshot_shard_bytes
    t = one_rank(tmp_path)
    shard = state_bytes(t.optimizer)
    assert snapshot_shard_bytes(t.cfg, 1) == shard == 3 * 4 * sum(p.numel() for _, p in t.named_params)
    assert snapshot_host_bytes(t.cfg, 1) == 6 * shard == space_needed(shard, partner=True)
    assert "memory snapshots 12.4 MiB: 3 (2 generations and the one being written) × own + partner's shard of " \
           "2.1 MiB): 12.4 MiB on the fullest rank, 99.3 MiB per node of 8 ranks" in report(t.cfg, 1, 0, 1 << 30, 8)
    assert host_problem(t.cfg, 1, 8, 10 * 8 * 6 * shard) is None
    assert host_problem(t.cfg, 1, 8, 8 * 6 * shard).startswith(
        "checkpoint.memory_interval=2 keeps 99.3 MiB of memory snapshots in each node's host memory (8 ranks × 3 "
        "(2 generations and the one being written) × own + partner's shard), more than 80% of its 99.3 MiB; set "
        "checkpoint.memory_interval=0")


def test_each_snapshot_on_a_node_is_verified_by_one_of_its_ranks(tmp_path):
    """Two nodes of two ranks: a rank verifies its own shard, and the owners from elsewhere (partner copies) are
    split between the node's ranks; together they cover every owner once."""
    from engine.checkpoint.snapshot_recovery import verified_here
    nodes = ["a", "a", "b", "b"]
    chosen = {r: [o for o in range(4) if verified_here(nodes, r)(o)] for r in range(4)}
    assert chosen == {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    assert [o for o in range(2) if verified_here(["a", "b"], 0)(o)] == [0, 1]  # one rank per node: all of them
    store = SnapshotStore(str(tmp_path / "shm"), "a", Identity(str(tmp_path / "run"), 4, "abc", "t"))
    for owner in (0, 1, 2, 3):
        store.write(owner, 4, {"meta": {}, "ranges": {}, "rng": {}}, [b"state"])
    assert store.held(verified_here(nodes, 1)) == ([(1, 4), (3, 4)], [])


def snapshot(store, owner, step, tensors) -> dict:
    """What the snapshot writer does with `tensors`, in one thread: copied into a new state file, committed."""
    from engine.checkpoint.memory_snapshot import layout
    head, places, size = layout(tensors)
    state = store.open(owner, step, size)
    state.put_tensors(head, places, tensors)
    return store.commit(owner, step, state, {"meta": {}, "ranges": {}, "rng": {}})


def test_the_state_file_is_safetensors_copied_into_the_spare_pages_and_checked_by_crc32(tmp_path):
    """The state file, copied from the tensors into its memory map, is a safetensors file (safetensors reads it
    back) whose CRC-32 is zlib's; load() returns the tensors held() verified while reading them, and after that
    reads the file again, checked, with the tensors asked for as views of the file's private map. From the third
    snapshot on, each one is written into the state file of the generation pruned before it (the same inode: no
    new pages), and a spare of another size is resized to fit."""
    import torch
    from safetensors.torch import load_file

    tensors = {"master/w": torch.randn(5, 3), "rng/default/cpu": torch.arange(7, dtype=torch.uint8),
               "exp_avg/w": torch.randn(15).bfloat16(), "empty": torch.zeros(0)}
    store = SnapshotStore(str(tmp_path / "shm"), "a", Identity(str(tmp_path / "run"), 1, "abc", "t"))
    manifest = snapshot(store, 0, 2, tensors)
    path = store.owner_dir(0) / "step_00000002"
    on_disk = load_file(path / "state.safetensors")
    assert on_disk.keys() == tensors.keys() and all(torch.equal(on_disk[k], v) for k, v in tensors.items())
    assert manifest["files"]["state.safetensors"]["crc32"] == zlib.crc32((path / "state.safetensors").read_bytes())
    assert store.held(keep=0) == ([(0, 2)], []) and path in store.kept
    for _ in range(2):  # the copy held() read, then the file read again
        got = store.load(0, 2)[1]
        assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
        assert not store.kept
    views = store.load(0, 2, view=lambda key: key.startswith("master/"))[1]  # the state the optimizer copies out
    assert all(torch.equal(views[k], v) for k, v in tensors.items())
    views["master/w"].add_(1)  # a private map: nothing goes back to the snapshot
    assert torch.equal(store.load(0, 2)[1]["master/w"], tensors["master/w"])
    first = (path / "state.safetensors").stat().st_ino
    snapshot(store, 0, 4, tensors)
    assert not (store.owner_dir(0) / ".spare").exists()  # two generations: nothing pruned yet
    bigger = {**tensors, "exp_avg_sq/w": torch.randn(15)}
    snapshot(store, 0, 6, bigger)  # step 2 pruned: its file is the spare
    assert (store.owner_dir(0) / ".spare").stat().st_ino == first
    snapshot(store, 0, 8, bigger)  # written into step 2's old file, grown to fit
    state = store.owner_dir(0) / "step_00000008" / "state.safetensors"
    assert state.stat().st_ino == first and store.held() == ([(0, 8), (0, 6)], [])
    got = store.load(0, 8)[1]
    assert got.keys() == bigger.keys() and all(torch.equal(got[k], v) for k, v in bigger.items())


@pytest.mark.parametrize("damage", ["tensor byte", "header byte", "truncated", "longer"])
@pytest.mark.parametrize("keep", [0, None], ids=["read", "in-place"])
def test_a_damaged_state_file_is_named_in_one_line_and_the_previous_generation_serves(tmp_path, damage, keep):
    """Every damage to the newest snapshot (a flipped bit in a tensor or in the header, a file cut short or
    grown) is caught by the CRC-32 or the size, whether held() verifies by reading or in place: one line names
    it, and the previous generation is what the rank holds (the next tier; with none left, the disk)."""
    import torch

    from engine.checkpoint.files import CheckpointError
    store = SnapshotStore(str(tmp_path / "shm"), "a", Identity(str(tmp_path / "run"), 1, "abc", "t"))
    for step in (2, 4):
        snapshot(store, 0, step, {"master/w": torch.full((64,), step)})
    state = store.owner_dir(0) / "step_00000004" / "state.safetensors"
    data = bytearray(state.read_bytes())
    if damage == "tensor byte":
        data[-5] ^= 0x01
    elif damage == "header byte":
        data[12] ^= 0x20
    elif damage == "truncated":
        data = data[:-4]
    else:
        data += b"\0" * 8
    state.write_bytes(bytes(data))
    held, ignored = store.held(keep=keep)
    assert held == [(0, 2)] and ignored == [f"{state.parent} (state.safetensors does not match its manifest's size "
                                            f"and CRC-32)"], ignored
    assert torch.equal(store.load(0, 2)[1]["master/w"], torch.full((64,), 2))
    for view in (lambda key: False, lambda key: True):  # read anyway, into tensors or as views: checked again
        with pytest.raises(CheckpointError, match="step_00000004/state.safetensors"):
            store.load(0, 4, view)


def test_a_snapshot_damaged_after_its_check_or_in_transfer_is_an_error_in_one_line(tmp_path):
    """A state file that changes between held()'s check and load(), and a partner's copy whose bytes do not match
    the CRC-32 its sender stated, are errors naming the snapshot (the restart then resumes from another copy)."""
    import torch

    from engine.checkpoint.files import CheckpointError
    store = SnapshotStore(str(tmp_path / "shm"), "a", Identity(str(tmp_path / "run"), 2, "abc", "t"))
    manifest = snapshot(store, 0, 2, {"master/w": torch.ones(64)})
    assert store.held() == ([(0, 2)], [])
    state = store.owner_dir(0) / "step_00000002" / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0x80
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_00000002/state.safetensors does not match its manifest's "
                                              r"CRC-32$"):
        store.load(0, 2)
    _, state_bytes = unpack(store.packed(0, 2))
    with pytest.raises(CheckpointError, match=r"^the copy of rank 1's step 2 snapshot was damaged in transfer "
                                              r"\(CRC-32 [0-9a-f]{8}, its manifest says [0-9a-f]{8}\)$"):
        store.write(1, 2, {"meta": {}, "ranges": {}, "rng": {}}, [state_bytes], crc=manifest["files"][
            "state.safetensors"]["crc32"])
    assert not (store.owner_dir(1) / "step_00000002").exists()


def test_older_generations_are_checked_only_when_the_newest_do_not_agree(tmp_path):
    """held(newest=True) checks each owner down to its newest intact snapshot and nothing older than `above`;
    held_older() checks the rest. bound() says when the older ones cannot give a newer complete step."""
    from engine.checkpoint.snapshot_recovery import bound
    store = SnapshotStore(str(tmp_path / "shm"), "a", Identity(str(tmp_path / "run"), 2, "abc", "t"))
    for owner, steps in ((0, (2, 4, 6)), (1, (2, 4))):  # rank 1 died before writing step 6
        for step in steps:
            store.write(owner, step, {"meta": {}, "ranges": {}, "rng": {}}, [b"state"])
    (store.owner_dir(0) / "step_00000006" / "state.safetensors").write_bytes(b"stat3")  # corrupt: the next serves
    held, ignored = store.held(newest=True, above=1)
    assert held == [(0, 4), (1, 4)] and len(ignored) == 1 and "step_00000006 (state.safetensors" in ignored[0]
    assert store.older == [(1, 2)] and bound([{"held": held}], 2) == 4  # owner 0 kept two generations: 6 and 4
    assert store.held_older() == ([(1, 2)], []) and store.older == []
    assert store.held(newest=True, above=4) == ([], [(f"{store.owner_dir(0) / 'step_00000006'} (state.safetensors "
                                                      f"does not match its manifest's size and CRC-32)")])
    assert bound([{"held": [(0, 6), (1, 4)]}, {"held": [(0, 4)]}], 2) == 4
    assert bound([{"held": [(0, 6)]}], 2) == -1
