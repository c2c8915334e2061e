"""Tensor and sequence parallelism equal the single-process model (gloo, CPU, fp32, max abs ≤ 1e-5)."""
import pytest
import torch

from engine.config.schema import ModelConfig
from engine.model import CausalLM
from parallel import comm
from parallel.tensor import TensorParallel, allreduce_replicated_grads, local_slice
from parallel.topology import Layout, LayoutError, Topology
from tests.distributed import worker_pools

TOL = 1e-5
SHAPES = {
    # vocab 101 is not divisible by 2 or 4: padded internally, and the padding must not reach the softmax
    "mha": dict(hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=96, vocab_size=101, seq_length=8),
    "gqa": dict(hidden_size=64, num_layers=2, num_attention_heads=8, num_kv_heads=4, ffn_hidden_size=64,
                vocab_size=96, seq_length=8),
    "gqa_replicated_kv": dict(hidden_size=64, num_layers=2, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=64,
                              vocab_size=90, seq_length=8, tie_embeddings=True),
    # Qwen2-style q/k/v biases (split at TP=2, replicated with the KV heads at TP=4), head_dim != hidden / heads
    "qkv_bias": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, kv_channels=24,
                     attention_bias=True, ffn_hidden_size=64, vocab_size=90, seq_length=8,
                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}),
}


@pytest.fixture(scope="module")
def pools():
    with worker_pools(2, 4) as made:
        yield made


def _padded(ref: torch.Tensor, shape) -> torch.Tensor:
    out = torch.zeros(shape)
    out[: ref.shape[0]] = ref
    return out


def compare_with_single_process(rank, world, shape, sequence_parallel):
    cfg = ModelConfig(**SHAPES[shape])
    topo = Topology(Layout(tp=world), rank)
    tp = TensorParallel.from_topology(topo, sequence_parallel)
    model, ref = CausalLM(cfg, tp), CausalLM(cfg)
    model.init_weights(11)
    ref.init_weights(11)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(5))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    diffs = {"logits": (model.full_logits(model(inputs)) - ref(inputs)).abs().max().item()}
    with comm.RECORD.capture() as fwd:
        loss = model(inputs, labels)
    with comm.RECORD.capture() as bwd:
        loss.backward()
        allreduce_replicated_grads(model, tp)
    ref_loss = ref(inputs, labels)
    ref_loss.backward()
    diffs["loss"] = abs(loss.item() - ref_loss.item())
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[name]
        assert tuple(_padded(r.detach(), p.full_shape).shape) == p.full_shape
        expected = local_slice(_padded(r.grad, p.full_shape), p, tp)
        diffs[name] = (p.grad - expected).abs().max().item()
        assert torch.equal(p.detach(), local_slice(_padded(r.detach(), p.full_shape), p, tp)), name
    return diffs, [(e.op, e.bytes) for e in fwd], [(e.op, e.bytes) for e in bwd]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_tp_matches_single_process(pools, world, shape, sp):
    for diffs, _, _ in pools[world].run(compare_with_single_process, shape, sp):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= TOL, f"{worst}: {diffs[worst]}"


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_communication_matches_megatron_pattern(pools, sp):
    cfg = ModelConfig(**SHAPES["mha"])
    b, s, h, L = 2, cfg.seq_length, cfg.hidden_size, cfg.num_layers
    activation = b * s * h * 4  # fp32 bytes of one full activation
    _, fwd, bwd = pools[2].run(compare_with_single_process, "mha", sp)[0]
    per_token = b * s * 4
    if not sp:
        # per layer 2 all-reduces each way; plus the embedding's g forward and the LM head's f backward
        assert fwd.count(("all_reduce", activation)) == 2 * L + 1
        assert bwd.count(("all_reduce", activation)) == 2 * L + 1
        assert not any(op != "all_reduce" for op, _ in fwd + bwd)
    else:
        assert fwd.count(("all_gather", activation)) == 2 * L + 1       # attention, MLP, LM head inputs
        assert fwd.count(("reduce_scatter", activation)) == 2 * L + 1   # attention, MLP outputs, embedding
        assert bwd.count(("reduce_scatter", activation)) == 2 * L + 1
        assert bwd.count(("all_gather", activation)) == 2 * L + 1
        assert not any(op == "all_reduce" and n == activation for op, n in fwd + bwd)
    # vocab-parallel cross-entropy: max, target logit and sum of exponentials, one value per token each
    assert [n for op, n in fwd if op == "all_reduce" and n == per_token] == [per_token] * 3


def column_parallel_is_bit_exact(rank, world):
    from parallel.tensor import ColumnParallelLinear
    tp = TensorParallel.from_topology(Topology(Layout(tp=world), rank))
    layer, ref = ColumnParallelLinear(32, 64, tp, 0.02), ColumnParallelLinear(32, 64, TensorParallel(), 0.02)
    from parallel.tensor import initialize_parameters
    initialize_parameters(layer, 3, tp)
    initialize_parameters(ref, 3, TensorParallel())
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    full = layer(x)
    return torch.equal(full, ref(x).chunk(world, dim=-1)[rank])


def test_column_parallel_forward_is_bit_exact(pools):
    assert all(pools[2].run(column_parallel_is_bit_exact))


def test_layout_errors_name_the_numbers():
    with pytest.raises(LayoutError, match="world size 6 is not divisible by TP×CP×PP = 4×1×1"):
        Layout.for_world(6, tp=4)
    with pytest.raises(LayoutError, match="rank order"):
        Layout(tp=2, order="tp-pp")
    lay = Layout(tp=2, pp=2, dp=2)
    assert lay.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    assert lay.groups_along("tp")[0] == [0, 1]
    assert lay.groups_along("dp")[0] == [0, 2]
    assert lay.groups_along("pp")[0] == [0, 4]
    other = Layout(tp=2, pp=2, dp=2, order="pp-tp-dp")
    assert other.groups_along("pp")[0] == [0, 1]
    # context parallelism: right after TP unless the order names it; gradients reduce over DP × CP
    cp = Layout(tp=2, cp=2, dp=2)
    assert cp.dims == ("tp", "cp", "dp", "pp") and cp.groups_along("cp")[0] == [0, 2]
    assert cp.groups_along("dp", "cp")[0] == [0, 2, 4, 6]
    assert Layout(tp=2, cp=2, dp=2, order="tp-dp-cp-pp").groups_along("cp")[0] == [0, 4]


def topology_groups(rank, world):
    topo = Topology(Layout(tp=2, pp=2, dp=1), rank, dp_node_size=0)
    units = topo.build_unit_groups(3, 3)
    return topo.group_ranks, len(units), topo.is_first_stage, topo.is_last_stage, topo.pp_neighbour(1)


def test_topology_builds_every_group(pools):
    results = pools[4].run(topology_groups)
    ranks0, units, first, last, nxt = results[0]
    assert ranks0["tp"] == [0, 1] and ranks0["pp"] == [0, 2] and ranks0["embedding"] == [0, 2]
    assert sorted(ranks0["mp"]) == [0, 1, 2, 3] and ranks0["dp"] == [0]
    assert units == 3 and first and not last and nxt == 2
    assert results[3][0]["tp"] == [2, 3] and results[3][3]
