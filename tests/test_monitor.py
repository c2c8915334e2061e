"""Training health (engine/observe/monitor.py): a NaN is traced to the samples that caused it, on one process and
across data- and pipeline-parallel ranks; attention entropy per layer is what the attention does and
the same on every layout (≤ 1e-5); the gradient-norm alarm fires above its threshold only; the time a step
waits for data is measured."""
import json
import math
import time
from pathlib import Path

import pytest
import torch

from engine.config.schema import ConfigError, load_config, validate
from engine.observe.metrics import MetricsLog
from engine.observe.monitor import RELEASE_INTERVAL, NonFiniteTraining, TrainingMonitor
from engine.train import Trainer
from parallel.distributed import DistEnv
from parallel.placement import compact_ranges
from tests.distributed import worker_pools
from tests.helpers import TINY, tiny_trainer


@pytest.fixture(scope="module")
def pool():
    with worker_pools(4) as made:
        yield made[4]


def make(rank, world, *overrides) -> Trainer:
    return tiny_trainer("model.num_layers=2", *overrides, rank=rank, world=world, validated=True)


def poison(trainer: Trainer, sample: torch.Tensor) -> None:
    """Make the loss NaN for any micro-batch that contains `sample` (a stand-in for a bad batch)."""
    for chunk in trainer.chunks:
        if not chunk.post_process:
            continue
        forward = chunk.forward

        def poisoned(inputs, labels=None, _forward=forward, **kwargs):
            out = _forward(inputs, labels, **kwargs)
            hit = labels is not None and (labels == sample[1:]).all(dim=1).any()
            return out * float("nan") if hit else out
        chunk.forward = poisoned


def nan_run(rank, world, run_dir, bad_index, *overrides):
    trainer = make(rank, world, f"run.dir={run_dir}", *overrides)
    poison(trainer, trainer.loader.sample(bad_index))
    before = [p.detach().clone() for _, p in trainer.named_params]
    records = [trainer.train_step() for _ in range(3)]
    return records, before, trainer


def test_a_nan_loss_is_traced_to_its_samples_and_the_step_is_skipped(tmp_path):
    # Global batch 8, micro-batch 2: sample 13 is the second micro-batch... of step 2 (samples 8-15): 12-13.
    records, _, trainer = nan_run(0, 1, tmp_path, 13)
    assert [r["skipped"] for r in records] == [False, True, False]
    assert records[1]["nonfinite_samples"] == [12, 13] and math.isnan(records[1]["loss"])
    assert all(math.isfinite(records[i]["loss"]) for i in (0, 2))
    report = json.loads((tmp_path / "nonfinite" / "step_00000002.json").read_text())
    assert report["reason"] == "non-finite loss"
    [entry] = report["micro_batches"]
    assert (entry["dp_rank"], entry["micro_batch"]) == (0, 2)
    assert [s["sample"] for s in entry["samples"]] == [12, 13]
    assert entry["samples"][1]["tokens"] == trainer.loader.sample(13).tolist()
    assert not (tmp_path / "nonfinite" / "step_00000001.json").exists()


def test_a_run_that_keeps_producing_nan_stops_with_the_reason(tmp_path):
    trainer = make(0, 1, f"run.dir={tmp_path}", "run.max_nonfinite_steps=3")
    for chunk in trainer.chunks:
        forward = chunk.forward
        chunk.forward = lambda *a, _forward=forward, **k: _forward(*a, **k) * float("nan")
    trainer.train_step()
    trainer.train_step()
    with pytest.raises(NonFiniteTraining, match=r"3 consecutive steps \(to step 3\).*run.max_nonfinite_steps=3"):
        trainer.train_step()
    assert len(list((tmp_path / "nonfinite").iterdir())) == 3


def nan_under_layout(rank, world, run_dir):
    records, before, trainer = nan_run(rank, world, run_dir, 14, "parallel.pipeline=2")
    return records[1]["nonfinite_samples"], records[1]["skipped"], trainer.topo.dp_rank


def test_nan_on_another_data_parallel_rank_is_named_by_rank_0(pool, tmp_path):
    # PP2 × DP2: step 2's samples 12-15 belong to DP rank 1; 14 is in its second micro-batch (14-15).
    results = pool.run(nan_under_layout, tmp_path)
    assert all(r[:2] == ([14, 15], True) for r in results), results
    [entry] = json.loads((tmp_path / "nonfinite" / "step_00000002.json").read_text())["micro_batches"]
    assert (entry["dp_rank"], entry["micro_batch"]) == (1, 1)


def entropies(rank, world, *overrides):
    trainer = make(rank, world, "run.monitor_interval=1", "run.dir=/tmp/trilith-monitor-unused", *overrides)
    return [trainer.train_step()["attention_entropy"] for _ in range(2)]


def test_attention_entropy_of_a_fresh_model_is_near_uniform_and_then_moves():
    first, second = entropies(0, 1)
    s = 32  # tiny.yaml's seq_length: a query at position i sees i + 1 keys
    uniform = sum(math.log(i + 1) for i in range(s)) / s
    assert len(first) == 2 and all(abs(e - uniform) <= 0.05 for e in first), (first, uniform)
    assert first != second


def test_attention_entropy_is_the_same_on_every_layout(pool):
    # Data parallelism is left out: each DP rank probes its own first micro-batch, so DP=2 averages two.
    reference = entropies(0, 1)
    for layout in (["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true"],
                   ["parallel.tensor=4"],  # 4 query heads, 2 KV heads: KV replicated over TP
                   ["parallel.context=2", "parallel.tensor=2", "parallel.context_attention=ring"]):
        for got in pool.run(entropies, *layout):
            worst = max(abs(a - b) for step_a, step_b in zip(got, reference) for a, b in zip(step_a, step_b))
            assert worst <= 1e-5, (layout, got, reference)


def head_ratios(rank, world, *overrides):
    trainer = make(rank, world, "run.monitor_interval=1", "run.dir=/tmp/trilith-monitor-unused", *overrides)
    return [trainer.train_step()["head_grad_variance_ratio"] for _ in range(2)]


def test_head_gradient_variance_ratio_is_max_over_min_of_the_q_proj_heads():
    trainer = make(0, 1, "run.monitor_interval=1", "run.dir=/tmp/trilith-monitor-unused")
    trainer.optimizer.zero_grad = lambda: None  # keep the step's reduced gradients to recompute by hand
    got = trainer.train_step()["head_grad_variance_ratio"]
    heads = trainer.cfg.model.num_attention_heads
    for i, layer in trainer.chunks[0].model.layers.items():
        variance = layer.self_attn.q_proj.weight.grad.double().view(heads, -1).var(dim=1, unbiased=False)
        assert abs(got[int(i)] / (variance.max() / variance.min()).item() - 1) <= 1e-6


def test_head_gradient_variance_ratio_is_the_same_on_every_layout(pool):
    reference = head_ratios(0, 1)
    for layout in (["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true"],
                   ["parallel.pipeline=2", "parallel.zero_stage=3"], ["parallel.tensor=2", "parallel.zero_stage=1"],
                   ["parallel.zero_stage=2", "parallel.hsdp_group_size=2"], []):
        for got in pool.run(head_ratios, *layout):
            worst = max(abs(a / b - 1) for step_a, step_b in zip(got, reference) for a, b in zip(step_a, step_b))
            assert worst <= 1e-4, (layout, got, reference)


def test_entropy_warning_and_grad_norm_alarm(tmp_path):
    warnings = []
    trainer = make(0, 1, f"run.dir={tmp_path}", "run.monitor_interval=1", "run.attention_entropy_min=2.8",
                   "run.grad_norm_alarm=0.01", "run.head_grad_variance_alarm=1.0001")
    trainer.monitor.console = warnings.append
    record = trainer.train_step()
    assert record["grad_norm_alarm"] is True
    assert any("grad_norm" in w and "run.grad_norm_alarm=0.01" in w for w in warnings)
    assert any("attention entropy outside [2.8, 0.0]" in w and "layer 0" in w for w in warnings)
    assert any("per-head gradient variance ratio above run.head_grad_variance_alarm=1.0001" in w for w in warnings)
    quiet = make(0, 1, f"run.dir={tmp_path / 'q'}", "run.grad_norm_alarm=0")
    quiet.monitor.console = warnings.append
    before = len(warnings)
    assert "grad_norm_alarm" not in quiet.train_step() and len(warnings) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="memory fragmentation is read from the CUDA allocator")
def test_memory_fragmentation_is_reported_on_cuda(tmp_path):
    cfg = load_config(TINY, ["model.num_layers=2", f"run.dir={tmp_path}", "train.device=cuda"])
    validate(cfg, 1)
    trainer = Trainer(cfg, DistEnv(0, 1, device=torch.device("cuda", torch.cuda.current_device())))
    record = trainer.train_step()
    assert 0.0 <= record["memory_fragmentation"] < 1.0 and record["memory_reserved_gb"] > 0


class FakeAllocator:
    """The CUDA allocator functions the fragmentation monitor reads, on CPU: peaks of 4 GiB allocated out of 10
    GiB reserved every step, and an empty_cache() that frees `frees` GiB of what is reserved."""

    def __init__(self, monkeypatch, frees: float):
        self.reserved, self.frees, self.releases = 10 * 2**30, frees * 2**30, 0
        for name, value in (("max_memory_allocated", lambda d: 4 * 2**30),
                            ("max_memory_reserved", lambda d: 10 * 2**30),
                            ("memory_reserved", lambda d: self.reserved), ("empty_cache", self.empty_cache),
                            ("reset_peak_memory_stats", lambda d: None)):
            monkeypatch.setattr(torch.cuda, name, value)

    def empty_cache(self):
        self.releases += 1
        self.reserved -= self.frees

    def steps(self, monitor: TrainingMonitor, first: int, last: int) -> list[int]:
        """The steps in [first, last] at which cached blocks were released; the next step re-reserves them."""
        released = []
        for step in range(first, last + 1):
            if "memory_released_gb" in monitor.memory(step, torch.device("cuda", 0)):
                released.append(step)
            self.reserved = 10 * 2**30
        return released


def fragmentation_monitor(tmp_path, warnings: list) -> TrainingMonitor:
    cfg = load_config(TINY, [f"run.dir={tmp_path}"])
    return TrainingMonitor(cfg, tmp_path, 0, 1, warnings.append)


def test_fragmentation_releases_are_rate_limited_and_logged_with_their_figures(tmp_path, monkeypatch):
    allocator, warnings = FakeAllocator(monkeypatch, frees=3.0), []
    monitor = fragmentation_monitor(tmp_path, warnings)
    # fragmentation 0.6 > 0.3 every step: one release per RELEASE_INTERVAL steps, not one per step
    assert allocator.steps(monitor, 1, 2 * RELEASE_INTERVAL + 1) == [1, 1 + RELEASE_INTERVAL, 1 + 2 * RELEASE_INTERVAL]
    assert allocator.releases == 3
    assert warnings[0] == ("WARNING step 1: memory fragmentation 0.60 above run.max_memory_fragmentation=0.3; "
                           "released the allocator's cached blocks: reserved 10.00 -> 7.00 GiB; next release at "
                           f"step {1 + RELEASE_INTERVAL} at the earliest")


def test_a_release_that_frees_nothing_doubles_the_wait_for_the_next(tmp_path, monkeypatch):
    allocator, warnings = FakeAllocator(monkeypatch, frees=0.0), []
    monitor = fragmentation_monitor(tmp_path, warnings)
    first, second = 1, 1 + 2 * RELEASE_INTERVAL
    assert allocator.steps(monitor, 1, second + 4 * RELEASE_INTERVAL) == [first, second, second + 4 * RELEASE_INTERVAL]
    assert "reserved 10.00 -> 10.00 GiB" in warnings[0]
    allocator.frees = 3 * 2**30  # a release that helps brings the interval back down
    assert allocator.steps(monitor, second + 12 * RELEASE_INTERVAL, second + 13 * RELEASE_INTERVAL) == [
        second + 12 * RELEASE_INTERVAL, second + 13 * RELEASE_INTERVAL]


def test_ranges_and_validation():
    assert compact_ranges([3, 4, 5, 9, 11, 12], ", ") == "3-5, 9, 11-12"
    for overrides, message in ((["run.monitor_interval=-1"], "monitor_interval=-1"),
                               (["run.attention_entropy_min=3", "run.attention_entropy_max=2"], "must exceed"),
                               (["run.max_memory_fragmentation=1.5"], "within")):
        with pytest.raises(ConfigError, match=message):
            validate(load_config(TINY, overrides), 1)
    assert Path(TINY).exists()


def test_data_wait_is_measured_and_named_once_it_holds_training_back(tmp_path):
    """data_wait_s is the time a step waited for its batch; the console line names it from 5% of the step."""
    trainer = make(0, 1, f"run.dir={tmp_path}")
    fast = trainer.train_step()
    assert 0.0 <= fast["data_wait_s"] < fast["step_time_s"]
    next_batch = trainer.loader.next_global_batch

    def slow_disk():
        time.sleep(0.3)
        return next_batch()
    trainer.loader.next_global_batch = slow_disk
    slow = trainer.train_step()
    assert 0.3 <= slow["data_wait_s"] <= slow["step_time_s"]
    lines = []
    log = MetricsLog(tmp_path, enabled=True, console=lines.append)
    log.write({**fast, "data_wait_s": 0.0})
    log.write(slow)
    log.close()
    assert "data wait" not in lines[0]
    share = round(100 * slow["data_wait_s"] / slow["step_time_s"])
    assert f"data wait {share}% of the step" in lines[1]
