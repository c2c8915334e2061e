"""Muon across layouts equals one process (gloo, NCCL semantics, fp32, fp32 Newton–Schulz: ≤ 1e-5 over the
run): the owner exchange gives each matrix's Newton–Schulz the whole matrix under TP and ZeRO, once."""
import pytest
import torch

from parallel import comm
from tests.distributed import worker_pools
from tests.helpers import launch
from tests.test_data_parallel import CURVE, assert_matches_reference, make_trainer, single_process_run, train_run

MUON = {**CURVE, "train": dict(CURVE["train"], steps=6),
        "optim": dict(CURVE["optim"], name="muon", muon_lr=0.02, muon_ns_dtype="fp32")}


@pytest.fixture(scope="module")
def pools():
    with worker_pools(2, 4) as made:
        yield made


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return single_process_run(MUON)


@pytest.mark.parametrize("world, parallel", [
    (2, {"zero_stage": 0}), (4, {"zero_stage": 0}), (2, {"zero_stage": 1}), (2, {"zero_stage": 3}),
    (2, {"zero_stage": 0, "tensor": 2}), (4, {"zero_stage": 3, "tensor": 2, "sequence_parallel": True}),
    (4, {"zero_stage": 1, "pipeline": 2}), (4, {"zero_stage": 0, "tensor": 2, "sequence_parallel": True, "context": 2}),
    (4, {"zero_stage": 3, "hsdp_group_size": 2}),
], ids=["ddp-dp2", "ddp-dp4", "zero1-dp2", "zero3-dp2", "tp2", "tp2-sp-zero3-dp2", "pp2-zero1-dp2", "tp2-sp-cp2",
        "hsdp-2x2"])
def test_muon_layouts_follow_single_process(pools, reference, world, parallel):
    results = pools[world].run(train_run, MUON, parallel)
    assert_matches_reference(results, reference, tp_size=parallel.get("tensor", 1))


def newton_schulz_share(rank, world, parallel):
    """(matrices this rank orthogonalises, their NS FLOPs, the step's all-to-all bytes recorded, the plan's)."""
    from engine.optim.muon import ns_flops
    trainer = make_trainer(rank, world, MUON, **parallel)
    exchange = trainer.optimizer.muon.exchange
    flops = sum(ns_flops(exchange.matrices[n].full_shape, 5) for n in exchange.owned())
    with comm.RECORD.capture() as events:
        trainer.train_step()
    recorded = sum(e.bytes for e in events if e.op == "all_to_all")
    return len(exchange.owned()), flops, recorded, exchange.buffer_bytes(4)


@pytest.mark.parametrize("parallel", [{"zero_stage": 0}, {"zero_stage": 3}], ids=["ddp", "zero3"])
def test_each_rank_orthogonalises_a_quarter_and_moves_what_the_plan_says(pools, parallel):
    shares = pools[4].run(newton_schulz_share, parallel)
    counts, flops = [s[0] for s in shares], [s[1] for s in shares]
    assert sum(counts) == 2 * 7  # 7 matrices a layer, each orthogonalised once
    assert max(flops) <= 1.5 * sum(flops) / 4, flops
    for _, _, recorded, planned in shares:
        assert recorded == planned > 0


def test_launched_tp2_pp2_zero3_dp2_follows_one_process(tmp_path):
    """launch/run_pretrain.sh at TP 2 × PP 2 × ZeRO-3 DP 2: each stage's owners, the TP slices gathered."""
    muon = ("optim.name=muon", "optim.muon_lr=0.02", "optim.muon_ns_dtype=fp32", "train.steps=10")
    single = [r["loss"] for r in launch(tmp_path / "one", *muon)]
    layout = [r["loss"] for r in launch(tmp_path / "eight", *muon, "parallel.tensor=2", "parallel.pipeline=2",
                                        "parallel.zero_stage=3", nproc=8)]
    assert layout == pytest.approx(single, abs=1e-4)
