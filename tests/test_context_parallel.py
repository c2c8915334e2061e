"""Context parallelism equals the single-process model (gloo, CPU, fp32, max abs ≤ 1e-5), for each attention
strategy, with packed documents and sliding windows, and composed with TP, PP and ZeRO-3."""
import json
import tempfile
from pathlib import Path

import pytest
import torch

from engine.config.schema import ConfigError, ModelConfig, validate
from engine.model import CausalLM
from engine.train import Trainer, with_document_extras
from parallel import comm
from parallel.context import ContextParallel
from parallel.distributed import DistEnv
from parallel.topology import Layout, Topology
from tests.distributed import worker_pools
from tests.helpers import launch_process, read_metrics, tiny_trainer
from tests.test_data_parallel import assert_matches_reference, make_config, single_process_run, train_run

TOL = 1e-5
EOD = 3
# 4 query heads and 2 KV heads: under alltoall at CP4 each rank gets one query head and the KV head it uses
MODEL = dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=61,
             seq_length=32)
VARIANTS = {"causal": ({}, False), "documents": ({}, True), "window": ({"attention_window": 5}, False),
            "alibi": ({"position_embedding": "alibi"}, True)}  # ALiBi with documents
STRATEGIES = ("allgather", "ring", "alltoall")
CURVE = {"model": dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=1, ffn_hidden_size=64,
                       vocab_size=61, seq_length=16),
         "train": dict(micro_batch_size=1, global_batch_size=4, steps=4, seed=7),
         "optim": dict(lr=3e-3, warmup_steps=2), "data": dict(mock=True)}

DEEP_CURVE = {**CURVE, "model": {**CURVE["model"], "num_layers": 4}}  # PP2 × 2 virtual stages: a layer per chunk


@pytest.fixture(scope="module")
def pools():
    with worker_pools(2, 4) as made:
        yield made


def micro_batch(variant: str, context=None):
    """Two samples; with documents, end-of-document tokens split them (segment ids, positions, loss mask)."""
    tokens = torch.randint(4, MODEL["vocab_size"], (2, MODEL["seq_length"] + 1),
                           generator=torch.Generator().manual_seed(5))
    documents = VARIANTS[variant][1]
    if documents:
        tokens[0, [6, 19]] = EOD
        tokens[1, [11, 12, 27]] = EOD
    data = make_config({"model": MODEL, "data": dict(mock=True, reset_attention_mask=documents,
                                                      reset_position_ids=documents, eod_mask_loss=documents,
                                                      eod_token_id=EOD)}).data
    return with_document_extras(tokens, EOD if documents else None, data, context)


def compare_with_single_process(rank, world, strategy, variant):
    """(largest difference of loss and every gradient from the single process, forward and backward comm)."""
    cfg = ModelConfig(**MODEL, **VARIANTS[variant][0])
    topo = Topology(Layout(cp=world), rank)
    cp = ContextParallel.from_topology(topo, strategy)
    model, ref = CausalLM(cfg, cp=cp), CausalLM(cfg)
    model.init_weights(11)
    ref.init_weights(11)
    args, kwargs = micro_batch(variant, cp).forward_args(first=True, last=True)
    with comm.RECORD.capture() as fwd:
        loss = model(*args, **kwargs)
    with comm.RECORD.capture() as bwd:
        loss.backward()
    ref_args, ref_kwargs = micro_batch(variant).forward_args(first=True, last=True)
    ref_loss = ref(*ref_args, **ref_kwargs)
    ref_loss.backward()
    diffs = {"loss": abs(loss.item() - ref_loss.item())}
    reference = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        # what the DP × CP reduction does at DP = 1: the CP ranks' gradients averaged
        grad = p.grad.clone()
        comm.all_reduce(grad, topo.cp_group)
        diffs[name] = (grad / world - reference[name].grad).abs().max().item()
    return diffs, [(e.op, e.group, e.bytes) for e in fwd], [(e.op, e.group, e.bytes) for e in bwd]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_context_parallel_matches_single_process(pools, strategy, world, variant):
    for diffs, _, _ in pools[world].run(compare_with_single_process, strategy, variant):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= TOL, f"{worst}: {diffs[worst]}"


def blocks_per_layer(rank, world, strategy, variant):
    """(query chunk, key chunk) pairs this rank attends per layer in one forward of `micro_batch(variant)`."""
    cp = ContextParallel.from_topology(Topology(Layout(cp=world), rank), strategy)
    model = CausalLM(ModelConfig(**MODEL, **VARIANTS[variant][0]), cp=cp)
    model.init_weights(11)
    args, kwargs = micro_batch(variant, cp).forward_args(first=True, last=True)
    model(*args, **kwargs)
    return cp.blocks_computed / MODEL["num_layers"]


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_masked_chunk_pairs_are_skipped(pools, strategy):
    """By hand, rank r holding chunks r and 2c−1−r: causality leaves chunk q the key chunks 0..q (CP2: 1 + 4 on
    rank 0, 2 + 3 on rank 1, of the 2·2c each would see unmasked). The packed micro-batch's documents (segment
    ids per chunk of 8 at CP2: row 0 {0,1} {1} {1,2} {2}, row 1 {0} {0,1,2} {2} {2,3}) also hide chunk 0 from
    chunk 3 in both rows: 9 pairs, not 10. At CP4 (chunks of 4) they leave chunk 7 only chunks 5-7, chunk 6 3-6,
    chunk 5 3-5, chunk 4 1-4, chunk 3 1-3: 23 pairs of the causal 36. Results equal CP1 in
    test_context_parallel_matches_single_process (documents)."""
    assert pools[2].run(blocks_per_layer, strategy, "causal") == [5, 5]
    assert pools[2].run(blocks_per_layer, strategy, "documents") == [4, 5]
    assert pools[4].run(blocks_per_layer, strategy, "documents") == [1 + 3, 2 + 4, 3 + 3, 3 + 4]


def ring_event_order(rank, world, backend):
    """The order of one layer's ring exchanges and pair computations, forward and backward."""
    from kernels import attention_blocks
    events, originals = [], {}
    for module, name, label in ((comm, "start_ring_shift", "post"), (comm, "finish_ring_shift", "wait"),
                                (attention_blocks, "block_fused", "fused"),
                                (attention_blocks, "block_reference", "reference"),
                                (attention_blocks, "block_fused_backward", "fused"),
                                (attention_blocks, "block_reference_backward", "reference")):
        originals[module, name] = getattr(module, name)

        def logged(*args, _fn=originals[module, name], _label=label, **kwargs):
            events.append(_label)
            return _fn(*args, **kwargs)
        setattr(module, name, logged)
    try:
        cp = ContextParallel.from_topology(Topology(Layout(cp=world), rank), "ring")
        q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
        cp.attention(q, k, v, backend=backend).sum().backward()
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
    return events


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_ring_posts_the_next_exchange_before_computing_the_current_block(pools, backend):
    """CP2, rank 1 (chunks 1 and 2; the block from rank 0 holds chunks 0 and 3): forward posts the shift, computes
    its own block's three pairs (1-1, 2-1, 2-2), waits, computes the received block's two (both query chunks see
    chunk 0); backward computes the received block's gradients first, posts them back, computes its own block's,
    waits. Every pair is unmasked but by causality: the fused kernel takes them all unless the reference path is
    asked for (model.attention_backend=reference)."""
    kind = "reference" if backend == "reference" else "fused"
    assert pools[2].run(ring_event_order, backend)[1] == ["post", *[kind] * 3, "wait", *[kind] * 2,
                                                          *[kind] * 2, "post", *[kind] * 3, "wait"]


def saved_per_rank(rank, world, strategy):
    """(bytes autograd saves for one micro-batch on this CP rank, engine/memory_estimate's chunk_activation):
    tiny.yaml's 4 layers, h = 64, 4 query and 2 KV heads, b = 2, s = 256, fp32, no recomputation."""
    from engine.memory_estimate import chunk_activation
    from tests.test_memory_estimate import config, saved_bytes
    cfg = config(world, f"parallel.context={world}", "model.seq_length=256", "model.vocab_size=1000",
                 f"parallel.context_attention={strategy}")
    cp = ContextParallel.from_topology(Topology(Layout(cp=world), rank), strategy)
    model = CausalLM(cfg.model, cp=cp)
    model.init_weights(1)
    tokens = torch.randint(0, 1000, (cfg.train.micro_batch_size, 257), generator=torch.Generator().manual_seed(0))
    got = saved_bytes(model, cp.shard(tokens[:, :-1]), cp.shard(tokens[:, 1:]))
    return got, chunk_activation(cfg, cfg.model.num_layers, True, True, cfg.train.micro_batch_size, "none")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_activations_per_rank_fall_as_one_over_c(pools, strategy):
    """The estimate (tools/estimate_memory.py) is the CP1 activations over c; what a rank saves is that plus the
    strategy's keys and values beyond its chunks (measured 6-29% more at this small width, docs/parallelism.md)."""
    single, estimate = saved_per_rank(0, 1, strategy)
    assert abs(single / estimate - 1) <= 0.01
    saved = {}
    for c in (2, 4):
        saved[c], want = pools[c].run(saved_per_rank, strategy)[0]
        assert want == estimate // c and 1.0 <= saved[c] / want <= 1.35, (c, saved[c], want)
    assert saved[4] / saved[2] <= 0.6 and saved[2] / single <= 0.6


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_communication_per_layer_matches_the_formula(pools, strategy):
    """Bytes each CP4 rank moves per layer and direction (fp32, b = 2, local sequence s/c, d = 8)."""
    c, b, s, d, hq, hkv, layers = 4, 2, MODEL["seq_length"], 8, 4, 2, MODEL["num_layers"]
    _, fwd, bwd = pools[c].run(compare_with_single_process, strategy, "causal")[1]
    local_kv = 2 * b * hkv * (s // c) * d * 4  # this rank's K and V
    cp_fwd = [(op, n) for op, group, n in fwd if group == "cp" and op != "all_reduce"]
    cp_bwd = [(op, n) for op, group, n in bwd if group == "cp"]
    if strategy == "allgather":  # all-gather of every rank's K, V forward; reduce-scatter of their gradients
        assert cp_fwd == [("all_gather", c * local_kv)] * layers
        assert cp_bwd == [("reduce_scatter", c * local_kv)] * layers
    elif strategy == "ring":  # c − 1 shifts of one K/V block forward, of its gradient backward
        assert cp_fwd == [("send", local_kv), ("recv", local_kv)] * (c - 1) * layers
        assert cp_bwd == [("send", local_kv), ("recv", local_kv)] * (c - 1) * layers
    else:  # q, k, v (KV heads repeated to c) out, and the output back; the same again backward
        qkv = b * (hq + 2 * c) * (s // c) * d * 4
        out = b * hq * (s // c) * d * 4
        assert sorted(cp_fwd) == sorted([("all_to_all", qkv), ("all_to_all", out)] * layers)
        assert sorted(cp_bwd) == sorted([("all_to_all", qkv), ("all_to_all", out)] * layers)
    # the loss: summed over CP forward (one value), nothing backward beyond attention
    assert [(op, n) for op, group, n in fwd if group == "cp" and op == "all_reduce"] == [("all_reduce", 4)]


@pytest.fixture(scope="module")
def reference():
    return single_process_run(CURVE)


@pytest.mark.parametrize("parallel", [{"tensor": 2, "sequence_parallel": True},
                                      {"pipeline": 2, "schedule": "1f1b"},
                                      {"zero_stage": 3}], ids=["tp2", "pp2-1f1b", "zero3-dp2"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_context_parallel_composes(pools, reference, strategy, parallel):
    results = pools[4].run(train_run, CURVE, {"context": 2, "context_attention": strategy, **parallel})
    assert_matches_reference(results, reference, tp_size=parallel.get("tensor", 1))


@pytest.mark.parametrize("parallel", [{"zero_stage": 3, "hsdp_group_size": 2},
                                      {"zero_stage": 1, "hierarchical_node_size": 2},
                                      {"zero_stage": 0, "hierarchical_node_size": 2},
                                      {"zero_stage": 3, "unit_process_groups": True}],
                         ids=["hsdp", "hierarchical-zero1", "hierarchical-ddp", "unit-groups"])
def test_context_parallel_composes_with_grouped_reductions(pools, reference, parallel):
    """CP2 × DP2: HSDP's shard groups, hierarchical reduction's blocks and the per-unit communicators split the
    reduce group DP × CP (blocks of 2: one replica's CP ranks), as they split DP without CP."""
    results = pools[4].run(train_run, CURVE, {"context": 2, **parallel})
    assert_matches_reference(results, reference)


ALIBI_CURVE = {**CURVE, "model": {**CURVE["model"], "position_embedding": "alibi"}}


@pytest.fixture(scope="module")
def alibi_reference():
    return single_process_run(ALIBI_CURVE)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_alibi_under_tensor_and_context_parallelism(pools, alibi_reference, strategy):
    """TP2 × CP2 with ALiBi: each TP rank's 2 heads have their own slopes, which alltoall scatters once more
    (one head, and its slope, per CP rank)."""
    results = pools[4].run(train_run, ALIBI_CURVE, {"context": 2, "context_attention": strategy, "tensor": 2})
    assert_matches_reference(results, alibi_reference, tp_size=2)


@pytest.fixture(scope="module")
def deep_reference():
    return single_process_run(DEEP_CURVE)


def test_context_parallel_composes_with_interleaved_pipeline(pools, deep_reference):
    """CP2 × PP2 with two model chunks per pipeline rank (4 layers, one per chunk). The ring only: its CP
    sends and receives interleave with the pipeline's, where an ordering mistake would deadlock or mismatch;
    the collective strategies already meet a pipeline in test_context_parallel_composes."""
    parallel = {"context": 2, "context_attention": "ring", "pipeline": 2, "schedule": "interleaved",
                "virtual_stages": 2}
    assert_matches_reference(pools[4].run(train_run, DEEP_CURVE, parallel), deep_reference)


def test_launched_tp2_cp2_pp2_with_documents_follows_the_single_process(tmp_path):
    """launch/run_pretrain.sh on 8 ranks: TP2 + SP × CP2 (ring) × PP2 on the tiny recipe with packed documents
    (end-of-document token 5 of 64 ends a document about every other sample); 10 losses within 1e-4 of the
    single process (a Trainer here: the launcher is tested on the 8 ranks)."""
    documents = ["model.vocab_size=64", "data.eod_token_id=5", "data.reset_attention_mask=true",
                 "data.reset_position_ids=true", "data.eod_mask_loss=true", "train.steps=10"]
    alone = tiny_trainer(f"run.dir={tmp_path / 'single'}", *documents)
    single = [alone.train_step()["loss"] for _ in range(10)]
    layout = ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.context=2",
              "parallel.context_attention=ring", "parallel.pipeline=2"]
    done = launch_process(tmp_path / "cp", *documents, *layout, nproc=8)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "8 ranks = TP 2 × CP 2 × PP 2 × DP 1" in done.stdout + done.stderr
    split = [r["loss"] for r in read_metrics(tmp_path / "cp")]
    assert len(split) == len(single) == 10
    for step, (a, b) in enumerate(zip(single, split), 1):
        assert abs(a - b) <= 1e-4, (step, a, b)


def dropout_masks(rank, world, run_dir, sequence_parallel):
    """(TP rank, CP rank, this rank's embedding-dropout mask in the first step, its losses) at TP2 × CP2."""
    dropout = {**CURVE, "model": {**CURVE["model"], "hidden_dropout": 0.5}}
    trainer = trainer_in(run_dir, rank, world, base=dropout, tensor=2, context=2,
                         sequence_parallel=sequence_parallel)
    masks = []
    trainer.chunks[0].embed_dropout.register_forward_hook(lambda module, args, out: masks.append(out == 0))
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    return trainer.topo.tp_rank, trainer.topo.cp_rank, masks[0], losses


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sequence-parallel"])
def test_hidden_dropout_draws_its_own_mask_on_each_context_rank(pools, tmp_path, sequence_parallel):
    """CP ranks hold different tokens: their masks differ. TP ranks of one CP rank share its activations
    (equal masks) unless sequence parallelism shards them (each its own)."""
    results = pools[4].run(dropout_masks, str(tmp_path), sequence_parallel)
    masks = {(tp, cp): mask for tp, cp, mask, _ in results}
    assert not torch.equal(masks[0, 0], masks[0, 1]) and not torch.equal(masks[1, 0], masks[1, 1])
    assert torch.equal(masks[0, 0], masks[1, 0]) != sequence_parallel
    assert all(abs(loss - results[0][3][i]) < TOL for *_, losses in results for i, loss in enumerate(losses))


@pytest.mark.parametrize("kernel", [None, "cpu"], ids=["reference", "fused"])
def test_ring_backward_with_dropout_is_the_gradient_of_its_forward(kernel):
    """The ring's written-out backward (one rank: both chunks of the sequence, GQA 4 query / 2 KV heads, fp64, b = 1)
    against finite differences of its forward: with ALiBi, documents and attention dropout (drawn again from
    one seed per call: the same masks) through the reference path; plain causal pairs through the fused kernel."""
    from parallel.context_ring import RingAttention, RingPlan
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 6, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    kv = torch.randn(1, 4, 6, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    segments = torch.tensor([[0, 0, 1, 1, 1, 1]])
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def ring(q, kv, dropout_p, masked=True):
        torch.manual_seed(0)
        plan = RingPlan([[[0], [0, 1]]], (0, 1), [(0, 1)], 3, (None, 0, 0), kernel=kernel, dropout_p=dropout_p)
        return RingAttention.apply(q, kv, segments if masked else None, slopes if masked else None, plan)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # kernels this small: a second thread only waits (8× slower on the shared cores)
    try:
        if kernel is None:
            assert torch.autograd.gradcheck(lambda q, kv: ring(q, kv, 0.3), (q, kv))
            assert not torch.equal(ring(q, kv, 0.3), ring(q, kv, 0.0))  # dropout was applied
        else:
            assert torch.autograd.gradcheck(lambda q, kv: ring(q, kv, 0.0, masked=False), (q, kv))
    finally:
        torch.set_num_threads(threads)


def dropout_expectation(rank, world, strategy, draws):
    """(mean |average over `draws` dropout forwards − the undropped output|, the same for one draw) of this
    rank's queries; values near 1, so that a missing 1/(1−p) shows as an error near 0.5."""
    cp = ContextParallel.from_topology(Topology(Layout(cp=world), rank), strategy)
    gen = torch.Generator().manual_seed(9)  # the same full tensors on every rank
    q, k = torch.randn(1, 4, 32, 8, generator=gen), torch.randn(1, 2, 32, 8, generator=gen)
    v = 1 + 0.1 * torch.randn(1, 2, 32, 8, generator=gen)
    q, k, v = (cp.shard(t, dim=2) for t in (q, k, v))
    exact = cp.attention(q, k, v)
    torch.manual_seed(100 + rank)  # each CP rank its own stream, as seed_all gives it
    outs = torch.stack([cp.attention(q, k, v, dropout_p=0.5) for _ in range(draws)])
    return (outs.mean(0) - exact).abs().mean().item(), (outs[0] - exact).abs().mean().item()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_attention_dropout_keeps_the_expected_output(pools, strategy):
    """Attention dropout at CP2 (p = 0.5, each rank's own masks): one draw is far from the undropped output, the
    mean of 200 draws is near it (its standard error is at most 1/√200 ≈ 0.07 per element)."""
    for averaged, single in pools[2].run(dropout_expectation, strategy, 200):
        assert averaged < 0.05 and single > 0.2, (averaged, single)


def dropout_losses(rank, world, run_dir, recompute):
    base = {**CURVE, "model": {**CURVE["model"], "attention_dropout": 0.3},
            "train": {**CURVE["train"], "recompute": recompute}}
    trainer = trainer_in(f"{run_dir}/{recompute}", rank, world, base=base, context=2, context_attention="ring")
    return [trainer.train_step()["loss"] for _ in range(2)]


def test_recomputed_ring_attention_redraws_the_same_dropout(pools, tmp_path):
    """Selective recomputation replays the ring's forward in backward: the masks drawn again must be the forward's,
    or the gradients (and the second step's loss) would differ from a run without recomputation."""
    plain = pools[2].run(dropout_losses, str(tmp_path), "none")
    assert pools[2].run(dropout_losses, str(tmp_path), "selective") == plain


def diary_at_context_two(rank, world, tmp):
    from engine.config.schema import load_config
    from engine.observe.diary import read_entries
    from engine.observe.metrics import MetricsLog
    from tests.eval_fixtures import VOCAB
    cfg = load_config("launch/configs/tiny.yaml", [
        "model.num_layers=2", f"model.vocab_size={VOCAB}", "train.steps=2", f"data.tokenizer={tmp}/tok/tokenizer.json",
        "train.diary_prompts=[\"def \"]", "train.diary_max_tokens=6", "checkpoint.interval=2", f"run.dir={tmp}/run",
        "parallel.context=2", "parallel.context_attention=ring"])
    validate(cfg, world)
    Trainer(cfg, DistEnv(rank, world, 0, torch.device("cpu"), "gloo")).train(MetricsLog(f"{tmp}/run", enabled=False))
    return read_entries(Path(tmp) / "run" / "diary.jsonl")


def test_the_generation_diary_runs_under_context_parallelism(pools, tmp_path, capsys):
    """Rank 0 generates from the checkpoint just saved, as one whole model on the host: at CP2 its text is what
    tools/generate.py writes for that checkpoint in one process (checkpoints load whole at any layout)."""
    from tests.eval_fixtures import make_tokenizer
    from tools import generate as generate_tool
    make_tokenizer(tmp_path / "tok")
    [entry] = pools[2].run(diary_at_context_two, str(tmp_path))[0]
    assert (entry["step"], entry["prompt"], entry["mode"]) == (2, "def ", "greedy")
    assert generate_tool.main(["--model", str(tmp_path / "run" / "checkpoints"), "--prompt", "def ",
                               "--max-new-tokens", "6"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] == entry["text"]


def trainer_in(run_dir, rank, world, base=CURVE, **parallel):
    cfg = make_config(base, **parallel)
    cfg.run.dir = run_dir
    validate(cfg, world)
    return Trainer(cfg, DistEnv(rank, world, 0, torch.device("cpu"), "gloo"))


def save_at_context_two(rank, world, run_dir):
    trainer = trainer_in(run_dir, rank, world, context=2, zero_stage=1)
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    trainer.save_checkpoint()
    trainer.checkpointer.wait()
    return losses


def test_checkpoint_saved_at_cp2_resumes_at_cp1(pools, reference):
    """Checkpoints hold global tensors: the ZeRO-1 shards of the DP × CP group load whole into one process."""
    with tempfile.TemporaryDirectory() as run_dir:
        first = pools[2].run(save_at_context_two, run_dir)[0]
        resumed = trainer_in(run_dir, 0, 1)
        assert resumed.step == 2
        rest = [resumed.train_step()["loss"] for _ in range(2)]
    assert first + rest == pytest.approx(reference[0], abs=TOL)


def resume_at_context_four(rank, world, run_dir):
    trainer = trainer_in(run_dir, rank, world, context=4, zero_stage=1)
    assert (trainer.step, trainer.topo.cp_size, trainer.topo.dp_size) == (2, 4, 1)
    return [trainer.train_step()["loss"] for _ in range(2)]


def test_checkpoint_saved_at_cp2_resumes_at_cp4(pools, reference):
    """The ZeRO-1 shards of 2 CP ranks load as 4 CP ranks' shards (each rank 2 of 8 chunks of 16 tokens)."""
    with tempfile.TemporaryDirectory() as run_dir:
        first = pools[2].run(save_at_context_two, run_dir)[0]
        for rest in pools[4].run(resume_at_context_four, run_dir):
            assert first + rest == pytest.approx(reference[0], abs=TOL)


@pytest.mark.parametrize("change, message", [
    ({"model": {"seq_length": 18}}, "parallel.context=2 splits model.seq_length=18 into 2×2 = 4 chunks"),
    ({"parallel": {"context_attention": "alltoall", "tensor": 4}, "model": {"num_kv_heads": 4}},
     "parallel.context_attention=alltoall scatters the 1 query heads"),
])
def test_context_parallel_refusals_name_the_key(change, message):
    raw = {k: dict(v) for k, v in CURVE.items()}
    for section, values in change.items():
        raw.setdefault(section, {}).update(values)
    parallel = {"context": 2, **raw.pop("parallel", {})}
    cfg = make_config(raw, **parallel)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(cfg, 2 * parallel.get("tensor", 1))


def test_chunks_are_balanced_and_cover_the_sequence():
    shards = [ContextParallel(size=4, rank=r).positions(32) for r in range(4)]
    assert sorted(torch.cat(shards).tolist()) == list(range(32))
    assert shards[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]  # chunks 1 and 2c − 2 = 6
    # causal work per rank (keys each query sees) is the same on every rank
    assert len({int((p + 1).sum()) for p in shards}) == 1
    x = torch.arange(32)[None]
    assert torch.equal(ContextParallel(size=4, rank=1).shard(x)[0], shards[1])



def precision_errors(rank, world, strategy, backend="auto", seq=512, scale=4.0):
    """(squared error against fp64, squared fp64 norm) of this rank's output, dq, dk and dv at bf16: 8 query and 2
    KV heads, d = 32, the logits ×`scale` (sharper softmaxes, where rounding the scores shows)."""
    from torch.nn.functional import scaled_dot_product_attention
    cp = ContextParallel.from_topology(Topology(Layout(cp=world), rank), strategy)
    gen = torch.Generator().manual_seed(21)  # the same full tensors on every rank
    q = scale * torch.randn(1, 8, seq, 32, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, 2, seq, 32, dtype=torch.float64, generator=gen) for _ in range(2))
    grad = torch.randn(1, 8, seq, 32, dtype=torch.float64, generator=gen)
    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    out = scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=True)
    out.backward(grad)
    want = [cp.shard(t, dim=2) for t in (out.detach(), *(t.grad for t in exact))]
    mine = [cp.shard(t, dim=2).bfloat16().requires_grad_() for t in (q, k, v)]
    got = cp.attention(*mine, backend=backend)
    got.backward(cp.shard(grad, dim=2).bfloat16())
    return [(((g.double() - w) ** 2).sum().item(), (w ** 2).sum().item())
            for g, w in zip([got.detach(), *(t.grad for t in mine)], want)]


def test_bf16_error_of_every_strategy_is_allgathers(pools):
    """bf16 at CP4, logits ×4: the relative error against fp64 (over all ranks) of the output, dq, dk and dv of
    ring (fused kernel and reference path) and alltoall within 1.3× allgather's. Before the ring's scores,
    log-sum-exp and merges were fp32 its errors were 2.4-3.5× allgather's (output 1.39e-2 against 5.69e-3)."""
    errors = {}
    for strategy, backend in (("allgather", "auto"), ("ring", "auto"), ("ring", "reference"), ("alltoall", "auto")):
        per_rank = pools[4].run(precision_errors, strategy, backend)
        errors[strategy, backend] = [(sum(r[i][0] for r in per_rank) / sum(r[i][1] for r in per_rank)) ** 0.5
                                     for i in range(4)]
    for key, values in errors.items():
        for name, got, base in zip(("out", "dq", "dk", "dv"), values, errors["allgather", "auto"]):
            assert got <= 1.3 * base, (key, name, got, base, errors)


def test_visible_chunks_read_the_host_copy():
    """MicroBatch.to hands the host copy of the segment ids to remember_documents: visible_chunks then never reads
    the device tensor (here a stand-in holding other ids, so that reading it would show)."""
    from parallel.micro_batch import MicroBatch
    cp = ContextParallel(size=2, rank=0)
    host = torch.tensor([[0] * 8 + [1] * 8])  # two documents of two chunks each: chunks 2, 3 never see 0, 1
    device = MicroBatch(torch.zeros(1, 17, dtype=torch.long), host, context=cp).to(torch.device("cpu")).segment_ids
    stand_in = torch.zeros_like(host)  # one document: every causal pair visible
    cp.remember_documents(stand_in, host)
    assert cp.visible_chunks(16, 0, stand_in) == cp.visible_chunks(16, 0, device)
    assert cp.visible_chunks(16, 0, stand_in)[2] == [False, False, True, False]
    assert ContextParallel(size=2, rank=0).visible_chunks(16, 0, torch.zeros_like(host))[2] == [True] * 3 + [False]


def ring_node_holdings(rank, world):
    """(bytes of the distinct storages each ring attention node of the model holds, whether any of its other
    attributes holds a tensor, engine/memory_estimate's ring_attention_saved): CP2, tiny.yaml at s = 256, b = 2,
    with documents, ALiBi and attention dropout, the case whose masks and biases the ring used to keep."""
    from engine.memory_estimate import ring_attention_saved
    from tests.test_memory_estimate import config, storages
    cfg = config(world, f"parallel.context={world}", "model.seq_length=256", "model.vocab_size=1000",
                 "parallel.context_attention=ring", "model.position_embedding=alibi", "model.attention_dropout=0.1",
                 "data.reset_attention_mask=true", f"data.eod_token_id={EOD}")
    from parallel.random import seed_all
    cp = ContextParallel.from_topology(Topology(Layout(cp=world), rank), "ring")
    seed_all(1, cp_rank=rank)
    model = CausalLM(cfg.model, cp=cp)
    model.init_weights(1)
    tokens = torch.randint(4, 1000, (cfg.train.micro_batch_size, 257), generator=torch.Generator().manual_seed(0))
    tokens[:, 50::60] = EOD
    args, kwargs = with_document_extras(tokens, EOD, cfg.data, cp).forward_args(first=True, last=True)
    loss = model(*args, **kwargs)
    nodes, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "RingAttentionBackward":
            nodes.append(node)
        stack.extend(next_fn for next_fn, _ in node.next_functions)

    def tensors_in(value) -> bool:
        if isinstance(value, torch.Tensor):
            return True
        if isinstance(value, dict):
            return any(tensors_in(v) for v in (*value.keys(), *value.values()))
        if isinstance(value, (list, tuple)):
            return any(tensors_in(v) for v in value)
        return hasattr(value, "__dataclass_fields__") and tensors_in(list(vars(value).values()))
    held = [(storages(node.saved_tensors), tensors_in([node.plan, node.seeds, node.states])) for node in nodes]
    return held, ring_attention_saved(cfg, cfg.train.micro_batch_size)


def test_a_ring_node_holds_what_the_memory_estimate_counts(pools):
    """Every ring attention node saves exactly engine/memory_estimate.ring_attention_saved's bytes, through
    save_for_backward (which saved_tensors_hooks, the planner and recomputation see), and keeps no other
    tensor: no masks, ALiBi biases or dropout masks (rebuilt per block from positions, document ids, seeds)."""
    for held, want in pools[2].run(ring_node_holdings):
        assert len(held) == 4  # tiny.yaml's layers
        assert all(nbytes == want and not hidden for nbytes, hidden in held), (held, want)


def test_bench_context_prints_its_rows():
    """tools/bench_context.py runs end to end at a tiny shape (speed is never asserted: docs/benchmarks.md)."""
    import re
    from tests.helpers import tool
    out = tool("tools/bench_context.py", "--contexts", "2", "--seq-per-rank", "64", "--heads", "2", "--kv-heads", "1",
               "--head-dim", "8", "--rounds", "1", "--dtype", "fp32")
    row = r"^\| 2 \| 64 \| 2 \(1\) × 8 \| fp32 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+× \| [\d.]+× \|$"
    assert re.search(row, out, re.M), out


def compiled_against_eager(rank, world, strategy):
    """Largest difference of loss and gradients between compiled blocks (aot_eager: Dynamo and AOT autograd, what
    inductor would get) and eager ones, at CP2 with documents."""
    cfg = ModelConfig(**MODEL)
    cp = ContextParallel.from_topology(Topology(Layout(cp=world), rank), strategy)
    eager, compiled = CausalLM(cfg, cp=cp), CausalLM(cfg, cp=cp)
    eager.init_weights(11)
    compiled.init_weights(11)
    compiled.compile_blocks(backend="aot_eager")
    losses = []
    for model in (eager, compiled):
        args, kwargs = micro_batch("documents", cp).forward_args(first=True, last=True)
        loss = model(*args, **kwargs)
        loss.backward()
        losses.append(loss.item())
    grads = [(a.grad - b.grad).abs().max().item() for a, b in zip(eager.parameters(), compiled.parameters())]
    return max([abs(losses[0] - losses[1]), *grads]), torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_blocks_equal_eager_under_cp(pools, strategy):
    """train.compile=true under CP: the attention runs eagerly inside the compiled block (torch.compiler.disable:
    Dynamo would break the graph at the ring's batch_isend_irecv), the rest compiled; within 1e-5 of eager."""
    for diff, graphs in pools[2].run(compiled_against_eager, strategy):
        assert diff <= TOL and graphs >= 2, (diff, graphs)  # the block's parts before and after the attention
