"""`ckpt_convert --to gguf` (engine/checkpoint/gguf_export.py): llama.cpp's metadata and tensor names, read back with
gguf's own reader; a reference forward of the GGUF weights equals the original model's logits; the q/k
row permutation makes llama.cpp's adjacent-pair rotation compute the same attention scores."""
import json

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.checkpoint.gguf_export import llama3_rope_factors, permute_rotary
from tests._tokenizer_families import build_family
from tools.ckpt_convert import main as convert

torch.set_num_threads(1)
VOCAB = 320
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=50000.0)


def hf_model(tmp_path, family="gpt2", tokenizer_vocab=300, arch=(LlamaConfig, LlamaForCausalLM), **overrides):
    """A random HF model saved with a tokenizer of `family`, imported into Trilith; returns (model, ckpt)."""
    torch.manual_seed(0)
    model = arch[1](arch[0](**(SHAPE | overrides))).eval()
    src = tmp_path / "hf"
    model.save_pretrained(src)
    build_family(family, src, vocab_size=tokenizer_vocab)
    assert convert(["--load-dir", str(src), "--save-dir", str(tmp_path / "tri"), "--from", "hf", "--tensor", "2"]) == 0
    return model, tmp_path / "tri"


def read_gguf(path):
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    fields = {}
    for name, field in reader.fields.items():
        if not field.types or name.startswith("GGUF."):
            continue
        fields[name] = field.contents()
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def unpermute(w, heads):
    """The inverse of llama.cpp's permutation, written from its definition (rows 2i, 2i+1 <- i, i + d/2)."""
    d = w.shape[0] // heads
    out = torch.empty_like(w)
    for h in range(heads):
        block = w[h * d:(h + 1) * d]
        out[h * d:h * d + d // 2] = block[0::2]
        out[h * d + d // 2:(h + 1) * d] = block[1::2]
    return out


def reference_from_gguf(fields, tensors):
    """A transformers LlamaForCausalLM built only from what the GGUF file holds."""
    config = LlamaConfig(vocab_size=len(fields["tokenizer.ggml.tokens"]), hidden_size=fields["llama.embedding_length"],
                         intermediate_size=fields["llama.feed_forward_length"],
                         num_hidden_layers=fields["llama.block_count"],
                         num_attention_heads=fields["llama.attention.head_count"],
                         num_key_value_heads=fields["llama.attention.head_count_kv"],
                         max_position_embeddings=fields["llama.context_length"],
                         rms_norm_eps=fields["llama.attention.layer_norm_rms_epsilon"],
                         rope_theta=fields["llama.rope.freq_base"], tie_word_embeddings="output.weight" not in tensors,
                         head_dim=fields.get("llama.attention.key_length", fields["llama.rope.dimension_count"]))
    heads, kv = config.num_attention_heads, config.num_key_value_heads

    def get(name):
        return torch.from_numpy(np.array(tensors[name].data, dtype=np.float32))

    state = {"model.embed_tokens.weight": get("token_embd.weight"), "model.norm.weight": get("output_norm.weight")}
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        state |= {p + "self_attn.q_proj.weight": unpermute(get(b + "attn_q.weight"), heads),
                  p + "self_attn.k_proj.weight": unpermute(get(b + "attn_k.weight"), kv),
                  p + "self_attn.v_proj.weight": get(b + "attn_v.weight"),
                  p + "self_attn.o_proj.weight": get(b + "attn_output.weight"),
                  p + "input_layernorm.weight": get(b + "attn_norm.weight"),
                  p + "post_attention_layernorm.weight": get(b + "ffn_norm.weight"),
                  p + "mlp.gate_proj.weight": get(b + "ffn_gate.weight"),
                  p + "mlp.up_proj.weight": get(b + "ffn_up.weight"),
                  p + "mlp.down_proj.weight": get(b + "ffn_down.weight")}
    if "output.weight" in tensors:
        state["lm_head.weight"] = get("output.weight")
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def test_explicit_head_dim_is_written_and_computes_the_same(tmp_path):
    model, tri = hf_model(tmp_path, head_dim=32)  # 4 heads of 32 in a 64-wide model
    assert convert(["--load-dir", str(tri), "--save-dir", str(tmp_path / "out.gguf"), "--to", "gguf"]) == 0
    fields, tensors = read_gguf(tmp_path / "out.gguf")
    assert (fields["llama.attention.key_length"], fields["llama.attention.value_length"],
            fields["llama.rope.dimension_count"]) == (32, 32, 32)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(reference_from_gguf(fields, tensors)(input_ids=ids).logits,
                                   model(input_ids=ids).logits, rtol=0, atol=1e-5, check_dtype=False)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_metadata_and_reference_forward(tmp_path, tied):
    from tokenizers import Tokenizer
    model, tri = hf_model(tmp_path, tie_word_embeddings=tied)
    tok_file = tmp_path / "hf" / "tokenizer.json"
    assert convert(["--load-dir", str(tri), "--save-dir", str(tmp_path / "out.gguf"), "--to", "gguf"]) == 0
    fields, tensors = read_gguf(tmp_path / "out.gguf")
    expected = {"general.architecture": "llama", "llama.context_length": 64, "llama.embedding_length": 64,
                "llama.block_count": 2, "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
                "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 50000.0,
                "llama.rope.dimension_count": 16, "llama.vocab_size": VOCAB, "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.add_bos_token": False}
    assert {k: fields.get(k) for k in expected} == pytest.approx(expected)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    tok = Tokenizer.from_file(str(tok_file))
    eot = tok.token_to_id("<|endoftext|>")  # the gpt2 family's eos, bos and unk
    assert (fields["tokenizer.ggml.eos_token_id"], fields["tokenizer.ggml.bos_token_id"]) == (eot, eot)
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == VOCAB and tokens[:300] == [tok.id_to_token(i) for i in range(300)]
    assert tokens[300:] == [f"[PAD{i}]" for i in range(300, VOCAB)] and set(types[300:]) == {5}
    assert types[eot] == 3 and types[eot + 1] == 1
    merges = json.loads(tok_file.read_text())["model"]["merges"]
    assert fields["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in merges]
    names = {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{n}.weight" for i in range(2) for n in (
        "attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(tensors) == names | (set() if tied else {"output.weight"})
    assert list(tensors["blk.0.attn_k.weight"].data.shape) == [32, 64]  # numpy order: rows = kv heads × 16
    reference = reference_from_gguf(fields, tensors)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reference(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5,
                                   check_dtype=False)


def rotate_half_rope(x, theta):
    """Hugging Face / Trilith: element i pairs with i + d/2."""
    d = x.shape[-1]
    freqs = torch.outer(torch.arange(x.shape[-2], dtype=torch.float64), theta ** (-torch.arange(0, d, 2) / d))
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def adjacent_pair_rope(x, theta):
    """llama.cpp's `llama` rope: element 2i pairs with 2i + 1."""
    d = x.shape[-1]
    freqs = torch.outer(torch.arange(x.shape[-2], dtype=torch.float64), theta ** (-torch.arange(0, d, 2) / d))
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * freqs.cos() - odd * freqs.sin()
    out[..., 1::2] = even * freqs.sin() + odd * freqs.cos()
    return out


def test_permutation_makes_adjacent_pair_rope_equal_to_rotate_half():
    heads, kv, d, hidden, seq, theta = 4, 2, 16, 32, 7, 10000.0
    g = torch.Generator().manual_seed(0)
    wq, wk = torch.randn(heads * d, hidden, generator=g, dtype=torch.float64), torch.randn(
        kv * d, hidden, generator=g, dtype=torch.float64)
    x = torch.randn(seq, hidden, generator=g, dtype=torch.float64)

    def scores(wq, wk, rope):
        q = rope((x @ wq.T).reshape(seq, heads, d).transpose(0, 1), theta)
        k = rope((x @ wk.T).reshape(seq, kv, d).transpose(0, 1), theta).repeat_interleave(heads // kv, 0)
        return q @ k.transpose(1, 2)

    hf = scores(wq, wk, rotate_half_rope)
    assert torch.allclose(scores(permute_rotary(wq, heads), permute_rotary(wk, kv), adjacent_pair_rope), hf,
                          atol=1e-10)
    assert not torch.allclose(scores(wq, wk, adjacent_pair_rope), hf, atol=1e-3)  # unpermuted: wrong


def test_llama3_rope_factors_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from engine.config.schema import ModelConfig
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    model = ModelConfig(hidden_size=2048, num_attention_heads=32, num_kv_heads=8, rope_theta=500000.0,
                        rope_scaling=scaling, seq_length=256)
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_theta=500000.0, rope_scaling=dict(scaling),
                         max_position_embeddings=131072)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(base / llama3_rope_factors(model), inv_freq.double().numpy(), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_keeps_norms_in_fp32(tmp_path, dtype):
    from gguf import GGMLQuantizationType
    _, tri = hf_model(tmp_path)
    assert convert(["--load-dir", str(tri), "--save-dir", str(tmp_path / "g"), "--to", "gguf", "--dtype", dtype]) == 0
    _, tensors = read_gguf(tmp_path / "g" / "model.gguf")
    kind = GGMLQuantizationType.F16 if dtype == "fp16" else GGMLQuantizationType.BF16
    assert tensors["blk.0.attn_q.weight"].tensor_type == kind
    assert tensors["blk.0.attn_norm.weight"].tensor_type == GGMLQuantizationType.F32


def test_llama3_style_trained_bpe_and_sentencepiece_tokenizers(tmp_path):
    _, tri = hf_model(tmp_path, family="llama3-instruct")
    assert convert(["--load-dir", str(tri), "--save-dir", str(tmp_path / "l3.gguf"), "--to", "gguf"]) == 0
    fields, _ = read_gguf(tmp_path / "l3.gguf")
    tokens = fields["tokenizer.ggml.tokens"]
    assert fields["tokenizer.ggml.pre"] == "llama-bpe" and fields["tokenizer.ggml.add_bos_token"] is True
    assert tokens[fields["tokenizer.ggml.eos_token_id"]] == "<|eot_id|>"
    assert tokens[fields["tokenizer.ggml.bos_token_id"]] == "<|begin_of_text|>"
    import sentencepiece as spm
    from tools import train_tokenizer
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of some text, def f(x): return {i}"}) + "\n"
                              for i in range(200)))
    train_tokenizer.main(["--input", str(corpus), "--output-dir", str(tmp_path / "sp"), "--type", "sp-bpe",
                          "--vocab-size", "300", "--holdout-fraction", "0"])
    train_tokenizer.main(["--input", str(corpus), "--output-dir", str(tmp_path / "bpe"), "--vocab-size", "300",
                          "--holdout-fraction", "0"])  # what the demo trains
    assert convert(["--load-dir", str(tri), "--save-dir", str(tmp_path / "bpe.gguf"), "--to", "gguf",
                    "--tokenizer", str(tmp_path / "bpe" / "tokenizer.json")]) == 0
    fields, _ = read_gguf(tmp_path / "bpe.gguf")
    assert (fields["tokenizer.ggml.pre"], fields["tokenizer.ggml.eos_token_id"],
            fields["tokenizer.ggml.padding_token_id"]) == ("gpt-2", 0, 1)
    model = str(tmp_path / "sp" / "tokenizer.model")
    assert convert(["--load-dir", str(tri), "--save-dir", str(tmp_path / "sp.gguf"), "--to", "gguf",
                    "--tokenizer", model]) == 0
    fields, _ = read_gguf(tmp_path / "sp.gguf")
    sp = spm.SentencePieceProcessor(model_file=model)
    assert fields["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.pre" not in fields
    assert fields["tokenizer.ggml.tokens"][:300] == [sp.id_to_piece(i) for i in range(300)]
    assert fields["tokenizer.ggml.scores"][5] == pytest.approx(sp.get_score(5))
    assert (fields["tokenizer.ggml.eos_token_id"], fields["tokenizer.ggml.padding_token_id"]) == (1, 2)
    assert "tokenizer.ggml.bos_token_id" not in fields and fields["tokenizer.ggml.token_type"][0] == 2


def test_refusals_are_one_clear_line(tmp_path, capsys):
    _, tri = hf_model(tmp_path)
    with pytest.raises(SystemExit, match="needs a tokenizer"):
        convert(["--load-dir", str(tri), "--save-dir", str(tmp_path / "x"), "--to", "gguf", "--tokenizer", ""])
    from tokenizers import Tokenizer, normalizers
    tok = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    tok.normalizer = normalizers.NFKC()
    (tmp_path / "nfkc").mkdir()
    tok.save(str(tmp_path / "nfkc" / "tokenizer.json"))
    with pytest.raises(SystemExit, match="has a normalizer .NFKC., which llama.cpp's BPE tokenizer does not apply"):
        convert(["--load-dir", str(tri), "--save-dir", str(tmp_path / "x"), "--to", "gguf",
                 "--tokenizer", str(tmp_path / "nfkc" / "tokenizer.json")])
    from transformers import Qwen2Config, Qwen2ForCausalLM
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    _, tri_bias = hf_model(qwen, arch=(Qwen2Config, Qwen2ForCausalLM))
    with pytest.raises(SystemExit, match="lacks model.attention_bias=true"):
        convert(["--load-dir", str(tri_bias), "--save-dir", str(tmp_path / "x"), "--to", "gguf"])
