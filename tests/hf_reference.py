"""Build the Hugging Face model (Llama, Mistral or Qwen2, by engine/hf_config's mapping) that is the numerical
reference for Trilith's model."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from engine.checkpoint.hf_config import hf_config_dict
from engine.config.schema import ModelConfig


def hf_config(cfg: ModelConfig) -> PretrainedConfig:
    fields = hf_config_dict(cfg)
    fields["max_position_embeddings"] = max(fields["max_position_embeddings"], 32)
    return AutoConfig.for_model(**fields, attn_implementation="eager", dtype=torch.float32)


def hf_model_from(ours: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_config(hf_config(cfg)).float()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" and cfg.tie_embeddings for k in missing), missing
    hf.eval()
    return hf
