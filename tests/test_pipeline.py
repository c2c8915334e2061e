"""Pipeline parallelism equals the single-process model (gloo, CPU, fp32, max abs ≤ 1e-5).

PP=2 runs as PP2×DP2 and PP=4 as PP4×DP1 on one pool of 4 ranks; GPipe, 1F1B and interleaved 1F1B give
the same loss and gradients; the 1F1B schedule holds at most p micro-batches' activations while GPipe
holds all m; a TP2×PP2×DP2 run of 8 processes follows the single-process loss curve (≤ 1e-4 per step).
"""
import itertools
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.config.schema import Config, ConfigError, ModelConfig, load_config, validate
from engine.memory_estimate import stage_chunks
from engine.model import CausalLM
from engine.observe.metrics import MetricsLog
from engine.stage_balance import chunk_layers, output_layer_cost
from engine.train import Trainer, build_model_chunks
from parallel import comm
from parallel.distributed import DistEnv
from parallel.p2p import PipelineComm
from parallel.pipeline_schedules import ScheduleTrace, forward_backward_no_pipeline, forward_backward_pipeline
from parallel.stage_layers import (balanced_layer_counts, chunk_layer_counts, stage_layer_ids,
                                   sum_tied_gradients, tied_embedding_weights)
from parallel.tensor import TensorParallel
from parallel.topology import Layout, Topology
from tests.distributed import WorkerPool, gloo_semantics
from tests.helpers import ROOT, TINY, tiny_trainer
from tools.pipeline_trace import analytic_bubble, bubble_fractions, timeline

TOL = 1e-5
MODEL = dict(hidden_size=32, num_layers=8, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
             vocab_size=61, seq_length=8)
MICRO, SAMPLES = 2, 16  # 8 micro-batches in all: 4 per DP rank at PP2×DP2, 8 at PP4


@pytest.fixture(scope="module")
def pool():
    made = WorkerPool(4)
    yield made
    made.close()


def _config(pp: int, schedule: str, virtual: int, stage_layers, tie: bool) -> Config:
    cfg = Config(model=ModelConfig(**MODEL, tie_embeddings=tie))
    cfg.parallel.pipeline, cfg.parallel.schedule, cfg.parallel.virtual_stages = pp, schedule, virtual
    cfg.parallel.stage_layers = list(stage_layers or [])
    return cfg


def _samples() -> torch.Tensor:
    return torch.randint(0, MODEL["vocab_size"], (SAMPLES, MODEL["seq_length"] + 1),
                         generator=torch.Generator().manual_seed(3))


def _sync_gradients(chunks, named, topo):
    """What the data-parallel wrapper does after backward: tied copies summed, then averaged over DP."""
    sum_tied_gradients([w.grad for w in tied_embedding_weights(chunks)], topo.groups.get("embedding"))
    for _, p in named:
        comm.all_reduce(p.grad, topo.dp_group)
        p.grad /= topo.dp_size


def pipeline_step(rank, world, pp, schedule, virtual=1, stage_layers=None, tie=False):
    """One forward/backward of the pipeline; returns loss, gradients by name and the trace's peak."""
    cfg = _config(pp, schedule, virtual, stage_layers, tie)
    topo = Topology(Layout(pp=pp, dp=world // pp), rank)
    chunks = build_model_chunks(cfg, topo, TensorParallel())
    for chunk in chunks:
        chunk.init_weights(7)
    per_rank = SAMPLES // topo.dp_size
    mine = _samples()[topo.dp_rank * per_rank:(topo.dp_rank + 1) * per_rank]
    pipe = PipelineComm.for_model(topo, cfg.model, MICRO, False, torch.float32, torch.device("cpu"))
    trace = ScheduleTrace()
    with comm.RECORD.capture() as events:
        loss = forward_backward_pipeline(schedule, chunks, list(mine.split(MICRO)), pipe, trace=trace).mean()
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    _sync_gradients(chunks, named, topo)
    comm.all_reduce(loss, topo.dp_group)
    sends = sum(1 for e in events if e.op == "send")
    return {"loss": loss.item() / topo.dp_size, "grads": {n: p.grad.clone() for n, p in named},
            "peak_live": trace.peak_live, "pp_rank": topo.pp_rank, "sends": sends,
            "duplicate": [n for n, p in named if getattr(p, "pipeline_duplicate", False)]}


def _reference(tie: bool):
    model = CausalLM(ModelConfig(**MODEL, tie_embeddings=tie))
    model.init_weights(7)
    loss = forward_backward_no_pipeline(model, list(_samples().split(MICRO))).mean()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _check_against_reference(results, tie):
    ref_loss, ref_grads = _reference(tie)
    seen = set()
    for r in results:
        assert abs(r["loss"] - ref_loss) <= TOL, (r["loss"], ref_loss)
        for name, grad in r["grads"].items():
            expected = ref_grads["model.embed_tokens.weight" if name in r["duplicate"] else name]
            torch.testing.assert_close(grad, expected, rtol=0, atol=TOL, check_dtype=False,
                                       msg=lambda m: f"{name}: {m}")
            seen.add(name)
    assert set(ref_grads) <= seen


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_pp2_dp2_1f1b_matches_single_process(pool, tie):
    _check_against_reference(pool.run(pipeline_step, 2, "1f1b", tie=tie), tie)


def test_pp4_schedules_match_single_process_and_each_other(pool):
    runs = {name: pool.run(pipeline_step, 4, name, virtual=v, tie=True)
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))}
    for results in runs.values():
        _check_against_reference(results, tie=True)
    merged = {k: {n: g for r in res for n, g in r["grads"].items() if n not in r["duplicate"]}
              for k, res in runs.items()}
    for name, grad in merged["1f1b"].items():
        for schedule in ("gpipe", "interleaved"):
            torch.testing.assert_close(merged[schedule][name], grad, rtol=0, atol=1e-6, check_dtype=False,
                                       msg=lambda m: f"{schedule} {name}: {m}")
    m, p = 8, 4
    assert [r["peak_live"] for r in runs["1f1b"]] == [p - s for s in range(p)]  # ≤ p, not m
    assert all(r["peak_live"] == m for r in runs["gpipe"])
    v = 2  # interleaved: Megatron's warm-up depth plus one, counted in chunks (1/v of a stage each)
    assert [r["peak_live"] for r in runs["interleaved"]] == [2 * (p - s - 1) + (v - 1) * p + 1 for s in range(p)]
    # one activation and one gradient per micro-batch across each boundary between consecutive chunks
    assert sum(r["sends"] for r in runs["1f1b"]) == sum(r["sends"] for r in runs["gpipe"]) == 2 * m * (p - 1)
    assert sum(r["sends"] for r in runs["interleaved"]) == 2 * m * (2 * p - 1)


def sent_activation_sizes(rank, world, schedule, virtual):
    """Elements each sent activation still holds after the step (its tensor kept for backward)."""
    from parallel import pipeline_schedules
    sent, forward = [], pipeline_schedules._Steps.forward

    def recording(self, chunk_id, mb, received):
        out = forward(self, chunk_id, mb, received)
        if not self.chunks[chunk_id].post_process:
            sent.append(out)
        return out
    pipeline_schedules._Steps.forward = recording
    try:
        result = pipeline_step(rank, world, 4, schedule, virtual=virtual)
    finally:
        pipeline_schedules._Steps.forward = forward
    return result["pp_rank"], [t.untyped_storage().nbytes() // t.element_size() for t in sent]


def test_sent_activations_are_released_after_the_send(pool):
    """Megatron's deallocate_output_tensor: a stage keeps no values of what it sent, only the autograd node
    (the gradients above prove backward still works). p=4, m=8, micro 2 × seq 8 × hidden 32 per activation."""
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for pp_rank, sizes in pool.run(sent_activation_sizes, schedule, v):
            expected = 8 * v if pp_rank < 3 else 8 * (v - 1)  # the last chunk sends nothing
            assert len(sizes) == expected and all(n == 1 for n in sizes), (schedule, pp_rank, sizes)


def _done_before_receive(pipe, first_stage: bool, action, key: str, sent) -> bool:
    """The first stage runs `action(pipe)`, then sets `key` in the process group's store; the next stage returns
    whether `key` was set before it posted its own receive (waiting up to 10 s, then receiving anyway, so
    nothing hangs) and the activation received is `sent`. A gloo send completes only once its receive is
    posted, so an exchange that waited for its send could not return first."""
    store = dist.distributed_c10d._get_default_store()
    if first_stage:
        action(pipe)
        store.set(key, "1")
        return True
    try:
        store.wait([key], timedelta(seconds=10))
        first = True
    except RuntimeError:  # the store's timeout
        first = False
    received = pipe.communicate(recv_prev=True)[0]
    return first and torch.equal(received, sent)


def exchange_overlaps(rank, world, run: int):
    with gloo_semantics():
        return _exchange_overlaps(rank, world, run)


def _exchange_overlaps(rank, world, run: int):
    topo = Topology(Layout(pp=2, dp=world // 2), rank)
    pipe = PipelineComm.for_model(topo, ModelConfig(**MODEL), MICRO, False, torch.float32, torch.device("cpu"))
    sent = torch.arange(torch.Size(pipe.shape).numel(), dtype=torch.float32).reshape(pipe.shape)
    key = f"overlap-{run}-{topo.dp_rank}"
    results = [_done_before_receive(pipe, topo.is_first_stage, lambda p: p.communicate(send_next=sent),
                                    key + "-send", sent)]
    if not topo.is_first_stage:
        pipe.prefetch_forward()
    # finish() waits for the send, so it returns only if the receive was already posted by the prefetch
    results.append(_done_before_receive(pipe, topo.is_first_stage,
                                        lambda p: (p.communicate(send_next=sent), p.finish()), key + "-prefetch",
                                        sent))
    pipe.finish()
    return results


def test_sends_stay_in_flight_and_receives_are_prefetched(pool):
    """An exchange waits for its receives only, and `prefetch_forward` posts the next activation's receive
    at once on gloo (1F1B calls it before each steady-state backward), so the transfer overlaps compute."""
    assert pool.run(exchange_overlaps, time.time_ns()) == [[True, True]] * 4


def prefetched_receives(rank, world):
    """For each exchange of an interleaved step that receives an activation: was that receive posted early?"""
    used, communicate = [], PipelineComm.communicate

    def recording(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        if recv_prev:
            used.append(self._prefetched is not None)
        return communicate(self, send_next, send_prev, recv_prev, recv_next)
    PipelineComm.communicate = recording
    try:
        with gloo_semantics():
            pipeline_step(rank, world, 4, "interleaved", virtual=2, tie=True)
    finally:
        PipelineComm.communicate = communicate
    return used


def test_interleaved_schedule_prefetches_every_activation_after_the_first(pool):
    """On gloo each activation's receive is posted before the compute that precedes its exchange (a forward
    in the warm-up, a backward in the steady state); only a stage's very first receive has nothing before it."""
    for used in pool.run(prefetched_receives):
        assert used and all(used[1:]), used


def timed_pipeline_step(rank, world):
    """A step with the straggler timer on (engine/observe/stragglers.py): every exchange is waited for where it is
    posted, and the exchange must not wait for those operations a second time (on gloo that never returns)."""
    comm.TIMER.active = True
    try:
        return pipeline_step(rank, world, 2, "1f1b")
    finally:
        comm.TIMER.active = False


def test_timed_steps_match_single_process(pool):
    _check_against_reference(pool.run(timed_pipeline_step, timeout=120), tie=False)


def test_pp2_interleaved_and_explicit_stage_layers(pool):
    _check_against_reference(pool.run(pipeline_step, 2, "interleaved", virtual=2, tie=True), tie=True)
    _check_against_reference(pool.run(pipeline_step, 4, "1f1b", stage_layers=[3, 3, 1, 1]), tie=False)


def test_stage_layer_assignment():
    assert stage_layer_ids(8, 4, 1, [3, 3, 1, 1]) == [[[0, 1, 2]], [[3, 4, 5]], [[6]], [[7]]]
    assert chunk_layer_counts(10, 4) == [3, 3, 2, 2]
    # interleaved: chunk c of the model lives on rank c mod p
    assert stage_layer_ids(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    with pytest.raises(ValueError, match="summing to model.num_layers=8"):
        chunk_layer_counts(8, 4, [3, 3, 1, 2])


def test_compute_balanced_split():
    for layers, chunks in itertools.product(range(1, 13), range(1, 7)):  # no extras: the even split
        if layers >= chunks:
            assert balanced_layer_counts(layers, chunks) == chunk_layer_counts(layers, chunks)
    for layers, chunks, first, last in itertools.product(range(2, 9), range(2, 5), (0.0, 0.7), (0.3, 1.5, 2.3, 6.0)):
        if layers < chunks:
            continue
        got = balanced_layer_counts(layers, chunks, first, last)
        cost = lambda counts: max(n + first * (c == 0) + last * (c == chunks - 1) for c, n in enumerate(counts))
        best = min(cost(s) for s in itertools.product(range(1, layers + 1), repeat=chunks) if sum(s) == layers)
        assert sum(got) == layers and min(got) >= 1 and cost(got) == pytest.approx(best), (layers, chunks, got)
    bench = ["model.hidden_size=256", "model.num_layers=4", "model.num_attention_heads=8", "model.num_kv_heads=8",
             "model.ffn_hidden_size=688", "model.vocab_size=8192", "model.seq_length=256", "parallel.pipeline=2"]
    cfg = load_config(TINY, bench + ["parallel.stage_balance=compute"])
    assert output_layer_cost(cfg) == pytest.approx(2.27, abs=0.01)  # the 8192-token output layer ≈ 2.3 layers
    assert chunk_layers(cfg) == [3, 1] and stage_chunks(cfg, 0) == [(3, True, False)]
    assert chunk_layers(load_config(TINY, bench)) == [2, 2]
    assert chunk_layers(load_config(TINY, bench + ["parallel.stage_balance=compute", "parallel.stage_layers=[1,3]"])) \
        == [1, 3]  # an explicit split wins


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.pipeline=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
      "train.global_batch_size=6"], 2, "needs the number of micro-batches (3 = global_batch_size / "
                                       "(micro_batch_size × dp)) to be a multiple of parallel.pipeline=2"),
    (["parallel.pipeline=2", "parallel.virtual_stages=2"], 2, "needs parallel.schedule=interleaved"),
    (["parallel.virtual_stages=2", "parallel.schedule=interleaved"], 1, "needs parallel.pipeline > 1"),
    (["parallel.pipeline=2", "parallel.schedule=interleaved"], 2, "needs parallel.virtual_stages ≥ 2"),
    (["parallel.pipeline=2", "parallel.stage_layers=[3, 2]"], 2, "summing to model.num_layers=4"),
    (["parallel.pipeline=2", "parallel.stage_layers=[4]"], 2, "2×1 = 2 chunks"),
    (["parallel.pipeline=2", "parallel.stage_layers=[2, x]"], 2, "parallel.stage_layers[1]: expected an integer"),
])
def test_invalid_pipeline_configs_are_rejected(overrides, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(TINY, overrides), world)


def trainer_steps(rank, world, overrides):
    cfg = load_config(TINY, overrides)
    trainer = Trainer(cfg, DistEnv(rank, world))
    losses = [trainer.train_step()["loss"] for _ in range(cfg.train.steps)]
    return losses, trainer.topo.tp_rank, [p.detach().clone() for p in tied_embedding_weights(trainer.chunks)]


@pytest.mark.parametrize("layout", [["parallel.pipeline=2"],
                                    ["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                                     "parallel.schedule=interleaved", "parallel.virtual_stages=2"]],
                         ids=["pp2-dp2", "tp2-sp-pp2-interleaved"])
def test_trainer_steps_match_single_process_and_tied_copies_stay_equal(pool, layout):
    common = ["train.steps=3", "model.tie_embeddings=true"]
    reference, _, _ = trainer_steps(0, 1, common)
    results = pool.run(trainer_steps, common + layout)
    for losses, _, _ in results:
        assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-5, (losses, reference)
    by_tp_rank: dict = {}
    for _, tp_rank, weights in results:
        by_tp_rank.setdefault(tp_rank, []).extend(weights)
    assert sum(len(c) for c in by_tp_rank.values()) == 4  # embedding on first-stage ranks, lm_head on last
    for copies in by_tp_rank.values():
        assert len(copies) >= 2 and all(torch.equal(copies[0], w) for w in copies[1:])


def trained_parameters(rank, world, overrides):
    """Every parameter of this rank's chunks (ZeRO: its master shards) after the steps, and which schedule slots
    the last step ran."""
    trainer = Trainer(load_config(TINY, overrides), DistEnv(rank, world))
    for step in range(trainer.cfg.train.steps):
        if step == trainer.cfg.train.steps - 1:
            trainer.schedule_trace = ScheduleTrace()
        trainer.train_step()
    kinds = sorted({event[0] for event in trainer.schedule_trace.events})
    if trainer.cfg.parallel.zero_stage:
        return trainer.topo.pp_rank, kinds, [m.clone() for m in trainer.optimizer.master]
    return trainer.topo.pp_rank, kinds, [p.detach().clone() for chunk in trainer.chunks for p in chunk.parameters()]


@pytest.mark.parametrize("layout", [["parallel.pipeline=2"], ["parallel.pipeline=2", "parallel.schedule=gpipe"],
                                    ["parallel.pipeline=4", "train.recompute=full"],
                                    ["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"],
                                    ["parallel.pipeline=2", "parallel.zero_stage=1"],
                                    ["parallel.pipeline=2", "parallel.zero_stage=3"]],
                         ids=["pp2-dp2-1f1b", "pp2-dp2-gpipe", "pp4-1f1b-recompute", "tp2-sp-pp2-1f1b", "pp2-dp2-zero1",
                              "pp2-dp2-zero3"])
def test_deferred_weight_gradients_train_bit_identically(pool, layout):
    """parallel.defer_weight_grads sends the waiting backwards' input gradients before their weight gradients
    (W slots on every stage but the first) and changes no bit of the trained parameters, the DP buckets
    (pp2-dp2) and ZeRO's unit reductions still launching once each weight gradient is in."""
    common = ["train.steps=2"] + layout
    deferred = sorted(pool.run(trained_parameters, common), key=lambda r: r[0])
    direct = sorted(pool.run(trained_parameters, common + ["parallel.defer_weight_grads=false"]), key=lambda r: r[0])
    for (stage, kinds, params), (_, direct_kinds, direct_params) in zip(deferred, direct):
        assert kinds == (["B", "F"] if stage == 0 else ["B", "F", "W"]) and direct_kinds == ["B", "F"]
        assert len(params) == len(direct_params) and all(map(torch.equal, params, direct_params))


def test_document_masked_packing_matches_single_process_under_tp_sp_pp(pool):
    # vocab 40: the mock data's progressions hit the end-of-document id in most samples.
    docs = ["train.steps=3", "model.vocab_size=40", "data.eod_token_id=5", "data.reset_attention_mask=true",
            "data.reset_position_ids=true", "data.eod_mask_loss=true"]
    reference, _, _ = trainer_steps(0, 1, docs)
    packed_plainly, _, _ = trainer_steps(0, 1, docs[:3])
    assert max(abs(a - b) for a, b in zip(reference, packed_plainly)) > 1e-2  # the switches change the loss
    for layout in (["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"],
                   ["parallel.pipeline=2", "parallel.zero_stage=3"]):  # the second with DP=2
        for losses, _, _ in pool.run(trainer_steps, docs + layout):
            assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-5, (layout, losses, reference)


def trainer_evaluations(rank, world, overrides):
    trainer = tiny_trainer(*overrides, rank=rank, world=world)
    before = trainer.evaluate()
    trainer.train_step()
    return [before, trainer.evaluate(), trainer.evaluate()]


def test_validation_loss_matches_single_process_on_every_layout(pool):
    common = ["train.eval_iters=2"]  # no dropout: its masks differ by layout (see Pipeline parallelism)
    reference = trainer_evaluations(0, 1, common)
    assert reference[1] < reference[0] and reference[1] == reference[2]  # it learned; same samples each time
    for layout in (["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                    "parallel.schedule=interleaved", "parallel.virtual_stages=2"],
                   ["parallel.pipeline=2", "parallel.zero_stage=3"], ["parallel.tensor=2", "parallel.zero_stage=1"]):
        for got in pool.run(trainer_evaluations, common + layout):
            assert max(abs(a - b) for a, b in zip(got, reference)) <= 1e-5, (layout, got, reference)


def _records(rank, world, run_dir: str, overrides) -> list[dict]:
    """Every step's record of a 10-step run of the tiny recipe with `overrides` (validated as the launcher
    validates), trained on `world` ranks as launch/run_pretrain.sh trains them."""
    torch.set_num_threads(1)
    trainer = tiny_trainer(f"run.dir={run_dir}", "train.steps=10", *overrides, rank=rank, world=world,
                           validated=True)
    return trainer.train(MetricsLog(run_dir, enabled=False))


@pytest.fixture(scope="module")
def pool8():
    made = WorkerPool(8)
    yield made
    made.close()


def test_tp2_pp2_dp2_on_8_processes_follows_single_process_curve(pool8, tmp_path):
    single = [r["loss"] for r in _records(0, 1, str(tmp_path / "single"), [])]
    layered = [r["loss"] for r in pool8.run(_records, str(tmp_path / "3d"),
                                            ["parallel.tensor=2", "parallel.pipeline=2"])[0]]
    assert len(layered) == len(single) == 10
    for step, (a, b) in enumerate(zip(single, layered), 1):
        assert abs(a - b) <= 1e-4, (step, a, b)


def test_every_feature_at_once_on_8_processes_follows_the_single_process(pool8, tmp_path):
    """TP2 + SP × PP2 × DP2 with ZeRO-3, document-masked packing, the fused output loss, validation and the
    monitor's readings: losses and validation losses within 1e-4 of one process, head-variance ratios 1e-3."""
    features = ["model.vocab_size=64", "data.eod_token_id=5", "data.reset_attention_mask=true",
                "data.reset_position_ids=true", "data.eod_mask_loss=true", "model.fused_lm_head_loss=true",
                "model.loss_chunk_tokens=16", "train.eval_interval=5", "train.eval_iters=2", "run.monitor_interval=5"]
    single = _records(0, 1, str(tmp_path / "single"), features)
    layered = pool8.run(_records, str(tmp_path / "3d"), [*features, "parallel.tensor=2", "parallel.pipeline=2",
                                                         "parallel.sequence_parallel=true", "parallel.zero_stage=3"])[0]
    assert [r["step"] for r in layered] == list(range(1, 11))
    for a, b in zip(single, layered):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a["step"], a["loss"], b["loss"])
        assert ("eval_loss" in a) == ("eval_loss" in b) == (a["step"] % 5 == 0)
        if "eval_loss" in a:
            assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-4
            assert all(abs(x / y - 1) <= 1e-3 for x, y in zip(a["head_grad_variance_ratio"],
                                                                b["head_grad_variance_ratio"]))
            assert len(b["attention_entropy"]) == 4


def test_bubble_measurement_matches_analytic_on_an_ideal_gpipe_trace():
    p, m = 4, 6
    traces = []
    for stage in range(p):  # unit-time slots; backward starts once the last stage's forwards are done
        fwd = [("F", i, 0, stage + i, stage + i + 1) for i in range(m)]
        b0 = m + p - 1 + (p - 1 - stage)
        traces.append(fwd + [("B", i, 0, b0 + i, b0 + i + 1) for i in range(m)])
    for measured in bubble_fractions(traces):
        assert measured == pytest.approx(analytic_bubble("gpipe", p, m))
    assert analytic_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert len(timeline(traces, width=40)) == p


def test_pipeline_trace_tool_runs(tmp_path):
    done = subprocess.run([sys.executable, "tools/pipeline_trace.py", "--pipeline", "2", "--micro-batches", "4",
                           "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("stage ")]
    assert len(lines) == 4 and "analytic 0.200" in lines[0] and "peak live micro-batches  2" in lines[0]
    # 1F1B: whole backwards, and on the last stage the cool-down's split ones
    assert re.search(r"^stage 0: slot costs \(shortest, ms\) F0 [\d.]+  BW0 [\d.]+$", lines[2]), lines
    assert re.search(r"^stage 1: slot costs \(shortest, ms\) F0 [\d.]+  BW0 [\d.]+  B0 [\d.]+  W0 [\d.]+$",
                     lines[3]), lines


def test_trace_on_cuda_times_slots_with_events_on_the_compute_stream(monkeypatch):
    """On CUDA a slot's ends are events on the stream, read after one synchronisation: the slot lasts as long
    as its kernels ran (here 5 ms of fake GPU time each), however quickly the host queued them."""
    clock = {"gpu_ms": 0.0, "synchronised": 0}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            clock["gpu_ms"] += 5.0
            self.at = clock["gpu_ms"]

        def elapsed_time(self, other):
            return other.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: clock.__setitem__("synchronised",
                                                                              clock["synchronised"] + 1))
    trace = ScheduleTrace(torch.device("cuda", 0))
    for mb in range(2):
        trace.add("F", mb, 0, trace.mark(), trace.mark())
    events = trace.events
    assert [round(end - start, 6) for _, _, _, start, end in events] == [0.005, 0.005]
    assert round(events[1][3] - events[0][3], 6) == 0.01 and trace.peak_live == 2
    assert clock["synchronised"] == 2  # at the first mark (the wall-clock origin) and when read
    assert trace.compute_events == events  # the GPU's time is already the slot's own


def test_trace_on_cpu_charges_a_slot_the_cpu_time_of_its_thread():
    """A rank off its core mid-slot (here asleep 50 ms) is charged only what it computed: the replay's costs
    (compute_events) leave out the waits that the wall clock (events) counts."""
    trace = ScheduleTrace()
    start = trace.mark()
    time.sleep(0.05)
    trace.add("F", 0, 0, start, trace.mark())
    start, spun = trace.mark(), time.thread_time()
    while time.thread_time() - spun < 0.02:
        sum(range(1000))  # work on the CPU, charged to this thread
    trace.add("B", 0, 0, start, trace.mark())
    (_, _, _, wall_f, wall_f_end), (_, _, _, wall_b, wall_b_end) = trace.events
    (_, _, _, cpu_f, cpu_f_end), (_, _, _, cpu_b, cpu_b_end) = trace.compute_events
    assert (cpu_f, cpu_b) == (wall_f, wall_b)  # starts on the wall clock, which orders the ranks' slots
    assert wall_f_end - wall_f >= 0.05 > 0.01 > cpu_f_end - cpu_f
    assert wall_b_end - wall_b >= cpu_b_end - cpu_b >= 0.02
