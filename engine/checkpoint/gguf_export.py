"""Write a Trilith checkpoint as one GGUF file for llama.cpp / Ollama (`ckpt_convert.py --to gguf`).

The model is written as llama.cpp's `llama` architecture: the metadata its loader reads
(`llama.context_length`, `embedding_length`, `block_count`, `feed_forward_length`, `attention.head_count`,
`head_count_kv`, `rope.freq_base`, `attention.layer_norm_rms_epsilon`, `rope.dimension_count`, `vocab_size`)
and the tensors under its names (`token_embd`, `blk.N.attn_q` ..., `output_norm`, `output`).

Why q and k are permuted. Trilith (like Hugging Face) rotates the two halves of each head (`rotate_half`:
element i pairs with i + d/2); llama.cpp's `llama` rotates adjacent pairs (2i, 2i+1). Reordering each head's
rows so that row i and row i + d/2 become neighbours — reshape (heads, 2, d/2, in) -> swap the middle axes —
makes llama.cpp's rotation compute the same q·k, the permutation llama.cpp's convert_hf_to_gguf.py applies.

The tokenizer goes in as `tokenizer.ggml.*`: byte-level BPE as model `gpt2` with the pre-tokenizer named by
what its tokenizer.json does (`gpt-2` for the plain GPT-2 regex, which tools/train_tokenizer.py trains), a
SentencePiece model as `llama`; the special ids are those of the Hugging Face export (data/offline/hf_tokenizer.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from data.eod import CONFIG_FILES, tokenizer_file
from data.offline.hf_tokenizer import export_roles

# The pre-tokenizer regexes llama.cpp knows by these `tokenizer.ggml.pre` names (Llama 3, Qwen2).
KNOWN_SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "qwen2",
}
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


class GGUFExportError(ValueError):
    """A model or tokenizer that llama.cpp's llama architecture cannot represent; the message names what."""


def permute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection from rotate-half order to llama.cpp's adjacent-pair order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama3_rope_factors(model) -> np.ndarray:
    """`rope_freqs.weight`: llama.cpp divides each rotary frequency by these for `llama3` scaling."""
    s = model.rope_scaling
    dim = model.head_dim
    freqs = 1.0 / model.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / s["low_freq_factor"], old / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1.0 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(factors, np.float32)


def check_model(model) -> None:
    """Refuse what the `llama` architecture of llama.cpp would silently compute differently."""
    problems = []
    if model.position_embedding != "rope":
        problems.append(f"model.position_embedding={model.position_embedding} (llama uses RoPE)")
    if getattr(model, "attention_bias", False):
        problems.append("model.attention_bias=true (Qwen2-style q/k/v biases)")
    if getattr(model, "attention_window", 0):
        problems.append(f"model.attention_window={model.attention_window} (sliding window)")
    kind = (getattr(model, "rope_scaling", None) or {}).get("rope_type", "default")
    if kind not in ("default", "linear", "llama3"):
        problems.append(f"model.rope_scaling rope_type={kind}")
    if problems:
        raise GGUFExportError(f"the GGUF export writes llama.cpp's llama architecture, which lacks "
                              f"{'; '.join(problems)}; export with --to hf and use llama.cpp's "
                              f"convert_hf_to_gguf.py for that family")


def write_hparams(writer, model) -> None:
    heads, dim = model.num_attention_heads, model.head_dim
    writer.add_context_length(getattr(model, "max_position_embeddings", 0) or model.seq_length)
    writer.add_embedding_length(model.hidden_size)
    writer.add_block_count(model.num_layers)
    writer.add_feed_forward_length(model.ffn_hidden_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(model.kv_heads)
    writer.add_rope_freq_base(float(model.rope_theta))
    writer.add_layer_norm_rms_eps(float(model.norm_eps))
    writer.add_rope_dimension_count(dim)
    writer.add_vocab_size(model.vocab_size)
    if dim * heads != model.hidden_size:
        writer.add_key_length(dim)
        writer.add_value_length(dim)
    scaling = getattr(model, "rope_scaling", None) or {}
    if scaling.get("rope_type") == "linear":
        import gguf
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))


def gguf_tensors(model, read) -> dict[str, torch.Tensor]:
    """{GGUF name: fp32 tensor} from `read(Hugging Face-style name)`."""
    heads, kv = model.num_attention_heads, model.kv_heads
    out = {"token_embd.weight": read("model.embed_tokens.weight")}
    for i in range(model.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = read(p + "input_layernorm.weight")
        out[b + "attn_q.weight"] = permute_rotary(read(p + "self_attn.q_proj.weight"), heads)
        out[b + "attn_k.weight"] = permute_rotary(read(p + "self_attn.k_proj.weight"), kv)
        out[b + "attn_v.weight"] = read(p + "self_attn.v_proj.weight")
        out[b + "attn_output.weight"] = read(p + "self_attn.o_proj.weight")
        out[b + "ffn_norm.weight"] = read(p + "post_attention_layernorm.weight")
        out[b + "ffn_gate.weight"] = read(p + "mlp.gate_proj.weight")
        out[b + "ffn_up.weight"] = read(p + "mlp.up_proj.weight")
        out[b + "ffn_down.weight"] = read(p + "mlp.down_proj.weight")
    out["output_norm.weight"] = read("model.norm.weight")
    if not model.tie_embeddings:  # llama.cpp reuses token_embd when `output` is absent
        out["output.weight"] = read("lm_head.weight")
    if (getattr(model, "rope_scaling", None) or {}).get("rope_type") == "llama3":
        out["rope_freqs.weight"] = torch.from_numpy(llama3_rope_factors(model))
    return out


def _bpe_pre(config: dict, file: Path) -> str:
    """llama.cpp's name for what this tokenizer.json's pre-tokenizer does, or a clear refusal."""
    pre = config.get("pre_tokenizer") or {}
    if config.get("normalizer"):
        raise GGUFExportError(f"{file} has a normalizer ({config['normalizer'].get('type')}), which llama.cpp's "
                              f"BPE tokenizer does not apply; retrain without --nfkc/--strip-control")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    parts = pre.get("pretokenizers") or []
    if (pre.get("type") == "Sequence" and len(parts) == 2 and parts[0].get("type") == "Split"
            and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True)):
        name = KNOWN_SPLITS.get((parts[0].get("pattern") or {}).get("Regex"))
        if name:
            return name
    raise GGUFExportError(f"{file}: its pre-tokenizer ({json.dumps(pre)[:120]}) is none llama.cpp knows "
                          f"(gpt-2, llama-bpe, qwen2); export with --to hf and convert there")


def bpe_vocab(file: Path, vocab_size: int) -> dict:
    from tokenizers import Tokenizer
    config = json.loads(file.read_text(encoding="utf-8"))
    if (config.get("model") or {}).get("type") != "BPE":
        raise GGUFExportError(f"{file} is a {config.get('model', {}).get('type')} model; GGUF export takes "
                              f"byte-level BPE tokenizer.json files or SentencePiece models")
    pre = _bpe_pre(config, file)
    tok = Tokenizer.from_str(json.dumps(config))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = {a["id"]: a["special"] for a in config.get("added_tokens") or []}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:  # the model's vocabulary may be padded beyond the tokenizer's
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
            continue
        tokens.append(by_id[i])
        types.append(TOKEN_NORMAL if i not in added else TOKEN_CONTROL if added[i] else TOKEN_USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in config["model"].get("merges") or []]
    with_specials, plain = tok.encode("a").ids, tok.encode("a", add_special_tokens=False).ids
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges,
            "add_bos": len(with_specials) > len(plain) and with_specials[1:] == plain}


def spm_vocab(file: Path, vocab_size: int) -> dict:
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(file.read_bytes())
    if proto.normalizer_spec.precompiled_charsmap:
        raise GGUFExportError(f"{file} normalizes text ({proto.normalizer_spec.name}), which llama.cpp's "
                              f"SentencePiece tokenizer does not; retrain without --nfkc")
    sp = spm.SentencePieceProcessor(model_file=str(file))
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        if i >= sp.get_piece_size():
            tokens.append(f"[PAD{i}]")
            scores.append(-1000.0)
            types.append(TOKEN_UNUSED)
            continue
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(TOKEN_UNKNOWN if sp.is_unknown(i) else TOKEN_CONTROL if sp.is_control(i)
                     else TOKEN_BYTE if sp.is_byte(i) else TOKEN_UNUSED if sp.is_unused(i)
                     else TOKEN_USER_DEFINED if proto.pieces[i].type == 4 else TOKEN_NORMAL)
    # Trilith's preprocessing encodes SentencePiece text without bos, so llama.cpp adds none either.
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "add_bos": False,
            "add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
            "remove_extra_whitespaces": proto.normalizer_spec.remove_extra_whitespaces}


def write_tokenizer(writer, tokenizer: str, vocab_size: int, eod_token_id: int) -> dict[str, int]:
    file = tokenizer_file(tokenizer)
    vocab = spm_vocab(file, vocab_size) if file.suffix == ".model" else bpe_vocab(file, vocab_size)
    writer.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
        writer.add_add_space_prefix(vocab["add_space_prefix"])
        writer.add_remove_extra_whitespaces(vocab["remove_extra_whitespaces"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    roles = export_roles(file, eod_token_id)
    for role, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                      ("pad_token", writer.add_pad_token_id), ("unk_token", writer.add_unk_token_id)):
        if role in roles:
            add(roles[role][1])
    writer.add_add_bos_token(vocab["add_bos"])
    writer.add_add_eos_token(False)
    config_file = file.parent / CONFIG_FILES[0]
    if file.suffix == ".json" and config_file.is_file():
        template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            writer.add_chat_template(template)
    return {role: token_id for role, (_, token_id) in roles.items()}


def write_gguf(out: Path, model, read, tokenizer: str, eod_token_id: int = -1, dtype: str = "fp32",
               name: str = "trilith") -> dict[str, int]:
    """Write `out` (one .gguf file); `read(name)` gives a global fp32 tensor by Hugging Face-style name.
    Returns the special token ids written."""
    import gguf
    check_model(model)
    qtype = {"fp32": gguf.GGMLQuantizationType.F32, "fp16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16}[dtype]
    file_type = {"fp32": gguf.LlamaFileType.ALL_F32, "fp16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(name)
    writer.add_file_type(file_type)
    write_hparams(writer, model)
    ids = write_tokenizer(writer, tokenizer, model.vocab_size, eod_token_id)
    for tname, tensor in gguf_tensors(model, read).items():
        data = tensor.detach().to(torch.float32).contiguous().numpy()
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:  # llama.cpp keeps norms in f32
            writer.add_tensor(tname, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(tname, data.astype(np.float16))
        else:
            writer.add_tensor(tname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ids
