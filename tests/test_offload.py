"""optim.offload_fraction: the host-stepped share of the optimizer state changes nothing, bit for bit on CPU.

Each layout trains STEPS steps with offload off and on (gloo, CPU), with a clip threshold that some steps
exceed and some do not, and an infinite gradient injected at step INF_STEP (skipped): losses, gradient norms
and every owned master and Adam moment must be equal exactly. Checkpoints saved with offload on resume with it
off and back, exactly.
"""
import math
import re
import subprocess
import sys
import tempfile

import pytest
import torch

from engine import preflight
from engine.config.schema import load_config, validate
from engine.memory_estimate import estimate, host_problem, node_host_bytes, snapshot_shard_bytes
from engine.optim.offload import offloaded
from engine.train import Trainer
from parallel import comm
from parallel.distributed import DistEnv
from tests.distributed import worker_pools
from tests.test_data_parallel import make_config
from tests.test_memory_estimate import TINY, storages

STEPS, INF_STEP, CLIP = 20, 5, 1.15
BASE = {"model": dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                      vocab_size=61, seq_length=16),
        "train": dict(micro_batch_size=1, global_batch_size=8, steps=STEPS, seed=7),
        "optim": dict(lr=3e-3, warmup_steps=2, clip_grad=CLIP), "data": dict(mock=True)}

# (id, processes, precision, offload fraction, parallel overrides)
LAYOUTS = [
    ("ddp-dp2", 2, "bf16", 1.0, dict(zero_stage=0)),
    ("zero1-dp2", 2, "fp32", 0.5, dict(zero_stage=1)),
    ("zero3-dp2", 2, "fp32", 1.0, dict(zero_stage=3)),
    ("tp2-zero1-dp2", 4, "bf16", 0.5, dict(tensor=2, zero_stage=1)),
    ("pp2-zero1-dp2", 4, "fp32", 1.0, dict(pipeline=2, zero_stage=1)),
    ("hsdp2x2-zero2", 4, "bf16", 0.5, dict(zero_stage=2, hsdp_group_size=2)),
    ("zero2-dp2-no-overlap", 2, "bf16", 1.0, dict(zero_stage=2, overlap=False)),
    ("ddp-dp2-fp32-no-overlap", 2, "fp32", 0.5, dict(zero_stage=0, overlap=False)),
]


@pytest.fixture(scope="module")
def pools():
    with worker_pools(2, 4) as made:
        yield made


def trainer_for(rank, world, precision, fraction, parallel, run_dir=None):
    parallel = dict(parallel)
    base = {**BASE, "train": dict(BASE["train"], precision=precision),
            "optim": dict(BASE["optim"], offload_fraction=fraction, offload_overlap=parallel.pop("overlap", True))}
    cfg = make_config(base, **parallel)
    if run_dir is not None:
        cfg.run.dir = run_dir
    validate(cfg, world)
    return Trainer(cfg, DistEnv(rank, world, 0, torch.device("cpu"), "gloo"))


def inject_inf_at(trainer, step: int) -> None:
    """After the gradients of `step` are reduced, one infinite element (on every rank, so every rank skips)."""
    finish = trainer.data_parallel.finish_gradients

    def finish_then_poison():
        finish()
        if trainer.step + 1 != step:
            return
        if trainer.cfg.parallel.zero_stage == 0:  # replicated gradients: each rank measures its own
            next(p for _, p in trainer.named_params if p.grad is not None).grad.view(-1)[0] = math.inf
        else:  # each rank's shard (owned_gradients leaves out HSDP's other replicas)
            next(u for u in trainer.data_parallel.units if u.grad_shard is not None).grad_shard.fill_(math.inf)

    trainer.data_parallel.finish_gradients = finish_then_poison


def owned(trainer) -> dict:
    """{name: (range, master, exp_avg, exp_avg_sq)} of what this rank owns, and the model's own values under DDP."""
    out = {n: (s["range"], *(s[k].clone() for k in ("master", "exp_avg", "exp_avg_sq")))
           for n, s in trainer.optimizer.owned_state().items()}
    if trainer.cfg.parallel.zero_stage == 0:
        out.update({"param:" + n: p.detach().clone() for n, p in trainer.named_params})
    return out


def run_layout(rank, world, precision, fraction, parallel):
    trainer = trainer_for(rank, world, precision, fraction, parallel)
    inject_inf_at(trainer, INF_STEP)
    records = [trainer.train_step() for _ in range(STEPS)]
    overlap = [(r["offload_hidden_s"], r["offload_redos"]) for r in records if "offload_redos" in r]
    return [(r["loss"], r["grad_norm"], r["skipped"]) for r in records], owned(trainer), \
        len(trainer.optimizer.host.host_grads), overlap


def assert_same(off: dict, on: dict) -> None:
    assert off.keys() == on.keys()
    for name in off:
        for a, b in zip(off[name], on[name]):
            assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name


@pytest.mark.parametrize("nproc,precision,fraction,parallel", [row[1:] for row in LAYOUTS],
                         ids=[row[0] for row in LAYOUTS])
def test_offload_changes_no_bit(pools, nproc, precision, fraction, parallel):
    off = pools[nproc].run(run_layout, precision, 0.0, parallel)
    on = pools[nproc].run(run_layout, precision, fraction, parallel)
    steps = off[0][0]
    assert [s for _, _, s in steps] == [i + 1 == INF_STEP for i in range(STEPS)]
    finite = [n for _, n, s in steps if not s]
    assert any(n > CLIP for n in finite) and any(n <= CLIP for n in finite), f"clip must bite on some steps: {finite}"
    clipped = sum(n > CLIP for n in finite)
    for (steps_off, state_off, host_off, _), (steps_on, state_on, host_on, overlap) in zip(off, on):
        assert host_off == 0 and host_on > 0  # the state really moved
        assert steps_on == steps_off
        assert_same(state_off, state_on)
        if parallel.get("overlap", True):  # host steps started during backward
            assert len(overlap) == STEPS and any(hidden > 0 for hidden, _ in overlap)
            assert overlap[-1][1] == clipped  # one redo per clipped step, none for the skipped one
        else:
            assert overlap == []


def save_then_resume(rank, world, run_dir, precision, first, then, parallel):
    """STEPS / 2 steps at offload fraction `first`, saved; a new Trainer at `then` resumes and finishes."""
    trainer = trainer_for(rank, world, precision, first, parallel, run_dir)
    losses = [trainer.train_step()["loss"] for _ in range(STEPS // 2)]
    trainer.save_checkpoint()
    trainer.checkpointer.wait()
    resumed = trainer_for(rank, world, precision, then, parallel, run_dir)
    assert resumed.step == STEPS // 2
    losses += [resumed.train_step()["loss"] for _ in range(STEPS - STEPS // 2)]
    return losses, owned(resumed)


def straight(rank, world, precision, parallel):
    trainer = trainer_for(rank, world, precision, 0.0, parallel)
    return [trainer.train_step()["loss"] for _ in range(STEPS)], owned(trainer)


@pytest.mark.parametrize("precision,parallel", [("bf16", dict(zero_stage=0)), ("fp32", dict(zero_stage=3))],
                         ids=["ddp", "zero3"])
def test_resume_across_offload_on_and_off_is_exact(pools, precision, parallel):
    reference = pools[2].run(straight, precision, parallel)
    for first, then in ((1.0, 0.0), (0.0, 1.0)):
        with tempfile.TemporaryDirectory() as run_dir:
            resumed = pools[2].run(save_then_resume, run_dir, precision, first, then, parallel)
        for (losses, state), (want_losses, want_state) in zip(resumed, reference):
            assert losses == want_losses, (first, then)
            assert_same(want_state, state)


@pytest.mark.parametrize("numels,fraction,expected", [
    ([4, 4, 4, 4], 0.0, [False] * 4),
    ([4, 4, 4, 4], 1.0, [True] * 4),
    ([4, 4, 4, 4], 0.5, [True, True, False, False]),
    ([10, 1, 1], 0.2, [False, True, True]),  # the large one would overshoot: the small ones come nearer
    ([3], 0.6, [True]),
])
def test_offloaded_share_is_the_nearest_in_whole_tensors(numels, fraction, expected):
    assert offloaded(numels, fraction) == expected


# -- accounting: the estimate's device and host bytes against what the optimizer holds ------------------------
def held(rank, world, *overrides) -> tuple:
    """(stage, measured (device optimizer, host optimizer), estimated) bytes of this rank after one step."""
    # overlap true: its spares counted and allocated (auto is off on a CPU device)
    cfg = load_config(TINY, ["model.num_layers=4", "run.dir=/tmp/trilith-offload-unused", "optim.offload_overlap=true",
                             *overrides])
    validate(cfg, world)
    trainer = Trainer(cfg, DistEnv(rank, world))
    trainer.train_step()  # the moments exist from the first step on
    opt, dp = trainer.optimizer, trainer.data_parallel
    if cfg.parallel.zero_stage == 0:
        device = [(m, p) for i, (m, p) in enumerate(zip(opt.master, opt.params)) if i not in opt.host]
        state = [t for m, _ in device for key, t in opt.inner.state[m].items() if key != "step"]
        on_device = storages(state + [m for m, p in device if m is not p])
        shard_rank = 0
    else:
        weights = [u.param_shard if cfg.parallel.zero_stage == 3 else u.flat for u in dp.units]
        on_device = storages(weights + opt.held_tensors()) - storages(weights)
        shard_rank = comm.group_rank(dp.shard_group)
    want = estimate(cfg, world, shard_rank)[trainer.topo.pp_rank]
    return trainer.topo.pp_rank, (on_device, storages(opt.host_tensors())), (want.optimizer, want.host)


@pytest.mark.parametrize("world,overrides", [
    (1, ["train.precision=bf16", "optim.offload_fraction=0.5"]),
    (1, ["parallel.zero_stage=3", "optim.offload_fraction=0.6"]),
    (2, ["parallel.zero_stage=1", "train.precision=bf16", "optim.offload_fraction=0.5"]),
    (2, ["parallel.pipeline=2", "model.tie_embeddings=true", "optim.offload_fraction=0.3"]),
    (2, ["train.precision=bf16", "optim.offload_fraction=0.7"]),
    (2, ["parallel.zero_stage=2", "parallel.tensor=2", "optim.offload_fraction=1"]),
    (2, ["parallel.zero_stage=1", "parallel.tensor=2", "parallel.sequence_parallel=true", "optim.offload_fraction=1"]),
], ids=["ddp-bf16", "zero3-fp32", "zero1-dp2-bf16", "pp2-tied-ddp", "ddp-dp2-bf16", "zero2-tp2", "zero1-tp2-sp"])
def test_estimate_splits_device_and_host_bytes_as_allocated(pools, world, overrides):
    results = [held(0, 1, *overrides)] if world == 1 else pools[world].run(held, *overrides)
    for stage, got, want in results:
        assert got == want, (stage, got, want)
        assert got[1] > 0


def test_a_node_that_cannot_hold_the_state_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    cfg = load_config(TINY, ["optim.offload_fraction=1"])
    need = estimate(cfg, 1)[0].host
    assert host_problem(cfg, 1, 8, 10 * 8 * need) is None
    problem = host_problem(cfg, 1, 8, 8 * need)  # the state alone would take all of it: above HOST_SHARE
    assert problem.startswith("optim.offload_fraction=1 puts") and "\n" not in problem
    fits = re.search(r"set (optim.offload_fraction=0\.\d+) or less", problem).group(1)  # and that one fits
    assert host_problem(load_config(TINY, [fits]), 1, 8, 8 * need) is None

    monkeypatch.setattr(preflight, "node_memory", lambda: 2**10)  # no share of the state fits
    code = preflight.main(["--config", TINY, "--steps", "2", f"run.dir={tmp_path}", "optim.offload_fraction=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "optim.offload_fraction=1 puts" in err[0], err
    assert "turn it off (optim.offload_fraction=0)" in err[0]


def test_the_estimator_prints_host_bytes_per_node():
    done = subprocess.run([sys.executable, "tools/estimate_memory.py", "--config", TINY, "--host-memory", "1GB",
                           "--ranks-per-node", "4", "optim.offload_fraction=1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "in host memory)" in done.stdout and "per node of 1 ranks: fits 80% of 1.00 GiB" in done.stdout


def save_with_offload(rank, world, run_dir, steps):
    """`steps` steps at DP2 ZeRO-1, bf16, everything offloaded with overlap; saved; the owned state."""
    trainer = trainer_for(rank, world, "bf16", 1.0, dict(zero_stage=1), run_dir)
    for _ in range(steps):
        trainer.train_step()
    trainer.save_checkpoint()
    trainer.checkpointer.wait()
    return owned(trainer)


def resume_elsewhere(rank, world, run_dir, fraction):
    """The checkpoint resumed at DP4 ZeRO-3 with offload `fraction`: the state as loaded, then 2 more steps."""
    trainer = trainer_for(rank, world, "bf16", fraction, dict(zero_stage=3), run_dir)
    loaded = owned(trainer)
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    return loaded, losses, owned(trainer), len(trainer.optimizer.host.host_grads)


def test_a_checkpoint_saved_with_offload_resumes_at_another_dp_size_and_zero_stage(pools):
    with tempfile.TemporaryDirectory() as run_dir:
        saved = pools[2].run(save_with_offload, run_dir, 2)
        on = pools[4].run(resume_elsewhere, run_dir, 0.5)
        off = pools[4].run(resume_elsewhere, run_dir, 0.0)
    full = {}  # name -> [master, exp_avg, exp_avg_sq] over the whole parameter, from the two saving ranks
    for state in saved:
        for name, ((start, end), *tensors) in state.items():
            pieces = full.setdefault(name, [torch.full((end,), math.nan) for _ in tensors])
            for piece, t in zip(pieces, tensors):
                if piece.numel() < end:
                    piece.resize_(end)
                piece[start:end] = t
    for (loaded_on, losses_on, state_on, host_on), (loaded_off, losses_off, state_off, host_off) in zip(on, off):
        assert host_on > 0 and host_off == 0
        for name, ((start, end), *tensors) in loaded_on.items():  # each rank's shard is the saved one's slice
            for t, want in zip(tensors, full[name]):
                assert torch.equal(t, want[start:end]), name
        assert_same(loaded_off, loaded_on)
        assert losses_on == losses_off
        assert_same(state_off, state_on)


@pytest.mark.parametrize("overrides", [["parallel.zero_stage=0"], ["parallel.zero_stage=3"]], ids=["ddp", "zero3"])
def test_the_async_save_copy_is_counted_in_host_memory(tmp_path, overrides):
    """checkpoint.async_save's host snapshot, as the estimate counts it, against the tensors a save copies."""
    cfg = load_config(TINY, [f"run.dir={tmp_path}", "checkpoint.async_save=true", "optim.offload_fraction=1",
                             *overrides])
    validate(cfg, 1)
    trainer = Trainer(cfg, DistEnv(0, 1))
    trainer.train_step()
    copied = {}
    trainer.checkpointer.background.start = lambda write, step, file, tensors, *rest: copied.update(tensors)
    trainer.save_checkpoint()
    state = sum(t.nbytes for key, t in copied.items() if not key.startswith("rng"))
    assert state == snapshot_shard_bytes(cfg, 1) > 0
    without = load_config(TINY, [f"run.dir={tmp_path}", "optim.offload_fraction=1", *overrides])
    assert node_host_bytes(cfg, 1, 8) - node_host_bytes(without, 1, 8) == 8 * state
