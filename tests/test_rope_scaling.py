"""kernels/rope.py's scalings (linear, llama3, yarn) equal transformers' rotary embedding, forward and backward,
and bad scalings are refused with the key named."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.config.schema import ConfigError, ModelConfig, load_config, validate
from kernels.rope import apply_rope_fused, rope_cos_sin, rope_scaling_problem

TOL = 1e-5
SCALINGS = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_beta_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                         "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 96,
                         "truncate": False, "attention_factor": 1.3},
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("head_dim,theta", [(32, 500000.0), (64, 10000.0)])
def test_scaled_rope_matches_transformers_forward_and_backward(name, head_dim, theta):
    scaling = SCALINGS[name]
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=512, rope_theta=theta,
                         rope_scaling=dict(scaling) if scaling else None)
    seq = 300  # past every original context above: the scaled frequencies matter
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), torch.arange(seq)[None])
    cos, sin = rope_cos_sin(seq, head_dim, theta, scaling=scaling)
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=TOL, check_dtype=False)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=TOL, check_dtype=False)
    q = torch.randn(2, 4, seq, head_dim, generator=torch.Generator().manual_seed(0), requires_grad=True)
    k = torch.randn(2, 4, seq, head_dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    ours_q, ours_k = apply_rope_fused(q, cos, sin), apply_rope_fused(k, cos, sin)
    torch.testing.assert_close(ours_q, ref_q, rtol=0, atol=TOL, check_dtype=False)
    torch.testing.assert_close(ours_k, ref_k, rtol=0, atol=TOL, check_dtype=False)
    upstream = torch.randn_like(q)
    ref_grad = torch.autograd.grad((ref_q * upstream).sum() + ref_k.sum(), (q, k))
    grad = torch.autograd.grad((ours_q * upstream).sum() + ours_k.sum(), (q, k))
    for a, b in zip(grad, ref_grad):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, check_dtype=False)


def test_scaling_changes_the_angles():
    plain = rope_cos_sin(128, 32, 10000.0)[0]
    for name in ("linear", "llama3", "yarn"):
        assert not torch.allclose(rope_cos_sin(128, 32, 10000.0, scaling=SCALINGS[name])[0], plain), name


@pytest.mark.parametrize("scaling,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_type='dynamic' is not one of linear, llama3, yarn"),
    ({"rope_type": "llama3", "factor": 8.0}, r"missing low_freq_factor, high_freq_factor, original_max_posit"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, r"unknown beta_fast"),
    ({"rope_type": "linear", "factor": -2.0}, r"factor must be positive"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, r"low_freq_factor must be below high_freq_factor"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "truncate": 1},
     r"truncate must be true or false"),
])
def test_bad_scalings_are_refused_in_the_config(scaling, message):
    assert rope_scaling_problem(scaling) is not None
    cfg = load_config(None, ["data.mock=true"])
    cfg.model.rope_scaling = scaling
    with pytest.raises(ConfigError, match=r"model\.rope_scaling: .*" + message):
        validate(cfg, 1)


def test_rope_scaling_from_yaml_overrides():
    cfg = load_config(None, ["data.mock=true", "model.rope_scaling={rope_type: linear, factor: 2}"])
    assert cfg.model.rope_scaling == {"rope_type": "linear", "factor": 2}
    validate(cfg, 1)
    with pytest.raises(ConfigError, match=r"model\.rope_scaling: expected a mapping"):
        load_config(None, ["model.rope_scaling=linear"])
    assert ModelConfig().rope_scaling == {}
