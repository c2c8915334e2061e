"""tools/ckpt_convert.py: Trilith -> Hugging Face (logits parity), HF -> Trilith -> HF (identical tensors),
offline reshard, and clear errors."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine.checkpoint.manifest import CheckpointReader
from tests.helpers import tiny_trainer
from tools.ckpt_convert import main as convert
torch.set_num_threads(1)


def hf_state(directory) -> dict:
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]
    return {k: v for f in files for k, v in load_file(directory / f).items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Trilith run trained 3 steps at TP=1 with a saved checkpoint, plus a tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    run = tmp_path_factory.mktemp("run")
    vocab = {f"t{i}": i for i in range(253)} | {"<s>": 253, "</s>": 254, "<unk>": 255}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(run / "tokenizer.json"))
    t = tiny_trainer(f"run.dir={run}", f"data.tokenizer={run / 'tokenizer.json'}")
    for _ in range(3):
        t.train_step()
    t.save_checkpoint()
    return run, t


def test_export_loads_in_transformers_with_equal_logits(trained, tmp_path):
    run, t = trained
    assert convert(["--load-dir", str(run / "checkpoints"), "--save-dir", str(tmp_path), "--to", "hf",
                    "--max-shard-size", "200KB"]) == 0
    assert (tmp_path / "model.safetensors.index.json").is_file() and (tmp_path / "generation_config.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    model = t.chunks[0].eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, model(tokens), rtol=0, atol=1e-4, check_dtype=False)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("t5 t7")["input_ids"] == [5, 7] and hf.config.eos_token_id == 254


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_to_trilith_to_hf_is_identical_and_trains(tmp_path, tied):
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    source = hf_state(tmp_path / "hf")
    assert convert(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "tri"), "--from", "hf",
                    "--tensor", "2"]) == 0
    reader = CheckpointReader(tmp_path / "tri" / "step_00000000")
    assert reader.metadata["layout"]["tensor"] == 2 and reader.tensors["model.embed_tokens.weight"]["tp_dim"] == 0
    assert ("lm_head.weight" in reader.tensors) != tied
    assert convert(["--load-dir", str(tmp_path / "tri"), "--save-dir", str(tmp_path / "back"), "--to", "hf"]) == 0
    back = hf_state(tmp_path / "back")
    assert sorted(back) == sorted(source)
    assert all(torch.equal(back[k], source[k]) for k in source)
    # continued pretraining from the converted weights, at the layout they were written for (here TP=1 reads TP=2)
    t = tiny_trainer(f"run.dir={tmp_path / 'cont'}", f"checkpoint.load={tmp_path / 'tri'}",
                     f"model.tie_embeddings={str(tied).lower()}")
    assert t.step == 0 and torch.equal(t.chunks[0].model.norm.weight, source["model.norm.weight"])
    assert t.train_step()["loss"] > 0


def test_offline_reshard_preserves_global_tensors(trained, tmp_path):
    run, _ = trained
    assert convert(["--load-dir", str(run / "checkpoints"), "--save-dir", str(tmp_path), "--tensor", "4"]) == 0
    a, b = CheckpointReader(run / "checkpoints" / "step_00000003"), CheckpointReader(tmp_path / "step_00000003")
    assert b.metadata["layout"]["tensor"] == 4 and b.metadata["adam_step"] == 3
    assert len(b.manifest["files"]) == 5
    for name in a.tensors:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.global_tensor(name, key), b.global_tensor(name, key)), (name, key)


def test_clear_errors_for_unsupported_or_mismatched_models(tmp_path, capsys):
    (tmp_path / "gpt").mkdir()
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    (tmp_path / "gpt" / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(SystemExit, match=r"unsupported architecture \['GPT2LMHeadModel'\].*llama, mistral, qwen2"):
        convert(["--load-dir", str(tmp_path / "gpt"), "--save-dir", str(tmp_path / "o"), "--from", "hf"])
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    state = load_file(tmp_path / "llama" / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(40, 32)
    save_file(state, tmp_path / "llama" / "model.safetensors")
    with pytest.raises(SystemExit, match=r"up_proj\.weight: \[40, 32\] vs \[48, 32\]"):
        convert(["--load-dir", str(tmp_path / "llama"), "--save-dir", str(tmp_path / "o"), "--from", "hf"])
    assert convert(["--load-dir", str(tmp_path / "nothing"), "--save-dir", str(tmp_path / "o"), "--to", "hf"]) == 1
    assert "neither a Trilith checkpoint" in capsys.readouterr().err
