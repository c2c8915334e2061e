"""The zero-bubble schedules (parallel/zero_bubble*.py) against 1F1B and the single-process model (gloo, CPU,
fp32, NCCL semantics): ZB-H1 and ZBV at PP 2 and PP 4 give 1F1B's loss and gradients bit for bit (each
`.grad` sums its micro-batches in the same order); their plans keep 1F1B's peak activation count; invalid
settings are refused in one line.
"""
import re

import pytest
import torch

from engine.config.schema import ConfigError, load_config, validate
from parallel.stage_layers import balanced_v_layer_counts, chunk_roles, stage_layer_ids
from parallel.zero_bubble_plan import critical_order, idle_fraction, plan
from tests.distributed import WorkerPool
from tests.helpers import TINY
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


@pytest.mark.parametrize("layout", [["parallel.pipeline=2", "model.tie_embeddings=true"],
                                    ["parallel.pipeline=4", "train.recompute=full"],
                                    ["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"],
                                    ["parallel.pipeline=2", "parallel.context=2"],
                                    ["parallel.pipeline=2", "parallel.zero_stage=1", "model.tie_embeddings=true"]],
                         ids=["pp2-dp2-tied", "pp4-recompute", "tp2-sp-pp2", "pp2-cp2", "pp2-dp2-zero1-tied"])
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
