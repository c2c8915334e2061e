"""Bucketed DDP and ZeRO-1/2/3 (FSDP) equal the single-process run (gloo, CPU, fp32: ≤ 1e-5 per step)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from engine.config.schema import ConfigError, from_dict, validate
from engine.train import Trainer
from parallel import comm
from parallel.distributed import DistEnv
from parallel.tensor import padded_vocab_size
from tests.distributed import worker_pools
from tests.helpers import launch

TOL = 1e-5
CURVE = {"model": dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=1, ffn_hidden_size=64,
                       vocab_size=61, seq_length=16),
         "train": dict(micro_batch_size=1, global_batch_size=8, steps=20, seed=7),
         "optim": dict(lr=3e-3, warmup_steps=2), "data": dict(mock=True)}
# units (41k elements) small against Ψ (337k) so the ZeRO memory formulas are meaningful
MEMORY = {"model": dict(hidden_size=64, num_layers=8, num_attention_heads=4, ffn_hidden_size=128, vocab_size=64,
                        seq_length=8),
          "train": dict(micro_batch_size=1, global_batch_size=4, steps=1, precision="bf16"), "data": dict(mock=True)}


def make_config(base: dict, **parallel):
    raw = {k: dict(v) for k, v in base.items()}
    raw["parallel"] = parallel
    raw["run"] = {"dir": os.path.join(tempfile.gettempdir(), "trilith-test-data-parallel")}  # outside the checkout: the Trainer creates checkpoints/ there
    return from_dict(raw)


def make_trainer(rank, world, base, **parallel):
    cfg = make_config(base, **parallel)
    validate(cfg, world)
    return Trainer(cfg, DistEnv(rank, world, 0, torch.device("cpu"), "gloo"))


def final_weights(trainer) -> tuple[int, dict]:
    """(TP rank, {name: (tp_dim, [(start, end, fp32 values)])}) of the weights this rank holds or owns."""
    params = dict(trainer.named_params)
    if trainer.cfg.parallel.zero_stage == 0:
        return trainer.topo.tp_rank, {n: (p.tp_dim, [(0, p.numel(), p.detach().float().reshape(-1).clone())])
                                      for n, p in params.items()}
    return trainer.topo.tp_rank, {n: (params[n].tp_dim, [(*s["range"], s["master"].clone())])
                                  for n, s in trainer.optimizer.owned_state().items()}


def train_run(rank, world, base, parallel):
    trainer = make_trainer(rank, world, base, **parallel)
    history = [trainer.train_step() for _ in range(trainer.cfg.train.steps)]
    return [h["loss"] for h in history], [h["grad_norm"] for h in history], final_weights(trainer)


@pytest.fixture(scope="module")
def pools():
    with worker_pools(2, 4) as made:
        yield made


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return single_process_run(CURVE)


def single_process_run(base: dict):
    """(losses, gradient norms, {name: parameter}) of `base` trained in one process: the reference."""
    trainer = make_trainer(0, 1, base)
    history = [trainer.train_step() for _ in range(base["train"]["steps"])]
    return [h["loss"] for h in history], [h["grad_norm"] for h in history], dict(trainer.named_params)


def assert_matches_reference(results, reference, tp_size=1):
    ref_losses, ref_norms, ref_params = reference
    for losses, norms, _ in results:
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= TOL, f"step {step + 1}: loss {a} vs single-process {b}"
        for a, b in zip(norms, ref_norms):
            assert abs(a - b) <= TOL * max(1.0, b), f"grad norm {a} vs {b}"
    for tp_rank in range(tp_size):
        pieces: dict = {}
        for _, _, (r, weights) in results:
            if r == tp_rank:
                for name, (tp_dim, parts) in weights.items():
                    pieces.setdefault(name, (tp_dim, []))[1].extend(parts)
        assert set(pieces) == set(ref_params)
        for name, (tp_dim, parts) in pieces.items():
            expected = tp_local(ref_params[name].detach(), tp_dim, tp_size, tp_rank).reshape(-1)
            covered = torch.zeros(expected.numel(), dtype=torch.bool)
            for start, end, values in parts:
                torch.testing.assert_close(values, expected[start:end], rtol=0, atol=TOL, check_dtype=False,
                                           msg=lambda m: f"{name}: {m}")
                covered[start:end] = True
            assert covered.all(), f"{name}: some elements are owned by no rank"


def tp_local(full: torch.Tensor, tp_dim, tp_size: int, tp_rank: int) -> torch.Tensor:
    """The TP-local slice of a single-process weight (vocabulary rows padded to a multiple of TP)."""
    if tp_dim is None:
        return full
    rows = padded_vocab_size(full.shape[0], tp_size)
    padded = torch.zeros((rows,) + tuple(full.shape[1:]))
    padded[: full.shape[0]] = full
    return padded.chunk(tp_size, dim=tp_dim)[tp_rank]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_follows_single_process(pools, reference, dp, stage):
    assert_matches_reference(pools[dp].run(train_run, CURVE, {"zero_stage": stage}), reference)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_single_process_zero3(reference, tie):
    """Groups of one (no communication) and, when tied, one unit holding the embedding and the final norm."""
    base = {**CURVE, "model": dict(CURVE["model"], tie_embeddings=tie)}
    runs = []
    for stage in (0, 3):
        trainer = make_trainer(0, 1, base, zero_stage=stage)
        runs.append([trainer.train_step()["loss"] for _ in range(5)])
    assert runs[1] == pytest.approx(runs[0], abs=TOL)
    if not tie:
        assert runs[0] == pytest.approx(reference[0][:5], abs=TOL)


@pytest.mark.parametrize("parallel", [{"zero_stage": 3, "hsdp_group_size": 2},
                                      {"zero_stage": 2, "hierarchical_node_size": 2},
                                      {"zero_stage": 0, "hierarchical_node_size": 2, "bucket_mb": 0.01},
                                      {"zero_stage": 3, "unit_process_groups": True},
                                      {"zero_stage": 3, "unit_process_groups": True, "unit_group_count": 3}],
                         ids=["hsdp", "hierarchical-zero2", "hierarchical-ddp", "unit-groups", "unit-groups-shared"])
def test_hybrid_hierarchical_and_unit_groups_equal_flat(pools, reference, parallel):
    assert_matches_reference(pools[4].run(train_run, CURVE, parallel), reference)


def stages_not_issued(data_parallel) -> int:
    """Stages of hierarchical or HSDP reductions that backward left for later (issued after its hooks returned)."""
    if hasattr(data_parallel, "staged"):  # BucketedDDP
        return sum(r.stages_left for r in data_parallel.staged)
    return sum(r.stages_left for item in data_parallel.pending for r in item[3])


def staged_and_synchronous_runs(rank, world, base, parallel):
    """3 steps with the reductions' stages issued as backward goes on, and again with each reduction finished
    where it starts (the synchronous path): (stages left at the end of each backward, whether the losses and
    weights of the two runs are bit-identical)."""
    from parallel.staged_reduction import StagedReduction

    def run(steps=3):
        trainer = make_trainer(rank, world, base, **parallel)
        left, finish = [], trainer.data_parallel.finish_gradients
        trainer.data_parallel.finish_gradients = lambda: (left.append(stages_not_issued(trainer.data_parallel)),
                                                          finish())
        losses = [trainer.train_step()["loss"] for _ in range(steps)]
        return left, losses, final_weights(trainer)[1]

    left, losses, weights = run()
    staged_init = StagedReduction.__init__

    def synchronous(self, stages, device):
        staged_init(self, stages, device)
        self.wait()
    StagedReduction.__init__ = synchronous
    try:
        _, sync_losses, sync_weights = run()
    finally:
        StagedReduction.__init__ = staged_init
    same = losses == sync_losses and all(torch.equal(a[2], b[2]) for name in weights
                                         for a, b in zip(weights[name][1], sync_weights[name][1]))
    return left, same


@pytest.mark.parametrize("parallel", [{"zero_stage": 3, "hsdp_group_size": 2},
                                      {"zero_stage": 2, "hierarchical_node_size": 2},
                                      {"zero_stage": 0, "hierarchical_node_size": 2, "bucket_mb": 0.01}],
                         ids=["hsdp", "hierarchical-zero2", "hierarchical-ddp"])
def test_staged_reductions_overlap_backward_and_equal_the_synchronous_path(pools, parallel):
    for left, same in pools[4].run(staged_and_synchronous_runs, CURVE, parallel):
        assert all(n > 0 for n in left), left  # backward's hooks returned with later stages still to issue
        assert same


def unit_group_pool(rank, world, count):
    """(new_group calls, units, distinct communicators) of build_unit_groups for 10 units over 2 DP groups."""
    from parallel.topology import Layout, Topology
    topo = Topology(Layout(tp=2, dp=2), rank)
    created, new_group = [], dist.new_group
    dist.new_group = lambda *args, **kwargs: created.append(args) or new_group(*args, **kwargs)
    try:
        groups = topo.build_unit_groups(10, count)
    finally:
        dist.new_group = new_group
    return len(created), len(groups), len({id(g) for g in groups}), groups[0] is groups[count]


def test_unit_process_groups_are_a_bounded_pool_shared_round_robin(pools):
    # every rank takes part in creating each DP group's communicators: 3 per DP group, not one per unit
    assert pools[4].run(unit_group_pool, 3) == [(6, 10, 3, True)] * 4


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tensor_times_data_parallel(pools, reference, stage):
    # one KV head over TP=2: its weights are TP-replicated with partial gradients, summed after sharding
    results = pools[4].run(train_run, CURVE, {"zero_stage": stage, "tensor": 2, "sequence_parallel": True})
    assert_matches_reference(results, reference, tp_size=2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_sharded_tracks_ddp(pools, precision):
    base = {**CURVE, "train": dict(CURVE["train"], precision=precision, steps=10)}
    ddp = pools[2].run(train_run, base, {"zero_stage": 0})[0][0]
    for stage in (2, 3):
        sharded = pools[2].run(train_run, base, {"zero_stage": stage})[0][0]
        assert max(abs(a - b) for a, b in zip(ddp, sharded)) <= 5e-3, (stage, ddp, sharded)
        assert sharded[-1] < sharded[0] - 0.3


def recomputed_run(rank, world, base, parallel):
    """Stage 3 with every block under activation checkpointing: the recomputation inside backward runs the
    block's forward hooks again and must not free the parameters its backward is about to use."""
    from torch.utils.checkpoint import checkpoint

    from engine.model import DecoderLayer

    class Recomputed(DecoderLayer):
        def __call__(self, *args):
            return checkpoint(super().__call__, *args, use_reentrant=True)

    trainer = make_trainer(rank, world, base, **parallel)
    for layer in trainer.chunks[0].model.layers.values():
        layer.__class__ = Recomputed
    with comm.RECORD.capture() as events:
        history = [trainer.train_step()]
    gathers = len([e for e in events if e.op == "all_gather"])
    history += [trainer.train_step() for _ in range(trainer.cfg.train.steps - 1)]
    return [h["loss"] for h in history], [h["grad_norm"] for h in history], final_weights(trainer), gathers


def test_stage3_with_activation_recomputation(pools, reference):
    results = pools[2].run(recomputed_run, CURVE, {"zero_stage": 3})
    assert_matches_reference([r[:3] for r in results], reference)
    units, micro_batches = CURVE["model"]["num_layers"] + 2, 8 // 2
    # the recomputation reuses the backward's gather; the final norm + head stays gathered from its forward;
    # the embedding is looked up by rows (parallel/embedding_shards.py: its ids all-gathered in forward, its
    # rows' gradients in backward), never gathered whole
    assert results[0][3] == (2 * units - 3 + 2) * micro_batches


def two_stage_pipeline_step(rank, world, stage):
    """PP=2 × DP=2 with tied embeddings, by hand (GPipe order, raw send/recv): the embedding's gradient on
    the first stage and its copy's on the last are summed before sharding; one step equals single process."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from engine.config.schema import ModelConfig, OptimConfig
    from engine.model import CausalLM
    from engine.optim.replicated import MixedPrecisionAdamW
    from engine.optim.zero import ZeroAdamW
    from parallel.ddp import BucketedDDP
    from parallel.fsdp import ShardedDataParallel
    from parallel.tensor import TensorParallel
    from parallel.topology import Layout, Topology

    cfg = ModelConfig(**dict(CURVE["model"], tie_embeddings=True))
    topo, tp, optim = Topology(Layout(pp=2, dp=2), rank), TensorParallel(), OptimConfig(clip_grad=0.5)
    first = topo.is_first_stage
    chunk = CausalLM(cfg, tp, layer_ids=[topo.pp_rank], pre_process=first, post_process=not first)
    ref = CausalLM(cfg)
    chunk.init_weights(3)
    ref.init_weights(3)
    named = list(chunk.named_parameters())
    if stage == 0:
        sync = BucketedDDP(named, topo.dp_group, tp, [chunk], tied_group=topo.embedding_group)
        opt = MixedPrecisionAdamW(named, optim, topo, "fp32")
    else:
        sync = ShardedDataParallel([chunk], stage, topo.dp_group, 2, tp, torch.float32,
                                   tied_group=topo.embedding_group)
        opt = ZeroAdamW(sync, optim, topo, "fp32")
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1), generator=torch.Generator().manual_seed(1))
    mine = tokens[2 * topo.dp_rank:2 * topo.dp_rank + 2].split(1)  # two micro-batches per DP rank
    sync.start_step(len(mine))
    peer = topo.pp_neighbour(1)
    outputs = []
    for mb in mine:
        if first:
            outputs.append(chunk(mb[:, :-1]))
            dist.send(outputs[-1].detach(), peer)
        else:
            h = torch.empty(1, cfg.seq_length, cfg.hidden_size)
            dist.recv(h, peer)
            h.requires_grad_(True)
            outputs.append((h, chunk(h, mb[:, 1:])))
    for out in outputs:
        if first:
            grad = torch.empty_like(out)
            dist.recv(grad, peer)
            out.backward(grad)
        else:
            h, loss = out
            (loss / len(mine)).backward()
            dist.send(h.grad, peer)
    sync.finish_gradients()
    opt.step(1e-3)

    ref_opt = MixedPrecisionAdamW(list(ref.named_parameters()), optim,
                                  SimpleNamespace(tp_rank=0, dp_rank=0, reduce_rank=0, mp_group=None), "fp32")
    ref(tokens[:, :-1], tokens[:, 1:]).backward()
    ref_opt.step(1e-3)
    expected = dict(ref.named_parameters())
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    if stage == 0:
        got = {n: [(0, p.numel(), p.detach().reshape(-1))] for n, p in named}
    else:
        got = {n: [(*s["range"], s["master"])] for n, s in opt.owned_state().items()}
    return max((v - expected[n].detach().reshape(-1)[a:b]).abs().max().item()
               for n, parts in got.items() for a, b, v in parts)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_pipeline_tied_embedding_gradients_are_summed_before_sharding(pools, stage):
    assert max(pools[4].run(two_stage_pipeline_step, stage)) <= TOL


def held_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def measure_memory(rank, world, stage):
    trainer = make_trainer(rank, world, MEMORY, zero_stage=stage)
    trainer.train_step()  # Adam state exists from here on
    micro_batches = trainer.loader.next_global_batch()
    trainer.data_parallel.start_step(len(micro_batches))  # else a reduction starts before the last one's backward
    trainer.forward_backward(micro_batches)
    trainer.data_parallel.finish_gradients()
    if stage == 0:
        opt = trainer.optimizer
        tensors = [p for _, p in trainer.named_params] + [p.grad for _, p in trainer.named_params] + opt.master
        tensors += [t for s in opt.inner.state.values() for t in s.values() if t.dim()]
        peak = 0
    else:
        tensors = trainer.data_parallel.held_tensors() + trainer.optimizer.held_tensors()
        peak = trainer.data_parallel.peak_gathered_bytes
    psi = sum(p.numel() for _, p in trainer.named_params)
    unit = max(u.full_bytes for u in trainer.data_parallel.units) if stage else 0
    return held_bytes(tensors), psi, unit, peak


MEMORY_TABLE: dict = {}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_model_state_memory_follows_zero_formulas(pools, dp, stage):
    measured, psi, unit, peak = pools[dp].run(measure_memory, stage)[0]
    n = dp
    formula = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
    MEMORY_TABLE[(dp, stage)] = (measured, formula, peak)
    print(f"\nDP={dp} stage {stage}: {measured} bytes/rank, formula {formula:.0f} "
          f"({measured / formula:.3f}×), peak gathered {peak} bytes = {peak / max(unit, 1):.1f} units")
    assert abs(measured - formula) <= 0.1 * formula
    if stage == 3:  # the unit computing and the one prefetched
        assert peak <= 2 * unit


def record_step(rank, world, base, parallel, micro_batches):
    trainer = make_trainer(rank, world, base, **parallel)
    batches = trainer.loader.next_global_batch()[:micro_batches]
    trainer.data_parallel.start_step(len(batches))
    with comm.RECORD.capture() as events:
        trainer.forward_backward(batches)
        trainer.data_parallel.finish_gradients()
    units = [u.full_bytes for u in getattr(trainer.data_parallel, "units", [])]
    return [(e.op, e.group, e.bytes, e.dtype) for e in events], units


def test_stage3_gathers_each_unit_once_per_pass_and_reduces_norms_in_fp32(pools):
    m = 2
    events, units = pools[2].run(record_step, MEMORY, {"zero_stage": 3, "zero3_embedding_rows": False}, m)[0]
    gathers = sorted(b for op, _, b, _ in events if op == "all_gather")
    # every unit: once before forward, once before backward, but the last (kept gathered in between) and
    # the embedding (whose backward does not read it; looked up by rows, tests/test_embedding_shards.py, it
    # would not be gathered at all)
    assert gathers == sorted((units + units[1:-1]) * m)
    scatters = [(b, d) for op, _, b, d in events if op == "reduce_scatter"]
    assert sorted(b for b, d in scatters if d == "bfloat16") == sorted(units * m)
    layers = MEMORY["model"]["num_layers"]
    assert len([1 for _, d in scatters if d == "float32"]) == (layers + 1) * m  # each layer's and the final norm
    assert not [e for e in events if e[0] == "all_reduce"]


def test_stage3_volume_is_one_and_a_half_times_ddp(pools):
    fp32 = {**MEMORY, "train": dict(MEMORY["train"], precision="fp32")}
    ddp, _ = pools[2].run(record_step, fp32, {"zero_stage": 0, "embedding_row_exchange": False}, 1)[0]  # all dense
    fsdp, units = pools[2].run(record_step, fp32, {"zero_stage": 3, "zero3_keep_last_gathered": False,
                                                   "zero3_embedding_rows": False}, 1)[0]
    wire = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # an all-reduce is a reduce-scatter + all-gather
    ratio = sum(wire[op] * b for op, _, b, _ in fsdp) / sum(wire[op] * b for op, _, b, _ in ddp)
    embedding = units[0]  # not gathered for backward
    assert abs(ratio - (1.5 - embedding / (2 * sum(b for _, _, b, _ in ddp)))) <= 1e-3, ratio


def ddp_micro_batches(rank, world, m):
    trainer = make_trainer(rank, world, CURVE, zero_stage=0, bucket_mb=0.02)
    ddp, chunk = trainer.data_parallel, trainer.chunks[0]
    batches = trainer.loader.next_global_batch() * (m // 4)
    ddp.start_step(m)
    per_micro_batch = []
    for tokens in batches:
        with comm.RECORD.capture() as events:
            (chunk(tokens[:, :-1], tokens[:, 1:]) / m).backward()
        per_micro_batch.append([(e.op, e.bytes) for e in events])
    launched = ddp.launched_in_backward
    ddp.finish_gradients()
    return per_micro_batch, launched, len(ddp.buckets), sum(p.numel() for _, p in trainer.named_params)


def test_ddp_reduces_only_on_the_last_micro_batch_in_buckets(pools):
    per_micro_batch, launched, buckets, psi = pools[2].run(ddp_micro_batches, 4)[0]
    assert all(events == [] for events in per_micro_batch[:-1])
    last = per_micro_batch[-1]
    assert buckets > 3 and len(last) == buckets and {op for op, _ in last} == {"all_reduce"}
    assert sum(b for _, b in last) == 4 * psi
    assert launched == buckets  # every bucket was launched from a backward hook, before backward ended


def checkpoint_round_trip(rank, world, stage):
    base = {**CURVE, "train": dict(CURVE["train"], steps=6)}
    straight = make_trainer(rank, world, base, zero_stage=stage)
    losses = [straight.train_step()["loss"] for _ in range(6)]
    first = make_trainer(rank, world, base, zero_stage=stage)
    for _ in range(3):
        first.train_step()
    saved = {n: {k: (s["range"], s[k].clone()) for k in ("master", "exp_avg", "exp_avg_sq")}
             for n, s in first.optimizer.owned_state().items()}

    def read(name, key, start, end):
        (lo, _), values = saved[name][key]
        return values[start - lo:end - lo]

    resumed = make_trainer(rank, world, base, zero_stage=stage)
    resumed.optimizer.load_owned_state(read)
    resumed.optimizer.adam_step = first.optimizer.adam_step
    resumed.step = 3
    from engine.train import build_loader
    resumed.loader = build_loader(resumed.cfg, resumed.topo, consumed_samples=first.consumed_samples)
    return losses[3:], [resumed.train_step()["loss"] for _ in range(3)]


@pytest.mark.parametrize("stage", [2, 3])
def test_owned_state_round_trip_continues_identically(pools, stage):
    for expected, resumed in pools[2].run(checkpoint_round_trip, stage):
        assert resumed == pytest.approx(expected, abs=1e-6)


def test_data_parallel_config_errors():
    with pytest.raises(ConfigError, match="hsdp_group_size=3 must divide the data-parallel size 4"):
        validate(make_config(CURVE, zero_stage=3, hsdp_group_size=3), 4)
    with pytest.raises(ConfigError, match="needs parallel.zero_stage 1, 2 or 3"):
        validate(make_config(CURVE, hsdp_group_size=2), 4)
    with pytest.raises(ConfigError, match="cannot both be set"):
        validate(make_config(CURVE, zero_stage=2, hsdp_group_size=2, hierarchical_node_size=2), 4)
    with pytest.raises(ConfigError, match="bucket_mb=0.0 must be a finite number > 0"):
        validate(make_config(CURVE, bucket_mb=0), 2)
    with pytest.raises(ConfigError, match="unit_process_groups"):
        validate(make_config(CURVE, unit_process_groups=True), 2)


def test_launcher_runs_zero3(tmp_path):
    def losses(run_dir, nproc, *overrides):
        return [r["loss"] for r in launch(run_dir, "train.steps=5", *overrides, nproc=nproc, timeout=300)]

    single = losses(tmp_path / "single", 1)
    sharded = losses(tmp_path / "zero3", 2, "parallel.zero_stage=3")
    assert sharded == pytest.approx(single, abs=1e-4)


def dropped_trainers_are_freed(rank, world, stage):
    """Build, step and drop three Trainers in turn: (parameters of the dropped ones still alive, process
    groups and threads of this process after each drop)."""
    import gc
    import threading
    import weakref
    before = comm.registered_groups()
    alive, counts = [], []
    for _ in range(3):
        trainer = make_trainer(rank, world, CURVE, zero_stage=stage)
        trainer.train_step()
        alive.append(weakref.ref(next(iter(dict(trainer.named_params).values()))))
        trainer.loader.close()
        del trainer
        gc.collect()
        comm.destroy_groups_since(before)
        counts.append((len(dist.distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task")),
                       threading.active_count()))
    return sum(ref() is not None for ref in alive), counts


@pytest.mark.parametrize("stage", [0, 3])
def test_a_dropped_trainer_frees_its_model_and_process_groups(pools, stage):
    # gradient hooks live in C++, out of the garbage collector's sight: hooks bound to their DDP / FSDP owner
    # once kept every dropped Trainer's model, and its groups' threads and sockets, to the end of the process
    for alive, counts in pools[2].run(dropped_trainers_are_freed, stage):
        assert alive == 0
        assert counts[0] == counts[1] == counts[2], counts
