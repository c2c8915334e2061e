"""The kernels inside the model: recomputation modes, per-block torch.compile, backend choice, the mid-run
recompute/micro-batch switch, and all of it under tensor + sequence parallelism (gloo, CPU).

Recompute modes must reproduce the plain run exactly, dropout included (max abs ≤ 1e-6); compiled blocks
use backend="aot_eager" (the full inductor backend needs a C++ toolchain and minutes of CPU per graph, so
it is exercised by tools/bench_gpu.py on GPUs instead); everything else ≤ 1e-5 (fp32).
"""
import dataclasses

import pytest
import torch

from engine.config.schema import ConfigError, ModelConfig, load_config, validate
from engine.model import CausalLM
from kernels import attention
from kernels.attention import alibi_slopes
from parallel.random import seed_all
from parallel.tensor import TensorParallel, allreduce_replicated_grads, local_slice
from parallel.topology import Layout, Topology
from tests.distributed import WorkerPool
from tests.flash_double import FlashAttnDouble
from tests.helpers import tiny_trainer

CFG = ModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                  vocab_size=90, seq_length=16)
DROPOUT = dataclasses.replace(CFG, attention_dropout=0.1, hidden_dropout=0.1)


def batch(cfg, b=2, seed=0):
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model, inputs, labels, seed=5, **kwargs):
    seed_all(seed)
    model.train()
    for p in model.parameters():
        p.grad = None
    loss = model(inputs, labels, **kwargs)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def max_diff(a, b):
    loss_a, grads_a = a
    loss_b, grads_b = b
    return max([(loss_a - loss_b).abs().item()] + [(grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a])


def make(cfg, dtype=torch.float32, tp=None):
    model = CausalLM(cfg, tp)
    model.init_weights(3)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_reproduces_loss_and_gradients_with_dropout(dtype, mode):
    model = make(DROPOUT, dtype)
    inputs, labels = batch(DROPOUT)
    plain = loss_and_grads(model, inputs, labels)
    model.set_recompute(mode)
    assert max_diff(loss_and_grads(model, inputs, labels), plain) <= 1e-6
    other_seed = loss_and_grads(model, inputs, labels, seed=6)
    assert max_diff(other_seed, plain) > 1e-3  # dropout is live: a different seed changes the result


def saved_activation_elements(model, inputs, labels) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        model(inputs, labels)
    return sum(saved)


def test_recompute_modes_keep_fewer_activations():
    model = make(CFG)
    inputs, labels = batch(CFG)
    kept = {}
    for mode in ("none", "selective", "full"):
        model.set_recompute(mode)
        kept[mode] = saved_activation_elements(model, inputs, labels)
    assert kept["none"] > kept["selective"] > kept["full"], kept
    with pytest.raises(ValueError, match="train.recompute"):
        model.set_recompute("some")


@pytest.mark.parametrize("mode", ["none", "full"])
def test_compiled_blocks_equal_eager(mode):
    cfg = dataclasses.replace(DROPOUT, hidden_dropout=0.0)
    eager, compiled = make(cfg), make(cfg)
    compiled.compile_blocks(backend="aot_eager")
    compiled.set_recompute(mode)
    inputs, labels = batch(cfg)
    assert max_diff(loss_and_grads(compiled, inputs, labels), loss_and_grads(eager, inputs, labels)) <= 1e-6


def test_attention_and_norm_backends_in_the_model():
    inputs, labels = batch(CFG)
    sdpa = loss_and_grads(make(CFG), inputs, labels)
    ref = loss_and_grads(make(dataclasses.replace(CFG, attention_backend="reference", norm_backend="torch",
                                                  loss_chunk_tokens=0)), inputs, labels)
    assert max_diff(sdpa, ref) <= 1e-5
    with pytest.raises(RuntimeError, match="attention_backend=flash needs"):
        make(dataclasses.replace(CFG, attention_backend="flash"))(inputs, labels)
    with pytest.raises(RuntimeError, match="norm_backend=apex needs"):
        make(dataclasses.replace(CFG, norm_backend="apex"))(inputs, labels)


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_model_on_the_flash_path_equals_sdpa(monkeypatch, position):
    """The whole model with attention routed to flash-attn (a CPU double with the library's API, see
    tests/flash_double.py): GQA, sliding window and packed documents give SDPA's loss and gradients."""
    cfg = dataclasses.replace(CFG, position_embedding=position, attention_window=5)
    inputs, labels = batch(cfg)
    ids = torch.zeros_like(inputs)
    ids[:, 7:] = 1
    ids[1, 12:] = 2
    sdpa_model = make(cfg)
    sdpa = loss_and_grads(sdpa_model, inputs, labels, segment_ids=ids)
    double = FlashAttnDouble()
    monkeypatch.setattr(attention, "_flash_attn_func", double.flash_attn_func)
    monkeypatch.setattr(attention, "_flash_attn_varlen_func", double.flash_attn_varlen_func)
    monkeypatch.setattr(attention, "select_backend", lambda requested, q, plain=True: "flash")
    flash = loss_and_grads(make(cfg), inputs, labels, segment_ids=ids)
    assert double.calls == [("varlen", (4, 0), [7, 9, 7, 5, 4])] * cfg.num_layers  # one varlen call per layer
    assert max_diff(flash, sdpa) <= 1e-5


def test_sliding_window_and_documents_change_only_what_they_should():
    inputs, labels = batch(CFG)
    full = make(CFG)(inputs)
    wide = make(dataclasses.replace(CFG, attention_window=CFG.seq_length))(inputs)
    narrow = make(dataclasses.replace(CFG, attention_window=4))(inputs)
    # a window as long as the sequence is no window
    torch.testing.assert_close(full, wide, rtol=0, atol=1e-6, check_dtype=False)
    assert (full[:, :4] - narrow[:, :4]).abs().max() <= 1e-6 and (full[:, 4:] - narrow[:, 4:]).abs().max() > 1e-4
    ids = torch.zeros_like(inputs)
    ids[:, 6:] = 1
    packed = make(CFG)(inputs, segment_ids=ids)
    # the first document never sees the second
    torch.testing.assert_close(packed[:, :6], full[:, :6], rtol=0, atol=1e-6, check_dtype=False)
    assert (packed[:, 6:] - full[:, 6:]).abs().max() > 1e-4  # the second no longer sees the first


def trainer_losses(*overrides, steps=4):
    trainer = tiny_trainer(f"train.steps={steps}", "model.num_layers=2", *overrides, validated=True)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    return losses, trainer


def test_mid_run_switch_keeps_the_loss_curve():
    plain, _ = trainer_losses()
    switched, trainer = trainer_losses("train.recompute=selective", "train.recompute_switch_step=3",
                                       "train.micro_batch_size_after_switch=4")
    assert max(abs(a - b) for a, b in zip(plain, switched)) <= 1e-5
    layer = next(iter(trainer.chunks[0].model.layers.values()))
    assert layer.recompute_block and not layer.self_attn.recompute_core
    assert [mb.shape[0] for mb in trainer.loader.next_global_batch()] == [4, 4]


def test_switch_config_is_validated():
    cfg = load_config("launch/configs/tiny.yaml", ["train.micro_batch_size_after_switch=3",
                                                   "train.recompute_switch_step=2"])
    with pytest.raises(ConfigError, match="micro_batch_size_after_switch=3"):
        validate(cfg, 1)
    cfg = load_config("launch/configs/tiny.yaml", ["train.micro_batch_size_after_switch=4"])
    with pytest.raises(ConfigError, match="recompute_switch_step"):
        validate(cfg, 1)
    with pytest.raises(ConfigError, match="not one of"):
        load_config("launch/configs/tiny.yaml", ["model.attention_backend=xformers"])


def tp_kernels_match_single_process(rank, world, fused_loss=False):
    cfg = dataclasses.replace(CFG, loss_chunk_tokens=5, fused_lm_head_loss=fused_loss)
    tp = TensorParallel.from_topology(Topology(Layout(tp=world), rank), sequence_parallel=True)
    model, ref = make(cfg, tp=tp), make(cfg)
    model.compile_blocks(backend="aot_eager")
    inputs, labels = batch(cfg)
    want = loss_and_grads(ref, inputs, labels)
    worst = 0.0
    for mode in ("selective", "full"):
        model.set_recompute(mode)
        loss, grads = loss_and_grads(model, inputs, labels)
        allreduce_replicated_grads(model, tp)
        params = dict(model.named_parameters())
        worst = max(worst, (loss - want[0]).abs().item())
        for name, g in want[1].items():
            p = params[name]
            full = torch.zeros(p.full_shape)
            full[: g.shape[0]] = g
            worst = max(worst, (p.grad - local_slice(full, p, tp)).abs().max().item())
    return worst


def test_tensor_parallel_with_recompute_compile_and_chunked_loss():
    pool = WorkerPool(2)
    try:
        assert max(pool.run(tp_kernels_match_single_process)) <= 1e-5
        assert max(pool.run(tp_kernels_match_single_process, fused_loss=True)) <= 1e-5  # vocab-parallel fused
    finally:
        pool.close()


def test_fused_output_loss_equals_unfused_and_keeps_no_logits():
    inputs, labels = batch(CFG, b=4)
    plain, fused = make(CFG), make(dataclasses.replace(CFG, fused_lm_head_loss=True))
    assert max_diff(loss_and_grads(fused, inputs, labels), loss_and_grads(plain, inputs, labels)) <= 1e-5
    logits = inputs.numel() * CFG.vocab_size
    saved_plain, saved_fused = (saved_activation_elements(m, inputs, labels) for m in (plain, fused))
    assert saved_plain - saved_fused >= logits  # the [tokens, vocab] logits are not kept for backward


def test_alibi_slopes_stay_fp32_in_a_bf16_model():
    model = make(dataclasses.replace(CFG, position_embedding="alibi"), torch.bfloat16)
    slopes = next(iter(model.model.layers.values())).self_attn.slopes
    assert slopes.dtype == torch.float32 and torch.equal(slopes, alibi_slopes(CFG.num_attention_heads))
