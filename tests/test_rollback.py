"""Loss spikes and rollback (engine/observe/rollback.py): a spike is judged against the window of sound losses and traced
to its samples; a poisoned data window makes every rank reload the last checkpoint before it and skip its
samples, after which the parameters equal, bit for bit, those of a run that never read those samples; a window
that goes bad again stops the run with status 1."""
import json
import math

import pytest
import torch

from engine.config.schema import ConfigError, load_config, validate
from engine.observe.metrics import MetricsLog
from engine.observe.rollback import LossGuard, RollbackFailed, merge_ranges
from engine.train import Trainer, build_loader, main
from parallel.distributed import DistEnv
from tests.distributed import worker_pools

TINY = "launch/configs/tiny.yaml"
# Global batch 8: step k reads samples 8(k-1) .. 8k-1. Checkpoints at steps 2, 4, 6, ...; the poisoned samples
# 32-47 are steps 5 and 6, so the rollback goes to step 4 and skips them.
ROLLBACK = ["model.num_layers=2", "train.steps=9", "checkpoint.interval=2", "run.spike_window=3",
            "run.spike_zscore=4", "run.rollback_after=2"]
POISONED = range(32, 48)


@pytest.fixture(scope="module")
def pool():
    with worker_pools(2) as made:
        yield made[2]


def make(rank, world, run_dir, *overrides) -> Trainer:
    cfg = load_config(TINY, [*ROLLBACK, f"run.dir={run_dir}", *overrides])
    validate(cfg, world)
    return Trainer(cfg, DistEnv(rank, world))


def poison(trainer: Trainer, samples: range, factor: float) -> None:
    """Multiply the loss of every micro-batch of the steps that read `samples` (whole steps) by `factor`: a bad
    data window. (Judged by the data position: synthetic samples repeat, their tokens do not tell them apart.)"""
    for chunk in trainer.chunks:
        if not chunk.post_process:
            continue
        forward = chunk.forward

        def poisoned(*args, _forward=forward, **kwargs):
            out = _forward(*args, **kwargs)
            return out * factor if samples.start < trainer.consumed_samples <= samples.stop else out
        chunk.forward = poisoned


def params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in trainer.named_params]


def poisoned_run(rank, world, run_dir, *overrides):
    trainer = make(rank, world, run_dir, *overrides)
    poison(trainer, POISONED, 30.0)
    history = trainer.train(MetricsLog(run_dir, enabled=rank == 0))
    return params(trainer), history


def skipping_run(rank, world, run_dir, *overrides):
    """The reference: no poison, no rollback; after step 4 the data jumps over samples 32-47."""
    trainer = make(rank, world, run_dir, "run.rollback_after=0", "checkpoint.interval=0", *overrides)
    for _ in range(4):
        trainer.train_step()
    trainer.loader = build_loader(trainer.cfg, trainer.topo, 48)
    while trainer.step < trainer.cfg.train.steps:
        trainer.train_step()
    return params(trainer)


def assert_equal(got, want):
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), \
        max((a - b).abs().max().item() for a, b in zip(got, want))


def test_a_spike_is_judged_against_the_window_of_sound_losses(tmp_path):
    cfg = load_config(TINY, ["run.spike_window=3", "run.spike_zscore=3", "run.rollback_after=2",
                             "checkpoint.interval=1"])
    notes = []
    guard = LossGuard(cfg, tmp_path, 0, notes.append)
    losses = torch.zeros(1, 4)

    def observe(step, loss, nonfinite=False):
        losses.fill_(loss)
        return guard.observe(step, loss, nonfinite, losses, 8 * (step - 1), 2,
                             lambda i: {"sample": i, "tokens": [i]})
    for step, loss in enumerate([5.0, 4.0, 6.0], start=1):  # mean 5, std 0.816: the threshold is 7.449
        assert observe(step, loss) == {}  # the window fills first
    assert observe(4, 7.4) == {} and not guard.bad_steps  # below: sound, and it joins the window
    spike = observe(5, 50.0)  # window 4, 6, 7.4
    assert spike["loss_spike_samples"] == list(range(32, 40)) and spike["loss_spike_zscore"] > 3
    assert [s for s, _ in guard.window] == [2, 3, 4] and guard.bad_steps == [5] and not guard.rollback_due
    report = json.loads((tmp_path / "spikes" / "step_00000005.json").read_text())
    assert [m["micro_batch"] for m in report["micro_batches"]] == [0, 1, 2, 3]
    assert report["micro_batches"][0]["samples"][1] == {"sample": 33, "tokens": [33]}
    assert "loss spike 50.0000" in notes[0]
    assert observe(6, math.nan, nonfinite=True) == {}  # non-finite steps count too
    assert guard.rollback_due and guard.bad_steps == [5, 6]
    for step in (7, 8):
        observe(step, 5.0)
    assert guard.bad_steps == [6] and not guard.rollback_due  # step 5 left the window of 3 steps


def test_only_the_culprit_micro_batch_is_named_when_it_alone_is_above():
    cfg = load_config(TINY, ["run.spike_window=2", "run.spike_zscore=2"])
    guard = LossGuard(cfg, "/tmp/trilith-rollback-unused", 1, print)  # rank 1 writes nothing
    for step, loss in ((1, 1.0), (2, 2.0)):
        guard.observe(step, loss, False, torch.full((1, 4), loss), 0, 2, None)
    losses = torch.tensor([[1.5, 1.5], [9.0, 1.5]])  # DP 2, two micro-batches each; threshold 2.5
    got = guard.observe(3, losses.mean().item(), False, losses, 16, 2, None)
    assert got["loss_spike_samples"] == [20, 21]  # DP rank 1 holds samples 20-23; its first micro-batch


def test_merge_ranges():
    assert merge_ranges([[40, 48], [8, 16], [16, 24], [44, 50]]) == [[8, 24], [40, 50]]


def test_rollback_skips_the_poisoned_window_and_equals_a_run_that_never_read_it(tmp_path):
    got, history = poisoned_run(0, 1, tmp_path / "poisoned", "checkpoint.keep=10")
    assert_equal(got, skipping_run(0, 1, tmp_path / "reference"))
    [event] = [r["rollback"] for r in history if "rollback" in r]
    assert event["from_step"] == 6 and event["to_step"] == 4 and event["bad_steps"] == [5, 6]
    assert event["skipped_samples"] == [32, 48]
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9]
    assert history[4]["loss_spike_samples"] == list(range(32, 40))
    logged = [json.loads(line) for line in (tmp_path / "poisoned" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollback"] for r in logged if "rollback" in r] == [event]
    for step in (4, 8):  # the step-4 checkpoint was saved again at the rollback: a resume skips the window too
        meta = json.loads((tmp_path / "poisoned" / "checkpoints" / f"step_{step:08d}" / "metadata.json").read_text())
        assert meta["skipped_samples"] == [[32, 48]] and meta["rollbacks"][0]["to_step"] == 4
    assert meta["consumed_samples"] == 8 * 8 + 16 and meta["step"] == 8


def test_rollback_is_exact_under_data_parallel_zero(pool, tmp_path):
    layout = ["parallel.zero_stage=1"]  # DP 2: each rank sees half the poisoned micro-batches
    got = pool.run(poisoned_run, tmp_path / "poisoned", *layout)
    want = pool.run(skipping_run, tmp_path / "reference", *layout)
    for (params_got, history), params_want in zip(got, want):
        assert [r["rollback"]["skipped_samples"] for r in history if "rollback" in r] == [[32, 48]]
        assert_equal(params_got, params_want)


def test_without_an_earlier_checkpoint_the_run_stops_with_the_fix(tmp_path):
    trainer = make(0, 1, tmp_path, "checkpoint.interval=8")
    poison(trainer, POISONED, math.nan)
    with pytest.raises(RollbackFailed, match=r"no intact checkpoint before step 5; set checkpoint.interval"):
        trainer.train(MetricsLog(tmp_path, enabled=False))


def test_a_window_that_goes_bad_again_stops_the_run_with_status_1(tmp_path, monkeypatch, capsys):
    forward_backward = Trainer.forward_backward

    def nan_from_sample_32(self, micro_batches):  # every step from step 5 on: skipping cannot help
        losses = forward_backward(self, micro_batches)
        return losses * math.nan if self.consumed_samples > 32 else losses
    monkeypatch.setattr(Trainer, "forward_backward", nan_from_sample_32)
    assert main(["--config", TINY, *ROLLBACK, f"run.dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "went bad (spikes or non-finite) again after rolling back from step 6 to 4" in err
    assert "skipping samples 32-47" in err


@pytest.mark.parametrize("overrides, message", [
    (["run.rollback_after=5", "run.spike_window=4"], "run.rollback_after=5 bad steps can never fall within"),
    (["run.rollback_after=2", "checkpoint.interval=0"], "reloads a checkpoint, but none is saved"),
    (["run.spike_window=1"], r"run.spike_window=1 must be ≥ 2"),
])
def test_rollback_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(TINY, ["checkpoint.interval=2", *overrides]), 1)


def test_the_pre_flight_of_a_run_that_rolls_back_is_valid():
    from engine.preflight import shrink
    cfg = load_config(TINY, ROLLBACK)
    validate(shrink(cfg, 1, 10), 1)
