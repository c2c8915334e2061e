"""Build the Hugging Face `LlamaForCausalLM` that is the numerical reference for Trilith's model."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import ModelConfig


def hf_config(cfg: ModelConfig) -> LlamaConfig:
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.kv_heads, max_position_embeddings=max(cfg.seq_length, 32),
                       rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
                       attention_bias=False, mlp_bias=False, hidden_act="silu", attn_implementation="eager",
                       torch_dtype=torch.float32)


def hf_model_from(ours: torch.nn.Module, cfg: ModelConfig) -> LlamaForCausalLM:
    hf = LlamaForCausalLM(hf_config(cfg)).float()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" and cfg.tie_embeddings for k in missing), missing
    hf.eval()
    return hf
