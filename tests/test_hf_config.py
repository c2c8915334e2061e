"""engine/checkpoint/hf_config.py: every field of transformers' Llama, Mistral and Qwen2 configs (as transformers 4 and 5
write them, from the hub or from a GGUF file) is mapped, metadata, or refused by name with the fix; token ids
travel to the export; both RoPE forms read, disagreements refused; continued pretraining from a Hugging Face
directory refuses what does not fit, in one line."""
import json

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.hf_config import (ACCEPT_KEY, hf_config_dict, model_from_hf, token_ids, unknown_fields,
                                         v4_rope_fields)
from engine.checkpoint.hf_weights import HFWeights, fill_model_from_hf
from engine.checkpoint.model_source import ModelSource
from engine.config.schema import Config, ConfigError, ModelConfig, save_config
from tests.hf_family_configs import (GGUF_LLAMA_V4, GGUF_LLAMA_V5, LLAMA_3_2_1B, LLAMA_TO_DICT_V4, MISTRAL_7B,
                                     QWEN2_5_0_5B)
from tools.ckpt_convert import main as convert


@pytest.mark.parametrize("cls", [LlamaConfig, MistralConfig, Qwen2Config])
def test_every_field_of_the_transformers_config_classes_is_accounted_for(cls):
    assert unknown_fields(cls().to_dict()) == []
    model_from_hf(cls().to_dict())


def test_configs_as_transformers_4_and_5_write_them_import_alike():
    assert model_from_hf(LLAMA_TO_DICT_V4) == model_from_hf(LlamaConfig(**LLAMA_TO_DICT_V4).to_dict())
    from_gguf = model_from_hf(GGUF_LLAMA_V5)
    assert model_from_hf(GGUF_LLAMA_V4) == from_gguf
    assert (from_gguf.vocab_size, from_gguf.ffn_hidden_size, from_gguf.num_kv_heads, from_gguf.rope_theta,
            from_gguf.tie_embeddings) == (320, 96, 2, 50000.0, False)


@pytest.mark.parametrize("config", [GGUF_LLAMA_V5, LLAMA_TO_DICT_V4], ids=["gguf-v5", "to_dict-v4"])
def test_metadata_and_token_ids_are_accepted_unknown_fields_refused_by_name_with_the_fix(config):
    model_from_hf({**config, "_commit_hash": "abc", "cls_token_id": 5, "mask_token_id": 6, "temperature": 0.7})
    with pytest.raises(ConfigError, match=r"field\(s\) logit_scale, rope_foo are unknown to Trilith and may "
                                          r"change what the model computes.*accept them in that config\.json: "
                                          r'"trilith_accept_keys": \["logit_scale", "rope_foo"\]'):
        model_from_hf({**config, "rope_foo": 2, "logit_scale": 0.5})
    accepted = {**config, "rope_foo": 2, "logit_scale": 0.5, ACCEPT_KEY: ["rope_foo"]}
    with pytest.raises(ConfigError, match=r"field\(s\) logit_scale are unknown"):
        model_from_hf(accepted)
    assert model_from_hf({**accepted, ACCEPT_KEY: ["rope_foo", "logit_scale"]}) == model_from_hf(config)
    # accepting is for unknown fields only: one Trilith knows to change the arithmetic stays refused
    with pytest.raises(ConfigError, match=r"hidden_act='gelu'"):
        model_from_hf({**config, "hidden_act": "gelu", ACCEPT_KEY: ["hidden_act"]})
    with pytest.raises(ConfigError, match=r"trilith_accept_keys='rope_foo': must be a list of field names"):
        model_from_hf({**config, ACCEPT_KEY: "rope_foo"})


@pytest.mark.parametrize("field,value,message", [
    ("quantization_config", {"quant_method": "gptq"}, r"quantization_config=.*: the weights are quantized"),
    ("pruned_heads", {"0": [1]}, r"pruned_heads=\{'0': \[1\]\}: Trilith implements only pruned_heads=\{\}"),
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


@pytest.mark.parametrize("config", [GGUF_LLAMA_V4, GGUF_LLAMA_V5], ids=["transformers4", "transformers5"])
def test_a_llama_converted_from_gguf_loads_everywhere_and_its_token_ids_reach_the_export(tmp_path, config):
    src = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if not k.startswith("_")})).save_pretrained(src)
    (src / "config.json").write_text(json.dumps(config))  # as transformers wrote it from the GGUF file
    source = ModelSource(src)  # tools/evaluate.py, tools/generate.py
    assert source.model == model_from_hf(config)
    source.close()
    cfg = Config()
    cfg.checkpoint.load = str(src)
    fill_model_from_hf(cfg)  # checkpoint.load
    assert cfg.model.vocab_size == 320
    assert convert(["--load-dir", str(src), "--save-dir", str(tmp_path / "tri"), "--from", "hf"]) == 0
    assert convert(["--load-dir", str(tmp_path / "tri"), "--save-dir", str(tmp_path / "back"), "--to", "hf"]) == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    ids = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    assert [back[k] for k in ids] == [1, 1, 2, 0]
    generation = json.loads((tmp_path / "back" / "generation_config.json").read_text())
    assert [generation[k] for k in ids[:3]] == [1, 1, 2]
    assert LlamaConfig.from_pretrained(tmp_path / "back").unk_token_id == 0

    (src / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 50.0}))
    fix = r'attn_logit_softcapping are unknown.*"trilith_accept_keys": \["attn_logit_softcapping"\]'
    with pytest.raises(ConfigError, match=fix):
        ModelSource(src)
    with pytest.raises(ConfigError, match=fix):
        fill_model_from_hf(cfg)
    with pytest.raises(SystemExit, match=fix):
        convert(["--load-dir", str(src), "--save-dir", str(tmp_path / "tri2"), "--from", "hf"])
    (src / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 50.0,
                                                 ACCEPT_KEY: ["attn_logit_softcapping"]}))
    ModelSource(src).close()


def test_every_token_id_an_import_records_is_written_where_transformers_reads_it(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    ids = {"bos_token_id": 5, "eos_token_id": [6, 7], "sep_token_id": 8, "decoder_start_token_id": 9,
           "forced_eos_token_id": 7, "pad_token_id": None}
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf, **ids}))
    assert convert(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "tri"), "--from", "hf"]) == 0
    assert convert(["--load-dir", str(tmp_path / "tri"), "--save-dir", str(tmp_path / "back"), "--to", "hf"]) == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    generation = json.loads((tmp_path / "back" / "generation_config.json").read_text())
    kept = ("bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id", "pad_token_id")
    assert [back[k] for k in kept] == [5, [6, 7], 8, 9, None]
    assert (generation["eos_token_id"], generation["decoder_start_token_id"], generation["forced_eos_token_id"]) \
        == ([6, 7], 9, 7)


def test_a_run_started_from_a_directory_keeps_its_token_ids_save_after_save(tmp_path):
    """checkpoint.load of a Hugging Face directory, a save, a resume from it in another run, a save, the export:
    unk (and every other *_token_id) of the directory's config.json is still there at the end."""
    from tests.helpers import tiny_trainer
    src = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in GGUF_LLAMA_V5.items() if not k.startswith("_")})) \
        .save_pretrained(src)
    (src / "config.json").write_text(json.dumps(GGUF_LLAMA_V5))
    first = tiny_trainer(f"checkpoint.load={src}", f"run.dir={tmp_path / 'a'}", "train.steps=1")
    saved = first.save_checkpoint()
    first.checkpointer.wait()
    save_config(first.cfg, tmp_path / "first.yaml")  # the directory's model, as the run filled it in
    second = tiny_trainer(f"checkpoint.load={saved}", f"run.dir={tmp_path / 'b'}", config=str(tmp_path / "first.yaml"))
    again = second.save_checkpoint()
    second.checkpointer.wait()
    recorded = json.loads((again / "metadata.json").read_text())["special_tokens"]
    assert recorded == token_ids(GGUF_LLAMA_V5) and recorded["unk_token_id"] == 0
    assert convert(["--load-dir", str(again), "--save-dir", str(tmp_path / "back"), "--to", "hf",
                    "--tokenizer", ""]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["unk_token_id"] == 0
