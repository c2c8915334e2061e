"""The memory estimate (engine/memory_estimate.py, tools/estimate_memory.py) against what the engine allocates:
parameters, gradients and optimizer state byte for byte, at ZeRO 0-3, HSDP, TP, PP and bf16; activations
within 10% of the bytes autograd saves for backward (torch.autograd.graph.saved_tensors_hooks), for each
recomputation mode, with and without sequence parallelism, on first, middle and last pipeline chunks; the peak
(held tensors and the loss's transients) within 10% of the live tensor bytes of a step (engine/observe/tensor_peak.py)
on one rank and on TP, PP and ZeRO-3 layouts of two; Muon's step (its owner plan and the bytes it allocates at
once) byte for byte on each rank at one rank, DDP, ZeRO-1, ZeRO-3, TP and PP."""
import subprocess
import sys

import pytest
import torch

from engine.config.schema import load_config, validate
from engine.memory_estimate import (NS_BYTES, chunk_activation, defers_weight_grads, estimate, in_flight, muon_plan,
                                    parse_bytes, queued_output_gradients, report)
from engine.model import CausalLM
from engine.observe.tensor_peak import TensorPeak, replay_peak
from engine.train import Trainer
from kernels.grad_accumulation import WeightGradQueue
from parallel import comm
from parallel.distributed import DistEnv
from parallel.tensor import TensorParallel
from tests.distributed import worker_pools

TINY = "launch/configs/tiny.yaml"
BASE = ["model.num_layers=4", "run.dir=/tmp/trilith-memory-unused"]


@pytest.fixture(scope="module")
def pool():
    with worker_pools(2) as made:
        yield made[2]


def config(world, *overrides):
    cfg = load_config(TINY, [*BASE, *overrides])
    validate(cfg, world)
    return cfg


def storages(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def allocated(rank, world, *overrides) -> tuple:
    """(stage, measured (parameters, gradients, optimizer), estimated) of this rank after one training step,
    the gradients as they stand when the optimizer takes them."""
    cfg = config(world, *overrides)
    trainer = Trainer(cfg, DistEnv(rank, world))
    dp, opt = trainer.data_parallel, trainer.optimizer
    units = getattr(dp, "units", None)
    opt.zero_grad = lambda: None  # keep the gradients as the optimizer took them
    trainer.train_step()  # the optimizer state exists from the first step on
    if units is None:  # stage 0: the parameters, their .grad, fp32 masters (below fp32) and the moments
        params = [p for _, p in trainer.named_params]
        weights, grads = storages(params), storages(p.grad for p in params)
        state = [t for s in opt.inner.state.values() for k, t in s.items() if k != "step"]
        muon = opt.muon.momentum if opt.muon is not None else []
        optim = storages(state + muon + [m for m, p in zip(opt.master, opt.params) if m is not p])
    else:
        stage = cfg.parallel.zero_stage
        held_weights = [u.param_shard if stage == 3 else u.flat for u in units]
        weights = storages(held_weights)
        grads = sum(storages([u.full_grad, u.full_grad32, u.grad_shard, u.grad32]) for u in units)
        optim = storages(held_weights + opt.held_tensors()) - weights  # an fp32 stage-3 master is the shard
    shard_rank = comm.group_rank(dp.shard_group) if units is not None else 0
    want = estimate(cfg, world, shard_rank)[trainer.topo.pp_rank]
    return (trainer.topo.pp_rank, (weights, grads, optim), (want.parameters, want.gradients, want.optimizer))


def check_exact(results):
    for stage, got, want in results:
        assert got == want, (stage, got, want)


@pytest.mark.parametrize("overrides", [[], ["train.precision=bf16"], ["model.tie_embeddings=true",
                                                                      "model.attention_bias=true"],
                                       ["optim.name=muon", "train.precision=bf16", "model.attention_bias=true"]])
def test_parameters_gradients_and_optimizer_state_are_exact_on_one_rank(overrides):
    check_exact([allocated(0, 1, *overrides)])


@pytest.mark.parametrize("overrides", [
    ["parallel.zero_stage=1", "train.precision=bf16"],
    ["parallel.zero_stage=2", "train.precision=bf16", "parallel.fp32_reduce=[mlp.down_proj]"],
    ["parallel.zero_stage=3", "train.precision=bf16", "model.tie_embeddings=true"],
    ["parallel.zero_stage=3", "parallel.hsdp_group_size=1"],
    ["parallel.zero_stage=2", "model.hidden_size=63", "model.num_attention_heads=3", "model.num_kv_heads=3",
     "model.ffn_hidden_size=129", "model.vocab_size=255", "model.position_embedding=alibi"],  # odd: units padded
    ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.zero_stage=2", "model.vocab_size=255"],
    ["parallel.tensor=2", "model.num_kv_heads=1", "train.precision=bf16"],
    ["parallel.pipeline=2", "model.tie_embeddings=true", "parallel.zero_stage=1", "train.precision=bf16"],
    ["parallel.pipeline=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", "model.num_layers=5"],
    ["parallel.context=2", "parallel.zero_stage=1", "train.precision=bf16"],  # ZeRO shards over DP × CP
    ["parallel.context=2", "parallel.zero_stage=3"],
    ["optim.name=muon", "parallel.zero_stage=1", "train.precision=bf16"],  # Muon's ranges end mid-shard
    ["optim.name=muon", "parallel.zero_stage=3", "parallel.tensor=2", "model.num_kv_heads=1"],
])
def test_parameters_gradients_and_optimizer_state_are_exact_on_every_layout(pool, overrides):
    check_exact(pool.run(allocated, *overrides))


def saved_bytes(chunk: CausalLM, inputs, labels) -> int:
    """Bytes of the distinct storages autograd saves in one forward of `chunk`, less parameters and the RoPE
    tables (cached once per chunk, shared by every micro-batch: the estimate counts them apart)."""
    chunk._rope(chunk.cfg.seq_length, inputs.device, next(chunk.parameters()).dtype)
    shared = {t.untyped_storage().data_ptr() for t in [*chunk.parameters(), *next(iter(chunk._rope_cache.values()))]}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in shared:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk(inputs, labels if chunk.post_process else None)
    return sum(seen.values())


def chunk_saved(cfg, tp: TensorParallel, layer_ids, pre: bool, post: bool) -> tuple[int, int]:
    """(saved bytes measured, estimated) of one micro-batch through a chunk of `layer_ids`."""
    torch.manual_seed(0)
    chunk = CausalLM(cfg.model, tp, layer_ids=layer_ids, pre_process=pre, post_process=post)
    chunk.init_weights(cfg.train.seed)
    chunk.to(dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.train.precision])
    chunk.set_recompute(cfg.train.recompute)
    b, s, h = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1))
    local = s // tp.size if tp.sequence_parallel else s
    inputs = tokens[:, :-1] if pre else torch.randn(b, local, h, dtype=next(chunk.parameters()).dtype,
                                                    requires_grad=True)
    got = saved_bytes(chunk, inputs, tokens[:, 1:])
    return got, chunk_activation(cfg, len(layer_ids), pre, post, b, cfg.train.recompute)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("part", ["whole", "first", "middle", "last"])
def test_activations_are_within_10_percent_of_the_bytes_saved_for_backward(recompute, precision, part):
    cfg = config(1, f"train.recompute={recompute}", f"train.precision={precision}", "model.seq_length=64",
                 "model.vocab_size=1000")
    roles = {"whole": (range(4), True, True), "first": (range(2), True, False), "middle": (range(1, 3), False, False),
             "last": (range(2, 4), False, True)}[part]
    got, want = chunk_saved(cfg, TensorParallel(), *roles)
    assert abs(want / got - 1) <= 0.10, (got, want)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("part", ["middle", "last"])
def test_queued_output_gradients_are_within_10_percent_of_what_a_deferred_backward_holds(precision, part):
    cfg = config(1, f"train.precision={precision}", "model.seq_length=64", "model.vocab_size=1000")
    layer_ids, post = {"middle": (range(1, 3), False), "last": (range(2, 4), True)}[part]
    chunk = CausalLM(cfg.model, layer_ids=layer_ids, pre_process=False, post_process=post)
    chunk.init_weights(cfg.train.seed)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.train.precision]
    chunk.to(dtype=dtype)
    for param in chunk.parameters():  # as parallel/ddp marks them during a step
        param.grad, param.fuse_grad_accumulation = torch.zeros_like(param), True
    b, s, h = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size
    hidden = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, cfg.model.vocab_size, (b, s))
    with WeightGradQueue() as queue:
        out = chunk(hidden, labels) if post else chunk(hidden)
        (out if post else out.float().pow(2).mean()).backward()
    held = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for _, g, _ in queue.entries}
    want = queued_output_gradients(cfg, len(layer_ids), post, b)
    assert abs(want / sum(held.values()) - 1) <= 0.10, (sum(held.values()), want)
    queue.run()
    for stage, expected in ((0, False), (1, True)):
        assert defers_weight_grads(config(2, "parallel.pipeline=2"), stage) == expected
    assert not defers_weight_grads(config(2, "parallel.pipeline=2", "parallel.schedule=interleaved",
                                          "parallel.virtual_stages=2"), 1)
    for zero_stage, expected in ((1, True), (2, False), (3, True)):  # ZeRO-2 has no `.grad` views to queue into
        assert defers_weight_grads(config(2, "parallel.pipeline=2", f"parallel.zero_stage={zero_stage}"), 1) == expected


def tp_saved(rank, world, *overrides):
    cfg = config(world, "parallel.tensor=2", "model.seq_length=64", "model.vocab_size=1000", *overrides)
    trainer = Trainer(cfg, DistEnv(rank, world))
    return chunk_saved(cfg, trainer.tp, range(4), True, True)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", ["true", "false"])
def test_activations_under_tensor_and_sequence_parallelism(pool, recompute, sp):
    for got, want in pool.run(tp_saved, f"train.recompute={recompute}", f"parallel.sequence_parallel={sp}"):
        assert abs(want / got - 1) <= 0.10, (got, want)


def test_schedules_hold_the_micro_batches_their_warm_up_runs_ahead():
    cfg = config(8, "parallel.pipeline=4", "train.global_batch_size=16", "train.micro_batch_size=2")
    assert [in_flight(cfg, s, 8) for s in range(4)] == [4, 3, 2, 1]  # 1F1B: PP - stage
    cfg.parallel.schedule = "gpipe"
    assert in_flight(cfg, 3, 8) == 8
    cfg.parallel.schedule, cfg.parallel.virtual_stages = "interleaved", 2
    assert in_flight(cfg, 0, 8) == (3 * 2 + 4 + 1) / 2 and in_flight(cfg, 3, 8) == (4 + 1) / 2


def test_the_report_names_the_biggest_lever_when_it_does_not_fit():
    cfg = config(8, "parallel.tensor=2", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
                 "model.vocab_size=32000", "model.seq_length=2048", "train.micro_batch_size=4",
                 "train.global_batch_size=64", "model.num_attention_heads=16", "model.num_kv_heads=16")
    text = report(cfg, 8, parse_bytes("1GB"))
    assert "DOES NOT FIT" in text and "biggest lever: train.recompute=full saves" in text, text
    assert "fits: largest rank peak" in report(cfg, 8, parse_bytes("80GB"))


def test_device_memory_sizes_parse_or_name_the_form():
    assert parse_bytes("80GB") == parse_bytes("80 GiB") == 80 * 2**30 and parse_bytes("8e10") == 80_000_000_000
    with pytest.raises(ValueError, match="not a size like 80GB"):
        parse_bytes("eighty")


def test_the_tool_prints_the_estimate_and_refuses_bad_input_in_one_line():
    run = [sys.executable, "tools/estimate_memory.py", "--config", TINY]
    done = subprocess.run(run + ["--world-size", "2", "--device-memory", "80GB", "parallel.zero_stage=1"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "stage 0: parameters" in done.stdout and "fits" in done.stdout, done.stderr
    # without --world-size, one data-parallel rank of the layout, context parallelism included
    done = subprocess.run(run + ["parallel.context=2", "parallel.tensor=2"], capture_output=True, text=True)
    assert done.returncode == 0 and "(TP 2 × CP 2 × PP 1 × DP 1" in done.stdout, done.stderr
    for args, message in ((["--device-memory", "lots"], "not a size like 80GB"),
                          (["parallel.tensor=3"], "parallel.tensor"), (["model.hidden_sise=1"], "hidden_size")):
        done = subprocess.run(run + args, capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_pre_flight_prints_the_real_runs_estimate(tmp_path, capsys):
    from engine.preflight import main
    assert main(["--config", TINY, "--steps", "2", f"run.dir={tmp_path}", "model.num_layers=4"]) in (0, 1)
    out = capsys.readouterr().out
    assert "the real run's memory estimate per rank (TP 1 × PP 1 × DP 1" in out and "stage 0: parameters" in out


# -- the peak: held tensors and the loss's transients against the live tensor bytes of a step -------------------
def test_the_tensor_peak_replays_allocations_and_frees_in_time_order():
    # (ns, address, signed size): an out-of-order free at the same time as its address' next allocation, and the
    # free of a block allocated before the events (skipped)
    events = [(1, 0xA, 100), (2, 0xB, 50), (3, 0xA, -100), (3, 0xA, 30), (4, 0xC, -999), (5, 0xB, -50)]
    assert replay_peak(events) == 150 and replay_peak(events, since_ns=3) == 80
    assert replay_peak(events, until_ns=1) == 100


def test_the_tensor_peak_counts_live_tensor_bytes_within_its_measured_block():
    with TensorPeak() as peak:
        del_before = torch.empty(2**21)  # 8 MiB, freed before the block: not in the peak
        del del_before
        kept = torch.empty(2**18)  # 1 MiB, alive across the block: counted
        with peak.measuring():
            temporary = torch.empty(2**20)  # 4 MiB at once with `kept`
            del temporary
            later = torch.empty(2**19)  # 2 MiB, after the temporary is gone
        after = torch.empty(2**22)  # 16 MiB after the block: not in the peak
    assert peak.bytes == 5 * 2**20 and kept.numel() + later.numel() + after.numel() > 0


PEAK_SHAPE = ["model.vocab_size=4096", "model.seq_length=64", "train.global_batch_size=4", "train.micro_batch_size=1"]


def measured_peak(rank, world, *overrides) -> tuple:
    """(stage, live tensor bytes at the second step's peak, the estimate's peak) on this rank."""
    cfg = config(world, *PEAK_SHAPE, *overrides)
    with TensorPeak() as peak:
        trainer = Trainer(cfg, DistEnv(rank, world))
        trainer.train_step()  # creates the optimizer state
        with peak.measuring():
            trainer.train_step()
    stage = trainer.topo.pp_rank
    return stage, peak.bytes, estimate(cfg, world)[stage].peak


def check_peaks(results):
    for stage, got, want in results:
        assert abs(want / got - 1) <= 0.10, (stage, got, want)


def test_the_peak_is_within_10_percent_of_the_live_tensor_bytes_on_one_rank():
    check_peaks([measured_peak(0, 1)])  # torch's unsplit log-softmax: its fp32 gradients are the transients


@pytest.mark.parametrize("overrides", [
    ["parallel.tensor=2", "parallel.sequence_parallel=true"],  # the vocabulary-parallel chunked loss
    ["parallel.pipeline=2"],  # the loss on stage 1, whose queued output gradients hold the logits' gradient
    ["parallel.zero_stage=3"],
])
def test_the_peak_is_within_10_percent_of_the_live_tensor_bytes_on_two_ranks(pool, overrides):
    check_peaks(pool.run(measured_peak, *overrides))


# -- Muon's step: the owner plan the estimate derives, and what the step allocates ----------------------------
def muon_step(rank, world, *overrides) -> tuple:
    """(stage, whether the estimate's owner plan is the run's, the most bytes the second step's Muon update
    allocated at once on this rank, the plan's count for this rank, the estimate's for the stage, the bytes of
    the two all-to-alls' send buffers)."""
    cfg = config(world, "optim.name=muon", *overrides)
    trainer = Trainer(cfg, DistEnv(rank, world))
    trainer.train_step()
    part, measured = trainer.optimizer.muon, []
    step = part.step

    def measured_step(*args):
        with TensorPeak() as peak:
            step(*args)
        measured.append(peak.bytes)

    part.step = measured_step
    trainer.train_step()
    stage, run = trainer.topo.pp_rank, part.exchange.plan
    want = muon_plan(cfg, world, stage)
    same = (run.held, run.owner) == (want.held, want.owner)
    counted = want.transient_bytes(part.exchange.me, NS_BYTES[cfg.optim.muon_ns_dtype], cfg.optim.muon_nesterov)
    late = run.buffer_bytes(NS_BYTES[cfg.optim.muon_ns_dtype])
    return stage, same, measured[0], counted, estimate(cfg, world)[stage].optimizer_transient, late


# What the profiler can see beyond the step's own tensors, timing-dependent under load: gloo's worker thread
# drops its reference to an all-to-all's send buffer after wait() returns, so on a busy host the gather's can
# still be alive at the Newton-Schulz peak, and both at the update's (measured at load 12: 1,772,544 bytes on
# rank 1 of ZeRO-1 DP 2 = its count + 2 × 295,936); and the profiler counts every thread's allocations.
OTHER_THREADS = 256


def check_muon(results, workspace: float = 0.0):
    """The plans equal, each rank's measured bytes its count (up to `workspace` of it more: kernel workspaces,
    and what gloo's thread may still hold), and the estimate the fullest rank's count."""
    for stage, same, measured, counted, _, late in results:
        most = counted * (1 + workspace) + late + OTHER_THREADS
        assert same and counted <= measured <= most, (stage, same, measured, counted, late)
    for stage in {r[0] for r in results}:
        assert max(r[3] for r in results if r[0] == stage) == next(r[4] for r in results if r[0] == stage)


FP32_NS = "optim.muon_ns_dtype=fp32"  # bf16 matmuls on a CPU allocate fp32 workspaces, not always at one moment


def test_muons_step_allocates_what_the_estimate_counts_on_one_rank():
    check_muon([muon_step(0, 1, FP32_NS)])  # one owner of all: its last matrix's iteration and the upcasts


@pytest.mark.parametrize("overrides", [
    [FP32_NS],  # DDP: nothing gathered, every result sent
    [FP32_NS, "parallel.zero_stage=1", "train.precision=bf16"],  # pieces cut mid-matrix by the shards
    [FP32_NS, "parallel.zero_stage=3", "optim.muon_nesterov=false"],  # the inputs are the momentum buffers
    [FP32_NS, "parallel.tensor=2", "parallel.zero_stage=3", "model.num_kv_heads=1"],  # TP slices, k and v whole
    [FP32_NS, "parallel.pipeline=2"],  # a stage's own matrices
])
def test_muons_step_allocates_what_the_estimate_counts_on_every_layout(pool, overrides):
    check_muon(pool.run(muon_step, *overrides))


def test_muons_bf16_step_is_counted_but_for_the_cpus_matmul_workspaces(pool):
    check_muon(pool.run(muon_step, "parallel.zero_stage=1"), workspace=0.10)
