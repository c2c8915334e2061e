"""The zero-bubble schedules (parallel/zero_bubble*.py) against 1F1B and the single-process model (gloo, CPU,
fp32, NCCL semantics): ZB-H1 and ZBV at PP 2 and PP 4 give 1F1B's loss and gradients bit for bit (each
`.grad` sums its micro-batches in the same order); their plans keep 1F1B's peak activation count; a
preemption signal inside the schedule stops every rank at the same step and the run resumes on its curve;
invalid settings are refused in one line.
"""
import itertools
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine.checkpoint.files import read_latest
from engine.config.schema import ConfigError, load_config, validate
from engine.observe.metrics import MetricsLog
from engine.stage_balance import chunk_layers
from parallel.stage_layers import balanced_layer_counts, chunk_roles, stage_layer_ids
from parallel.zero_bubble_plan import critical_order, idle_fraction, peaks, plan
from tests.distributed import WorkerPool
from tests.helpers import TINY, launch, single_losses
from engine.stop import PREEMPTED_EXIT, StopControl, StopRun
from engine.train import Trainer
from parallel.distributed import DistEnv
from parallel.pipeline_schedules import ScheduleTrace
from tests.test_pipeline import _check_against_reference, pipeline_step


@pytest.fixture(scope="module")
def pool():
    made = WorkerPool(4)
    yield made
    made.close()


def _merged(results):
    return {n: g for r in results for n, g in r["grads"].items() if n not in r["duplicate"]}


@pytest.mark.parametrize("pp, tie", [(2, True), (4, False)], ids=["pp2-dp2-tied", "pp4"])
def test_zero_bubble_gradients_equal_1f1b_bit_for_bit(pool, pp, tie):
    """The schedules alone (no data-parallel wrapper: plain autograd accumulation, nothing queued); under the
    V with tied embeddings rank 0 holds both copies and sums them itself."""
    reference = _merged(pool.run(pipeline_step, pp, "1f1b", tie=tie))
    for schedule, v in (("zb-h1", 1), ("zbv", 2)):
        results = pool.run(pipeline_step, pp, schedule, virtual=v, tie=tie)
        _check_against_reference(results, tie=tie)
        got = _merged(results)
        assert got.keys() == reference.keys()
        for name, grad in reference.items():
            assert torch.equal(got[name], grad), (schedule, name, (got[name] - grad).abs().max())
        m = 8 // (4 // pp)  # micro-batches per DP rank
        # held from F to W: p micro-batches on every rank (1F1B's peak, on its rank 0), 2p half-stage chunks
        assert [r["peak_live"] for r in results] == [plan_peaks(schedule, pp, m, rank)[0] for rank in range(4)]
        assert max(r["peak_live"] for r in results) == pp * v
        crossings = pp - 1 if schedule == "zb-h1" else 2 * pp - 2  # the V's turn stays on rank p − 1
        assert sum(r["sends"] for r in results) == 2 * m * crossings * (4 // pp)


def plan_peaks(schedule: str, p: int, m: int, rank: int) -> tuple[int, int]:
    """From the plan of exactly m: the most chunk activations held at once (F done, W not) and the most
    backwards waiting for their W, on `rank` of a PP × DP pool."""
    held = waiting = peak = peak_waiting = 0
    for _, kind, _, _ in plan(schedule, p, m)[rank % p].slots:
        held += {"F": 1, "W": -1}.get(kind, 0)
        waiting += {"B": 1, "W": -1}.get(kind, 0)
        peak, peak_waiting = max(peak, held), max(peak_waiting, waiting)
    return peak, peak_waiting


def trainer_evaluations(rank, world, overrides):
    from tests.test_pipeline import trainer_evaluations as evaluations
    return evaluations(rank, world, overrides)


def test_validation_under_the_v_matches_single_process(pool):
    """forward_only_pipeline follows the V down the ranks and back up; the loss comes from rank 0."""
    for tie, pp in (("false", 4), ("true", 2)):
        common = ["train.eval_iters=2", "model.num_layers=8", f"model.tie_embeddings={tie}"]
        reference = trainer_evaluations(0, 1, common)
        layout = [f"parallel.pipeline={pp}", "parallel.schedule=zbv", "parallel.virtual_stages=2"]
        for got in pool.run(trainer_evaluations, common + layout):
            assert max(abs(a - b) for a, b in zip(got, reference)) <= 1e-5, (layout, got, reference)


def test_plans_complete_for_any_micro_batch_count_and_beat_1f1b():
    """Every m ≥ 1 completes (no minimum to refuse); with equal slots and m ≥ p ZB-H1 idles (p−1)/(3m+p−1),
    a third of 1F1B's (p−1)/(m+p−1) at large m, and ZBV less than ZB-H1."""
    for p, m in itertools.product(range(2, 7), range(1, 19)):
        for schedule in ("zb-h1", "zbv"):
            plans = plan(schedule, p, m)
            for rank, mine in enumerate(plans):
                kinds = [(kind, chunk, mb) for _, kind, chunk, mb in mine.slots]
                assert sorted(kinds) == sorted((k, c, b) for k in "FBW" for c in range(1 + (schedule == "zbv"))
                                               for b in range(m))
                for kind in "FBW":  # each chunk's slots of a kind in micro-batch order: 1F1B's sums
                    for chunk in (0, 1):
                        order = [mb for k, c, mb in kinds if (k, c) == (kind, chunk)]
                        assert order == sorted(order)
        if m >= p:  # fewer micro-batches than stages never reach the steady state
            assert idle_fraction("zb-h1", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))
        if m >= 2 * p:
            assert idle_fraction("zbv", p, m) < idle_fraction("zb-h1", p, m)
    for p, schedule in itertools.product(range(2, 7), ("zb-h1", "zbv")):  # what the closed forms beyond 4p rest on
        v = 1 + (schedule == "zbv")
        for m in range(2 * p, 5 * p + 1):
            plans = plan(schedule, p, m)
            assert max(t for r in plans for t, *_ in r.slots) + 1 - 3 * v * m == p - 1
            assert [plan_peaks(schedule, p, m, r) for r in range(p)] == [peaks(schedule, p, m, r) for r in range(p)]
        assert idle_fraction(schedule, p, 4 * p + 1) == pytest.approx((p - 1) / (3 * v * (4 * p + 1) + p - 1))
    assert critical_order("zb-h1", 4, 8, 3)[:4] == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]


def test_v_placement_and_its_compute_balance():
    # p = 2: rank 0 holds model chunks 0 and 3, rank 1 chunks 1 and 2
    assert stage_layer_ids(8, 2, 2, v_shape=True) == [[[0, 1], [6, 7]], [[2, 3], [4, 5]]]
    assert chunk_roles(0, 2, 2, 1, v_shape=True) == (False, True) and chunk_roles(1, 2, 2, 1, True) == (False, False)
    # By hand, 16 layers, p = 2, output layer worth 2.3 layers, all on rank 0 with the first chunk: rank totals
    # 7 + 2.3 and 9 (6 + 2.3 would leave rank 1 10); rank 0's 7 as 5 | 2 + 2.3 (4 | 3 + 2.3 costs 5.3).
    assert balanced_layer_counts(16, 2, 0.0, 2.3, virtual=2, v_shape=True) == [5, 5, 4, 2]
    # p = 4, 8 layers: two each whatever the head costs; 12 layers, head 1.5: rank 0 keeps 2 (3.5), the
    # others take the rest (4, 3, 3), each rank's earlier chunk the odd layer
    assert balanced_layer_counts(8, 4, 0.0, 5.0, virtual=2, v_shape=True) == [1, 1, 1, 1, 1, 1, 1, 1]
    assert balanced_layer_counts(12, 4, 0.0, 1.5, virtual=2, v_shape=True) == [1, 2, 2, 2, 1, 1, 2, 1]
    bench = ["model.hidden_size=256", "model.num_layers=16", "model.num_attention_heads=8", "model.num_kv_heads=8",
             "model.ffn_hidden_size=688", "model.vocab_size=8192", "model.seq_length=256", "parallel.pipeline=2",
             "parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.stage_balance=compute"]
    assert chunk_layers(load_config(TINY, bench)) == [5, 5, 4, 2]  # output layer ≈ 2.3 layers, as above


@pytest.mark.parametrize("overrides, message", [
    (["parallel.schedule=zbv"], "parallel.schedule=zbv places two model chunks per rank as a V; set "
                                "parallel.virtual_stages=2 (got 1)"),
    (["parallel.schedule=zb-h1", "parallel.virtual_stages=2"], "needs parallel.schedule=interleaved"),
    (["parallel.schedule=zb-h1", "parallel.zero_stage=3"], "parallel.schedule=zb-h1 with parallel.zero_stage=3"),
    (["parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.zero_stage=2"],
     "use parallel.zero_stage 0 or 1, or parallel.schedule=1f1b"),
    (["parallel.schedule=zbv", "parallel.virtual_stages=2", "model.num_layers=3"], "2×2 = 4 model chunks"),
])
def test_invalid_zero_bubble_configs_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(TINY, ["parallel.pipeline=2"] + overrides), 2)


def named_after_steps(rank, world, overrides):
    """{(tensor-parallel rank, name): value} of this rank's parameters after the steps, and which slot kinds
    the last step ran."""
    trainer = Trainer(load_config(TINY, overrides), DistEnv(rank, world))
    for step in range(trainer.cfg.train.steps):
        if step == trainer.cfg.train.steps - 1:
            trainer.schedule_trace = ScheduleTrace()
        trainer.train_step()
    kinds = sorted({event[0] for event in trainer.schedule_trace.events})
    return kinds, {(trainer.topo.tp_rank, n): p.detach().clone() for c in trainer.chunks
                   for n, p in c.named_parameters()}


# packed documents: an end-of-document token every 40 or so tokens of the synthetic data
PACKED = ["model.vocab_size=40", "data.eod_token_id=5", "data.reset_attention_mask=true",
          "data.reset_position_ids=true", "data.eod_mask_loss=true"]


@pytest.mark.parametrize("layout", [["parallel.pipeline=2", "model.tie_embeddings=true"],
                                    ["parallel.pipeline=4", "train.recompute=full", "model.tie_embeddings=true"],
                                    ["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"],
                                    ["parallel.pipeline=2", "parallel.context=2"],
                                    ["parallel.pipeline=2", "parallel.context=2", "parallel.context_attention=ring",
                                     *PACKED],
                                    ["parallel.pipeline=2", "parallel.context=2",
                                     "parallel.context_attention=alltoall"],
                                    ["parallel.pipeline=2", "parallel.zero_stage=1", "model.tie_embeddings=true"]],
                         ids=["pp2-dp2-tied", "pp4-recompute-tied", "tp2-sp-pp2", "pp2-cp2", "pp2-cp2-ring-packed",
                              "pp2-cp2-alltoall", "pp2-dp2-zero1-tied"])
def test_trained_parameters_equal_1f1b_bit_for_bit(pool, layout):
    """Through the Trainer (DP buckets or ZeRO-1 units, whose fused layers queue their weight gradients):
    every stage runs W slots, and two steps leave every parameter bit-equal to 1F1B's."""
    common = ["train.steps=2", "model.num_layers=8"] + layout
    reference = {k: v for _, named in pool.run(named_after_steps, common) for k, v in named.items()}
    for schedule in (["parallel.schedule=zb-h1"], ["parallel.schedule=zbv", "parallel.virtual_stages=2"]):
        got = pool.run(named_after_steps, common + schedule)
        assert all(kinds == ["B", "F", "W"] for kinds, _ in got), (schedule, [k for k, _ in got])
        merged = {}
        for _, named in got:
            for key, value in named.items():
                assert key not in merged or torch.equal(merged[key], value), key  # replicas agree
                merged[key] = value
        assert merged.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(merged[key], value), (schedule, key, (merged[key] - value).abs().max())


class SignalInWSlot(ScheduleTrace):
    """Sends this process SIGUSR1 (SLURM's warning before preemption) right after the first W slot of step
    `step`, so the signal lands inside the zero-bubble schedule, with slots of that step still to run."""

    def __init__(self, trainer, step):
        super().__init__()
        self.trainer, self.step, self.later = trainer, step, None  # later: slots of `step` run after the signal

    def add(self, kind, *args, **kwargs):
        super().add(kind, *args, **kwargs)
        if self.trainer.step != self.step - 1:  # the Trainer counts a step once its schedule has run
            return
        if self.later is not None:
            self.later += 1
        elif kind == "W":
            self.later = 0
            os.kill(os.getpid(), signal.SIGUSR1)


def curve(history):
    return [(h["step"], h["loss"], h["grad_norm"]) for h in history]


def preempted_and_resumed(rank, world, tmp, overrides, signalled, stop):
    """A straight run, then a run whose rank `signalled` is signalled during step `stop`'s schedule (the real
    StopControl: its handler, the agreement at the step's end, the save), then a new Trainer in that run.dir."""
    run = [f"run.dir={tmp}/preempted", *overrides]
    straight = curve(Trainer(load_config(TINY, [f"run.dir={tmp}/straight", *overrides]), DistEnv(rank, world)).train(
        MetricsLog(Path(tmp), enabled=False)))
    first = Trainer(load_config(TINY, run), DistEnv(rank, world))
    if rank == signalled:
        first.schedule_trace = SignalInWSlot(first, stop)
    control = StopControl(first.env)
    try:
        first.train(MetricsLog(Path(tmp), enabled=False), control)
        raise AssertionError("no StopRun")
    except StopRun as stopped:
        message, code = str(stopped), stopped.code
    finally:
        control.restore()
    later = first.schedule_trace.later if rank == signalled else None
    second = Trainer(load_config(TINY, run), DistEnv(rank, world))
    return dict(straight=straight, code=code, message=message, stopped_at=first.step, later=later,
                resumed_from=second.step, resumed=curve(second.train(MetricsLog(Path(tmp), enabled=False))))


@pytest.mark.parametrize("layout", [("parallel.pipeline=2", "parallel.schedule=zbv", "parallel.virtual_stages=2"),
                                    ("parallel.pipeline=4", "parallel.schedule=zb-h1")],
                         ids=["zbv-pp2-dp2", "zbh1-pp4"])
def test_preemption_signal_inside_the_schedule_stops_every_rank_together_and_resumes_exactly(pool, tmp_path,
                                                                                               layout):
    """SIGUSR1 to one rank (the last) inside a W slot of step 3: the schedule finishes, every rank agrees at the
    step's end to stop there, saves and raises StopRun with exit 3; a new Trainer in that run.dir continues
    from step 3 on the straight run's curve, bit for bit (same processes, same layout)."""
    steps, stop = 6, 3
    overrides = [f"train.steps={steps}", "train.micro_batch_size=1", *layout]
    got = pool.run(preempted_and_resumed, str(tmp_path), overrides, pool.world_size - 1, stop)
    assert got[-1]["later"] > 0  # slots of step 3 ran after the signal: it did arrive mid-schedule
    assert all(r["code"] == PREEMPTED_EXIT and r["stopped_at"] == stop == r["resumed_from"] for r in got), got
    assert "received SIGUSR1" in got[-1]["message"]
    assert all("another rank received a stop signal" in r["message"] for r in got[:-1])
    assert read_latest(tmp_path / "preempted" / "checkpoints").name == f"step_{stop:08d}"
    for r in got:
        assert r["resumed"] == r["straight"][stop:] and len(r["straight"]) == steps


# The five launched layouts against one single-process reference (the same recipe in this process): tiny.yaml's
# 4 layers (one per ZB-H1 stage at PP 4, one per V chunk at PP 2) at hidden 32 and 16 tokens, so that the ranks'
# start-up, not their 20 steps, is the cost; two launches at a time, as they are independent.
LAUNCHED = ("train.steps=20", "model.tie_embeddings=true", "model.hidden_size=32", "model.ffn_hidden_size=64",
            "model.seq_length=16")
ZBV = ("parallel.schedule=zbv", "parallel.virtual_stages=2")
LAYOUTS = {"zbv-pp2": (2, ("parallel.pipeline=2", *ZBV)),
           "zbh1-pp4": (4, ("parallel.pipeline=4", "parallel.schedule=zb-h1")),
           "zbv-tp2-sp-pp2": (4, ("parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true", *ZBV)),
           "zbh1-pp2-cp2": (4, ("parallel.pipeline=2", "parallel.context=2", "parallel.schedule=zb-h1")),
           "zbv-pp2-zero1-dp2": (4, ("parallel.pipeline=2", "parallel.zero_stage=1", *ZBV))}


def test_launched_zero_bubble_runs_follow_one_process(tmp_path):
    """launch/run_pretrain.sh, 20 steps, tied embeddings, each loss within 1e-4 of one process: ZBV at PP 2, TP 2
    + SP × PP 2 and PP 2 × ZeRO-1 DP 2; ZB-H1 at PP 4 (where the middle stages hold no copy of the embedding)
    and PP 2 × CP 2."""
    single = single_losses(tmp_path / "one", *LAUNCHED)
    with ThreadPoolExecutor(2) as pool:
        runs = {name: pool.submit(launch, tmp_path / name, *LAUNCHED, *extra, nproc=nproc)
                for name, (nproc, extra) in LAYOUTS.items()}
        for name, run in runs.items():
            losses = [r["loss"] for r in run.result() if "loss" in r]
            assert len(losses) == len(single) == 20, name
            assert losses == pytest.approx(single, abs=1e-4), name
