"""engine/hf_config.py: every field of transformers' Llama, Mistral and Qwen2 configs is mapped, known to be
irrelevant or refused by name; both RoPE forms read, disagreements refused; continued pretraining from a
Hugging Face directory refuses what does not fit, in one line."""
import json

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from engine.checkpoint_io import CheckpointError
from engine.config import Config, ConfigError, ModelConfig
from engine.hf_checkpoint import HFWeights, fill_model_from_hf
from engine.hf_config import IRRELEVANT, MAPPED, REQUIRED, hf_config_dict, model_from_hf, v4_rope_fields
from tests.hf_family_configs import LLAMA_3_2_1B, MISTRAL_7B, QWEN2_5_0_5B

# Fields PretrainedConfig itself writes into every to_dict(), whatever the family.
GENERIC = {"output_hidden_states", "return_dict", "dtype", "chunk_size_feed_forward", "is_encoder_decoder",
           "id2label", "label2id", "problem_type", "_name_or_path", "transformers_version", "output_attentions",
           "architectures", "model_type", "tie_word_embeddings"}


@pytest.mark.parametrize("cls", [LlamaConfig, MistralConfig, Qwen2Config])
def test_every_field_of_the_transformers_config_classes_is_accounted_for(cls):
    fields = set(cls().to_dict())
    assert fields - set(MAPPED) - IRRELEVANT - set(REQUIRED) <= GENERIC
    assert GENERIC - {"architectures", "model_type", "tie_word_embeddings"} <= IRRELEVANT


@pytest.mark.parametrize("field,value,message", [
    ("quantization_config", {"quant_method": "gptq"}, r"field\(s\) quantization_config are not implemented"),
    ("hidden_act", "gelu", r"hidden_act='gelu': Trilith implements only hidden_act='silu'"),
    ("mlp_bias", True, r"mlp_bias=True"),
    ("attention_bias", True, r"attention_bias=True: a Llama with attention_bias also biases o_proj"),
    ("rope_interleaved", True, r"rope_interleaved=True"),
    ("partial_rotary_factor", 0.5, r"partial_rotary_factor=0.5"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, r"rope_type='dynamic' is not one of linear, llama3"),
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, r"rope_type='longrope'"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, r"missing low_freq_factor, high_freq_factor"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}, r"rope_theta=500000.0: disagrees with "
                                                                       r"rope_parameters.rope_theta=10000.0"),
    ("architectures", ["LlamaForSequenceClassification"], r"only LlamaForCausalLM converts"),
])
def test_llama_fields_trilith_cannot_honour_are_refused_by_name(field, value, message):
    with pytest.raises(ConfigError, match=message):
        model_from_hf({**LLAMA_3_2_1B, field: value})


def test_qwen2_and_mistral_specific_refusals():
    with pytest.raises(ConfigError, match=r"use_mrope=True"):
        model_from_hf({**QWEN2_5_0_5B, "use_mrope": True})
    with pytest.raises(ConfigError, match=r"max_window_layers=2: gives a sliding window to only some of the 4"):
        model_from_hf({**QWEN2_5_0_5B, "use_sliding_window": True, "max_window_layers": 2})
    every_layer = model_from_hf({**QWEN2_5_0_5B, "use_sliding_window": True, "sliding_window": 8,
                                 "max_window_layers": 0})
    assert every_layer.attention_window == 8 and every_layer.attention_bias
    with pytest.raises(ConfigError, match=r"layer_types=.*must match"):
        model_from_hf({**QWEN2_5_0_5B, "layer_types": ["sliding_attention"] * 4})
    assert model_from_hf({**MISTRAL_7B, "sliding_window": None}).attention_window == 0
    with pytest.raises(ConfigError, match=r"unsupported architecture \['GemmaForCausalLM'\]"):
        model_from_hf({**MISTRAL_7B, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]})


def test_both_rope_forms_read_the_same_and_export_writes_both():
    hub = model_from_hf(LLAMA_3_2_1B, seq_length=64)
    nested = {k: v for k, v in LLAMA_3_2_1B.items() if k not in ("rope_theta", "rope_scaling")}
    nested["rope_parameters"] = {**LLAMA_3_2_1B["rope_scaling"], "rope_theta": 500000.0}
    assert model_from_hf(nested, seq_length=64) == hub
    assert hub.rope_theta == 500000.0 and hub.rope_scaling["rope_type"] == "llama3" and hub.seq_length == 64
    assert hub.max_position_embeddings == 131072 and hub.tie_embeddings and hub.hf_model_type == "llama"
    fields = hf_config_dict(hub)
    assert fields["rope_parameters"] == nested["rope_parameters"]
    assert v4_rope_fields(hub) == {"rope_theta": 500000.0, "rope_scaling": LLAMA_3_2_1B["rope_scaling"]}
    # what a transformers-4 reader (top-level fields only) sees equals what transformers 5 sees
    v4_view = LlamaConfig(**{**fields, **v4_rope_fields(hub), "rope_parameters": None})
    assert v4_view.rope_parameters == LlamaConfig(**fields).rope_parameters


def test_export_refuses_what_its_family_cannot_express():
    with pytest.raises(ConfigError, match=r"attention_bias=true exports only as qwen2"):
        hf_config_dict(ModelConfig(attention_bias=True, hf_model_type="llama"))
    with pytest.raises(ConfigError, match=r"attention_window=8 has no Llama equivalent"):
        hf_config_dict(ModelConfig(attention_window=8, hf_model_type="llama"))
    with pytest.raises(ConfigError, match=r"position_embedding=alibi has no Hugging Face equivalent"):
        hf_config_dict(ModelConfig(position_embedding="alibi"))
    assert hf_config_dict(ModelConfig(attention_window=8))["model_type"] == "mistral"
    assert hf_config_dict(ModelConfig(attention_bias=True))["model_type"] == "qwen2"


def test_continued_pretraining_from_a_directory_that_does_not_fit(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    cfg = Config()
    cfg.checkpoint.load = str(tmp_path)
    fill_model_from_hf(cfg)
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.vocab_size) == (32, 2, 64)
    assert cfg.model.seq_length == Config().model.seq_length  # the run's own
    wrong = ModelConfig(**{**cfg.model.__dict__, "ffn_hidden_size": 40})
    with pytest.raises(CheckpointError, match=r"up_proj\.weight: \[48, 32\] vs \[40, 32\]"):
        HFWeights(tmp_path, wrong)
    bias = ModelConfig(**{**cfg.model.__dict__, "attention_bias": True})
    with pytest.raises(CheckpointError, match=r"missing \['model\.layers\.0\.self_attn\.k_proj\.bias'"):
        HFWeights(tmp_path, bias)
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()),
                                                      "hidden_act": "relu"}))
    with pytest.raises(ConfigError, match=r"config\.json: config\.json hidden_act='relu'"):
        fill_model_from_hf(cfg)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"has no model\.safetensors"):
        HFWeights(tmp_path, cfg.model)
