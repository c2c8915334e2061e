"""Trilith's model equals transformers' Llama / Mistral / Qwen2 causal LMs: logits, loss and every gradient (fp32)."""
import pytest
import torch

from engine.config.schema import ModelConfig
from engine.model import CausalLM, num_parameters
from tests.hf_reference import hf_model_from

TOL = 1e-5

SHAPES = {
    "mha": ModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=96, vocab_size=101,
                       seq_length=16, rope_theta=10000.0),
    "gqa": ModelConfig(hidden_size=64, num_layers=3, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=80,
                       vocab_size=97, seq_length=16, rope_theta=500000.0),
    "mqa_tied": ModelConfig(hidden_size=48, num_layers=2, num_attention_heads=6, num_kv_heads=1, ffn_hidden_size=64,
                            vocab_size=64, seq_length=12, tie_embeddings=True),
    # head_dim != hidden / heads, Llama 3.1 RoPE scaling (exported as Llama)
    "llama3_head_dim": ModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, kv_channels=24,
                                   ffn_hidden_size=96, vocab_size=101, seq_length=16, rope_theta=500000.0,
                                   max_position_embeddings=64, rope_scaling={
                                       "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
    # sliding window (exported as Mistral), linear scaling
    "mistral_window": ModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                                  ffn_hidden_size=96, vocab_size=101, seq_length=16, attention_window=5,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # q/k/v biases (exported as Qwen2), YaRN
    "qwen2_bias_yarn": ModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                                   ffn_hidden_size=96, vocab_size=101, seq_length=16, attention_bias=True,
                                   tie_embeddings=True, rope_theta=1000000.0, rope_scaling={
                                       "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_logits_loss_and_grads_match_transformers(name):
    cfg = SHAPES[name]
    ours = CausalLM(cfg)
    ours.init_weights(seed=7)
    with torch.no_grad():  # biases start at zero; random ones test that they are applied where HF applies them
        for pname, p in ours.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.5)
    hf = hf_model_from(ours, cfg)
    assert sum(p.numel() for p in ours.parameters()) == num_parameters(cfg)

    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    logits = ours(inputs)
    ref = hf(input_ids=inputs).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=TOL, check_dtype=False)

    loss = ours(inputs, labels)
    ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, cfg.vocab_size), labels.reshape(-1))
    assert abs(loss.item() - ref_loss.item()) <= TOL
    loss.backward()
    ref_loss.backward()
    hf_grads = dict(hf.named_parameters())
    for pname, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[pname].grad, rtol=0, atol=TOL, check_dtype=False,
                                   msg=lambda m: f"{pname}: {m}")


def test_initialisation_depends_only_on_seed_and_name():
    cfg = SHAPES["gqa"]
    a, b, c = CausalLM(cfg), CausalLM(cfg), CausalLM(cfg)
    a.init_weights(3)
    b.init_weights(3)
    c.init_weights(4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    stage = CausalLM(cfg, layer_ids=[2], pre_process=False)
    stage.init_weights(3)
    assert torch.equal(stage.model.layers["2"].mlp.up_proj.weight, a.model.layers["2"].mlp.up_proj.weight)


def test_deepnorm_init_scales_residual_projections():
    base = ModelConfig(hidden_size=64, num_layers=8, num_attention_heads=4, ffn_hidden_size=96, vocab_size=50)
    scaled = ModelConfig(**{**base.__dict__, "deepnorm_init": True})
    a, b = CausalLM(base), CausalLM(scaled)
    a.init_weights(1)
    b.init_weights(1)
    beta = (8 * 8) ** -0.25
    wa, wb = a.model.layers["0"].self_attn.o_proj.weight, b.model.layers["0"].self_attn.o_proj.weight
    assert torch.allclose(wb, wa * beta)
    assert torch.equal(a.model.layers["0"].self_attn.q_proj.weight, b.model.layers["0"].self_attn.q_proj.weight)


def test_alibi_model_runs_and_is_causal():
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_attention_heads=4, ffn_hidden_size=48, vocab_size=40,
                      seq_length=8, position_embedding="alibi")
    m = CausalLM(cfg)
    m.init_weights(0)
    x = torch.randint(0, 40, (1, 8))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 40
    # changing the last token must not change earlier positions' logits
    assert torch.allclose(m(x)[:, :-1], m(y)[:, :-1])
    assert not torch.allclose(m(x)[:, -1], m(y)[:, -1])
