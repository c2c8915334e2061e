"""Muon across layouts equals one process (gloo, NCCL semantics, fp32, fp32 Newton–Schulz: ≤ 1e-5 over the
run): the owner exchange gives each matrix's Newton–Schulz the whole matrix under TP and ZeRO, once."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from parallel import comm
from tests.distributed import worker_pools
from tests.helpers import launch, tiny_trainer
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
    (2, {"zero_stage": 0}), (4, {"zero_stage": 0}), (2, {"zero_stage": 1}), (2, {"zero_stage": 2}),
    (2, {"zero_stage": 3}),
    (2, {"zero_stage": 0, "tensor": 2}), (4, {"zero_stage": 3, "tensor": 2, "sequence_parallel": True}),
    (4, {"zero_stage": 1, "pipeline": 2}), (4, {"zero_stage": 0, "tensor": 2, "sequence_parallel": True, "context": 2}),
    (4, {"zero_stage": 3, "hsdp_group_size": 2}),
], ids=["ddp-dp2", "ddp-dp4", "zero1-dp2", "zero2-dp2", "zero3-dp2", "tp2", "tp2-sp-zero3-dp2", "pp2-zero1-dp2",
        "tp2-sp-cp2", "hsdp-2x2"])
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


# The five launched layouts against one single-process reference (the same recipe in this process): a
# model of 2 layers, hidden 32, 16 tokens, so that the ranks' start-up, not their 20 steps, is the cost; two
# launches at a time (they are independent, and one waits while the other's ranks import torch).
LAUNCHED = ("optim.name=muon", "optim.muon_lr=0.02", "optim.muon_ns_dtype=fp32", "model.num_layers=2",
            "model.hidden_size=32", "model.ffn_hidden_size=64", "model.seq_length=16", "train.steps=20")
LAYOUTS = {"ddp-dp4": (4, ()), "zero1-dp4": (4, ("parallel.zero_stage=1",)),
           "tp2-pp2-zero3-dp2": (8, ("parallel.tensor=2", "parallel.pipeline=2", "parallel.zero_stage=3")),
           "tp2-sp-cp2-pp2": (8, ("parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.context=2",
                                  "parallel.pipeline=2")),
           "hsdp-2x2": (4, ("parallel.zero_stage=3", "parallel.hsdp_group_size=2"))}


def test_launched_layouts_follow_one_process(tmp_path):
    """launch/run_pretrain.sh, 20 steps, within 1e-4 of one process at DDP DP 4, ZeRO-1 DP 4, TP 2 × PP 2 × ZeRO-3
    DP 2, TP 2 + SP × CP 2 × PP 2 and HSDP 2 × 2 (NCCL semantics, fp32 Newton–Schulz)."""
    trainer = tiny_trainer(f"run.dir={tmp_path / 'one'}", *LAUNCHED)
    single = [trainer.train_step()["loss"] for _ in range(20)]
    with ThreadPoolExecutor(2) as pool:
        runs = {name: pool.submit(launch, tmp_path / name, *LAUNCHED, *extra, nproc=nproc)
                for name, (nproc, extra) in LAYOUTS.items()}
        for name, run in runs.items():
            losses = [r["loss"] for r in run.result() if "loss" in r]
            assert losses == pytest.approx(single, abs=1e-4), name
