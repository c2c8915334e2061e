"""Replicated parameters are checked bit for bit across the ranks that hold copies (parallel/replicas.py):
the check passes on sound layouts, names the parameter that one rank changed, and stops every rank."""
import pytest
import torch

from engine.config.schema import ConfigError, load_config
from engine.train import ReplicaMismatch
from parallel.replicas import fingerprint
from tests.distributed import worker_pools
from tests.helpers import TINY, tiny_trainer


@pytest.fixture(scope="module")
def pool():
    with worker_pools(4) as made:
        yield made[4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fingerprint_sees_any_bit_and_swaps(dtype):
    x = torch.randn(1000, dtype=torch.float64).to(dtype)
    base = fingerprint(x)
    assert torch.equal(base, fingerprint(x.clone()))
    flipped = x.clone()
    flipped.view(torch.int16 if dtype == torch.bfloat16 else torch.int32 if dtype == torch.float32
                 else torch.int64)[17] ^= 1  # the lowest mantissa bit of one element
    assert not torch.equal(base, fingerprint(flipped))
    swapped = x.clone()
    swapped[[3, 900]] = swapped[[900, 3]]
    assert not torch.equal(base, fingerprint(swapped))


def perturbed_check(rank, world, overrides, victim, pick):
    """Build a trainer (its start-up check must pass), change one parameter on rank `victim`, check again;
    returns what each rank raised."""
    trainer = tiny_trainer("model.num_layers=2", "run.dir=/tmp/trilith-test-replicas", *overrides, rank=rank,
                           world=world, validated=True)
    trainer.train_step()  # copies stay equal through an optimizer step
    trainer.check_replicas()
    picked = None
    if rank == victim:
        try:  # a failure here must not leave the other ranks waiting in the check
            picked = pick(trainer)
            with torch.no_grad():
                picked[1].view(-1)[0] += 1e-3
        except Exception as exc:
            picked = f"pick failed: {exc!r}"
    try:
        trainer.check_replicas()
    except ReplicaMismatch as exc:
        return str(exc) if not isinstance(picked, str) else picked
    return picked if isinstance(picked, str) else None


def tp_norm(trainer):
    return next((n, p) for n, p in trainer.named_params if n.endswith("input_layernorm.weight"))


def dp_weight(trainer):
    return next((n, p) for n, p in trainer.named_params if n.endswith("mlp.down_proj.weight"))


def tp_norm_shard(trainer):
    """A norm weight's slice in this rank's ZeRO-3 shard (norms sit in data-parallel rank 0's shards here)."""
    for unit in trainer.data_parallel.units:
        for r in unit.shard_ranges:
            if r.name.endswith("norm.weight") and r.shard_end > r.shard_start:
                return r.name, unit.param_shard[r.shard_start:r.shard_end]
    raise AssertionError("no norm weight in this rank's shard")


@pytest.mark.parametrize("overrides, victim, pick, want", [
    (["parallel.tensor=2", "parallel.sequence_parallel=true"], 1, tp_norm,
     "tensor-parallel copies differ in 1 parameter(s): model.layers.0.input_layernorm.weight"),
    (["parallel.zero_stage=1"], 2, dp_weight, "data-parallel copies differ in 1 parameter(s): "),
    (["parallel.tensor=2", "parallel.zero_stage=3"], 1, tp_norm_shard, "tensor-parallel copies differ in 1 "),
    (["parallel.zero_stage=3", "parallel.hsdp_group_size=2"], 0, tp_norm_shard, "HSDP replica copies differ in 1 "),
], ids=["tp2-sp", "dp4-zero1", "tp2-zero3", "hsdp"])
def test_a_changed_copy_is_named_and_every_rank_stops(pool, overrides, victim, pick, want):
    messages = pool.run(perturbed_check, overrides, victim, pick)
    assert all(m is not None for m in messages), messages  # every rank stops, not only the group that saw it
    assert any(want in m for m in messages) and all("resume from an earlier checkpoint" in m for m in messages)
    # Each rank names what its own groups saw (the victim's DP copies differ too under TP × DP) or defers.
    saw = [m for m in messages if "copies differ in" in m]
    others = [m for m in messages if "copies differ on other ranks" in m]
    assert len(saw) + len(others) == 4 and saw, messages


def test_interval_is_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"run.replica_check_interval=-1 must be ≥ 0"):
        load_config(TINY, [f"run.dir={tmp_path}", "run.replica_check_interval=-1"])
