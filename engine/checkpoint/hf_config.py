"""Hugging Face `config.json` <-> `model.*`: Llama, Mistral and Qwen2 in both transformers generations.

transformers 4.x (and llama.cpp, vLLM) read `rope_theta` and `rope_scaling` at the top level; transformers
>= 5 keeps them in `rope_parameters`. `model_from_hf` reads either (and refuses a config whose two forms
disagree); `hf_config_dict` and `v4_rope_fields` give an export both.

Every field of a config falls in one of three classes (`unknown_fields` sorts them):
- it changes the arithmetic: mapped onto `model.*` (MAPPED), accepted only at the value Trilith implements
  (REQUIRED), or refused with the reason;
- metadata or a token id (`is_metadata`): names, versions, dtypes, generation settings, `_`-prefixed
  bookkeeping and every `*_token_id`, accepted; the token ids (`token_ids`) travel to the export;
- unknown: refused by name, since it may change the arithmetic, unless the config.json itself lists it under
  ACCEPT_KEY — the one switch, read by every entry point (checkpoint.load, ckpt_convert, evaluate, generate).
"""
from __future__ import annotations

from engine.config.schema import ConfigError, ModelConfig
from kernels.rope import rope_scaling_problem

KERNELS_CLASH = ("transformers cannot load beside Trilith: transformers >= 5.25 imports Hugging Face's `kernels` "
                 "package, and Trilith's own kernels/ package has that import name; fix: "
                 "pip install 'transformers<5.25' (what setup.py installs), or pip uninstall kernels")

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

MAPPED = {  # config.json field -> model.* key
    "hidden_size": "hidden_size", "num_hidden_layers": "num_layers", "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_kv_heads", "intermediate_size": "ffn_hidden_size", "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings", "initializer_range": "init_std", "attention_dropout": "attention_dropout",
    "head_dim": "kv_channels", "rope_theta": "rope_theta", "rope_scaling": "rope_scaling",
    "rope_parameters": "rope_theta, rope_scaling", "attention_bias": "attention_bias",
    "sliding_window": "attention_window", "use_sliding_window": "attention_window",
    "max_window_layers": "attention_window", "layer_types": "attention_window",
    "model_type": "hf_model_type", "architectures": "hf_model_type",
}
# Fields that do not change the model's function: bookkeeping, generation and serving switches, the
# tokenizer's special ids (kept for the export, `token_ids`), the weights' storage dtype (Trilith keeps fp32
# masters), `pretraining_tp` (only how transformers 4.x split its matmuls), Llama 1's `max_sequence_length`
# (a duplicate of max_position_embeddings that transformers never read), and what transformers 4.x's
# PretrainedConfig writes for every model: `is_decoder`, `add_cross_attention`, `cross_attention_hidden_size`
# and `tie_encoder_decoder` (read only by encoder-decoder and BERT-style models; these families are always
# causal decoders), `torchscript` (clones tied weights instead of sharing them), TensorFlow's `use_bfloat16`
# and `tf_legacy_loss`.
IRRELEVANT = {
    "transformers_version", "torch_dtype", "dtype", "use_cache", "_name_or_path", "bos_token_id", "eos_token_id",
    "pad_token_id", "pretraining_tp", "is_llama_config", "output_attentions", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class",
    "transformers.js_config", "_attn_implementation_autoset", "max_sequence_length", "name_or_path",
    "model_name_or_path", "finetuning_task", "prefix", "task_specific_params", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "torchscript", "use_bfloat16", "tf_legacy_loss",
}
# How to pick tokens, not what the model computes: the generation settings transformers 4.x kept in
# config.json (transformers 5 keeps them in generation_config.json).
GENERATION = {
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens",
}
REQUIRED = {"hidden_act": "silu", "mlp_bias": False, "rope_interleaved": False, "use_mrope": False,
            "partial_rotary_factor": 1.0, "pruned_heads": {}}
# Known to change the arithmetic, and not implemented: refused with the reason.
REFUSED = {"quantization_config": "the weights are quantized and Trilith reads full-precision ones; save a "
                                  "dequantized copy (transformers: from_pretrained, dequantize(), save_pretrained)"}
ACCEPT_KEY = "trilith_accept_keys"  # config.json: unknown fields a user has checked do not change the model


def is_metadata(field: str) -> bool:
    """Names, versions, bookkeeping (`_`-prefixed, e.g. a GGUF import's `_model_name_or_path`), generation
    settings and token ids (bos/eos/pad/unk/sep/...): nothing the forward pass reads."""
    return field in IRRELEVANT or field in GENERATION or field == ACCEPT_KEY or field.startswith("_") or \
        field.endswith("_token_id")


def token_ids(hf: dict) -> dict:
    """Every `*_token_id` field of a config.json that is set: what an export back to Hugging Face repeats."""
    return {k: v for k, v in hf.items() if k.endswith("_token_id") and v is not None}


def unknown_fields(hf: dict) -> list[str]:
    """The fields that are neither mapped, required, refused nor metadata, less those the file accepts."""
    accepted = hf.get(ACCEPT_KEY, [])
    if not isinstance(accepted, list) or not all(isinstance(k, str) for k in accepted):
        raise _refuse(ACCEPT_KEY, accepted, 'must be a list of field names, e.g. ["rope_foo"]')
    known = set(MAPPED) | set(REQUIRED) | set(REFUSED)
    return sorted(k for k in hf if k not in known and not is_metadata(k) and k not in accepted)


def _refuse(field: str, value, why: str) -> ConfigError:
    return ConfigError(f"config.json {field}={value!r}: {why}")


def _scaling(params: dict | None, hf: dict) -> dict | None:
    """One form of the RoPE fields as model.rope_scaling ({} = plain RoPE); None when the form is absent."""
    if not params:
        return None
    kind = params.get("rope_type") or params.get("type") or "default"
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type", "type")}
    if kind in ("llama3", "yarn"):  # transformers' default for the original context
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return {"rope_type": kind, **scaling} if kind != "default" or scaling else {}


def _rope(hf: dict) -> tuple[float, dict]:
    """(theta, model.rope_scaling) from the top-level fields or `rope_parameters`, whichever the file has."""
    nested = hf.get("rope_parameters") or {}
    theta = nested.get("rope_theta", hf.get("rope_theta", 10000.0))
    if "rope_theta" in hf and float(hf["rope_theta"]) != float(theta):
        raise _refuse("rope_theta", hf["rope_theta"], f"disagrees with rope_parameters.rope_theta={theta}; "
                                                      f"remove the stale one")
    top, inner = _scaling(hf.get("rope_scaling"), hf), _scaling(nested, hf)
    if top is not None and inner is not None and top != inner:
        raise _refuse("rope_scaling", hf["rope_scaling"], f"disagrees with rope_parameters={nested}")
    scaling = top if top is not None else inner or {}
    problem = rope_scaling_problem(scaling)
    if problem:
        raise ConfigError(f"config.json RoPE scaling {scaling}: {problem}")
    return float(theta), scaling


def _window(hf: dict, model_type: str, layers: int) -> int:
    """Mistral: `sliding_window` for every layer (null = none). Qwen2: only with `use_sliding_window`, and
    only for layers from `max_window_layers` on (`layer_types` in transformers 5) — all or none here."""
    window = hf.get("sliding_window")
    if model_type == "llama":
        return 0
    if model_type == "mistral":
        return int(window or 0)
    types = hf.get("layer_types")
    if not hf.get("use_sliding_window") or window is None:
        sliding = []
    else:
        sliding = [i for i in range(layers) if i >= hf.get("max_window_layers", 28)]
    if types is not None:
        declared = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if len(types) != layers or set(types) - {"full_attention", "sliding_attention"} or \
                (sliding != declared and not (not hf.get("use_sliding_window") and not declared)):
            raise _refuse("layer_types", types, "must match use_sliding_window/max_window_layers and list "
                                                f"{layers} full_attention or sliding_attention entries")
    if sliding and len(sliding) != layers:
        raise _refuse("max_window_layers", hf.get("max_window_layers"),
                      f"gives a sliding window to only some of the {layers} layers; Trilith's "
                      f"model.attention_window applies to all of them (use 0, or use_sliding_window=false)")
    return int(window) if sliding else 0


def model_from_hf(hf: dict, seq_length: int = 0) -> ModelConfig:
    """`model.*` for a Hugging Face `config.json` (as a dict); ConfigError names any field Trilith cannot honour."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {hf.get('architectures') or model_type}: Trilith converts "
                          f"model_type {', '.join(ARCHITECTURES)} ({', '.join(ARCHITECTURES.values())})")
    if hf.get("architectures") not in (None, [ARCHITECTURES[model_type]]):
        raise _refuse("architectures", hf["architectures"], f"only {ARCHITECTURES[model_type]} converts")
    for field, why in REFUSED.items():
        if hf.get(field) is not None:
            raise _refuse(field, hf[field], why)
    unknown = unknown_fields(hf)
    if unknown:
        listed = ", ".join(f'"{k}"' for k in unknown)
        raise ConfigError(f"config.json field(s) {', '.join(unknown)} are unknown to Trilith and may change what "
                          f"the model computes, which an import would silently ignore; if you have checked that "
                          f"they do not, accept them in that config.json: \"{ACCEPT_KEY}\": [{listed}]")
    for field, wanted in REQUIRED.items():
        if hf.get(field, wanted) != wanted:
            raise _refuse(field, hf[field], f"Trilith implements only {field}={wanted!r}")
    bias = bool(hf.get("attention_bias", False))
    if model_type == "llama" and bias:
        raise _refuse("attention_bias", True, "a Llama with attention_bias also biases o_proj, which Trilith's "
                                              "model does not implement (Qwen2's q/k/v biases it does)")
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return ModelConfig(
        hidden_size=hf["hidden_size"], num_layers=layers, num_attention_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_length=seq_length or hf.get("max_position_embeddings", 2048),
        max_position_embeddings=hf.get("max_position_embeddings", 0), rope_theta=theta, rope_scaling=scaling,
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range", 0.02), attention_dropout=float(hf.get("attention_dropout", 0.0)),
        kv_channels=0 if head_dim * heads == hf["hidden_size"] else head_dim,
        attention_bias=model_type == "qwen2", attention_window=_window(hf, model_type, layers),
        hf_model_type=model_type)


def export_model_type(model: ModelConfig) -> str:
    """The family a model exports as: model.hf_model_type, else the one that has its features."""
    kind = model.hf_model_type or ("qwen2" if model.attention_bias else "mistral" if model.attention_window
                                   else "llama")
    if model.position_embedding != "rope":
        raise ConfigError(f"model.position_embedding={model.position_embedding} has no Hugging Face equivalent "
                          f"(Llama, Mistral and Qwen2 use RoPE); only rope models export")
    if model.attention_bias and kind != "qwen2":
        raise ConfigError(f"model.attention_bias=true exports only as qwen2 (q/k/v biases), not {kind}")
    if kind == "qwen2" and not model.attention_bias:
        raise ConfigError("model.hf_model_type=qwen2 needs model.attention_bias=true (Qwen2 has q/k/v biases)")
    if model.attention_window and kind == "llama":
        raise ConfigError(f"model.attention_window={model.attention_window} has no Llama equivalent; export as "
                          f"mistral or qwen2 (model.hf_model_type)")
    return kind


def hf_config_dict(model: ModelConfig) -> dict:
    """The config fields of the model's family, in transformers 5's form (`rope_parameters`)."""
    kind = export_model_type(model)
    heads = model.num_attention_heads
    fields = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": model.vocab_size,
              "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
              "num_hidden_layers": model.num_layers, "num_attention_heads": heads,
              "num_key_value_heads": model.kv_heads, "hidden_act": "silu",
              "max_position_embeddings": model.max_position_embeddings or model.seq_length,
              "initializer_range": model.init_std, "rms_norm_eps": model.norm_eps,
              "tie_word_embeddings": model.tie_embeddings, "attention_dropout": model.attention_dropout,
              "rope_parameters": {"rope_type": "default", **model.rope_scaling, "rope_theta": model.rope_theta}}
    window = model.attention_window or None
    if kind == "llama":
        fields.update(head_dim=model.head_dim, attention_bias=False, mlp_bias=False)
    elif kind == "mistral":
        fields.update(head_dim=model.head_dim, sliding_window=window)
    else:
        fields.update(use_sliding_window=bool(window), sliding_window=window,
                      max_window_layers=0 if window else model.num_layers)
        if model.kv_channels:
            fields["head_dim"] = model.head_dim
    return fields


def v4_rope_fields(model: ModelConfig) -> dict:
    """Top-level `rope_theta` and `rope_scaling`: what transformers 4.x, llama.cpp and vLLM read."""
    return {"rope_theta": model.rope_theta, "rope_scaling": dict(model.rope_scaling) or None}


def import_transformers():
    """transformers, loaded as far as a model class needs; a clash over the name `kernels` is one line, not an
    ImportError from inside transformers."""
    try:
        import transformers
        import transformers.activations  # noqa: F401  (the module that imports `kernels` when it is installed)
    except ImportError as exc:
        if "kernels" in str(exc):
            raise SystemExit(KERNELS_CLASH) from None
        raise
    return transformers
