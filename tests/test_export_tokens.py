"""Special tokens through import -> train -> export, and tokenizer exports that transformers 5.x and 4.5x
both load (data/offline/hf_tokenizer.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from data.offline.hf_tokenizer import export_tokenizer
from tests._tokenizer_families import TEXTS, build_family
from tests.helpers import ROOT, tiny_trainer
from tools import train_tokenizer
from tools.ckpt_convert import main as convert

TRANSFORMERS4 = "transformers==4.57.1"
PROBES = TEXTS + ["  two  leading spaces", " one", "x\n  y\t z", "Ünïcødé 日本 😀"]
torch.set_num_threads(1)


def tiny_llama(directory, **ids):
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **ids)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)


def test_hf_round_trip_keeps_bos_and_eos(tmp_path):
    tiny_llama(tmp_path / "hf", bos_token_id=1, eos_token_id=2)
    assert convert(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "tri"), "--from", "hf"]) == 0
    assert convert(["--load-dir", str(tmp_path / "tri"), "--save-dir", str(tmp_path / "back"), "--to", "hf"]) == 0
    for name in ("config.json", "generation_config.json"):
        back = json.loads((tmp_path / "back" / name).read_text())
        assert (back["bos_token_id"], back["eos_token_id"]) == (1, 2), name


def test_round_trip_with_tokenizer_keeps_an_eos_list(tmp_path):
    src = build_family("llama3-instruct", tmp_path / "hf", vocab_size=320)
    source = AutoTokenizer.from_pretrained(src)
    stops = [source.convert_tokens_to_ids("<|end_of_text|>"), source.eos_token_id]
    tiny_llama(src, bos_token_id=source.bos_token_id, eos_token_id=stops)
    assert convert(["--load-dir", str(src), "--save-dir", str(tmp_path / "tri"), "--from", "hf"]) == 0
    assert convert(["--load-dir", str(tmp_path / "tri"), "--save-dir", str(tmp_path / "back"), "--to", "hf"]) == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["bos_token_id"], back["eos_token_id"]) == (source.bos_token_id, stops)
    assert AutoTokenizer.from_pretrained(tmp_path / "back").eos_token == "<|eot_id|>"


def test_import_train_export_keeps_the_tokenizer_and_its_roles(tmp_path):
    src = build_family("llama3-instruct", tmp_path / "hf", vocab_size=320)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    source = AutoTokenizer.from_pretrained(src)
    bos, eot, end = source.bos_token_id, source.eos_token_id, source.convert_tokens_to_ids("<|end_of_text|>")
    tiny_llama(src, bos_token_id=bos, eos_token_id=eot)
    assert convert(["--load-dir", str(src), "--save-dir", str(tmp_path / "tri"), "--from", "hf", "--tensor", "2"]) == 0
    for eod, expected in ((-1, eot), (end, end)):
        run = tmp_path / f"run{eod}"
        t = tiny_trainer(f"run.dir={run}", f"checkpoint.load={tmp_path / 'tri'}", "model.vocab_size=320",
                         f"data.tokenizer={src / 'tokenizer.json'}", f"data.eod_token_id={eod}")
        t.train_step()
        t.save_checkpoint()
        out = tmp_path / f"out{eod}"
        assert convert(["--load-dir", str(run / "checkpoints"), "--save-dir", str(out), "--to", "hf"]) == 0
        hf = json.loads((out / "config.json").read_text())
        assert (hf["bos_token_id"], hf["eos_token_id"]) == (bos, expected)
        written = json.loads((out / "tokenizer_config.json").read_text())
        assert written["tokenizer_class"] == "PreTrainedTokenizerFast" and written["chat_template"] == \
            config["chat_template"]
        exported = AutoTokenizer.from_pretrained(out)
        assert exported.eos_token_id == expected and exported.bos_token_id == bos
        assert [exported(t).input_ids for t in PROBES] == [source(t).input_ids for t in PROBES]


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    (d / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 20))
    train_tokenizer.main(["--input", str(d / "c.jsonl"), "--output-dir", str(d / "sp"), "--type", "sp-bpe",
                          "--vocab-size", "400", "--holdout-fraction", "0"])
    return d / "sp" / "tokenizer.model"


def test_sentencepiece_export_is_complete_and_encodes_as_sentencepiece(sentencepiece, tmp_path):
    import sentencepiece as spm
    ids = export_tokenizer(sentencepiece, tmp_path)
    assert ids == {"bos_token_id": None, "eos_token_id": 1, "pad_token_id": 2}
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == \
        (None, "<|endoftext|>", "<|pad|>", "<unk>")
    tok, sp = AutoTokenizer.from_pretrained(tmp_path), spm.SentencePieceProcessor(model_file=str(sentencepiece))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id, len(tok)) == (None, 1, 2, 0, 400)
    assert [tok(t).input_ids for t in PROBES] == [sp.encode(t) for t in PROBES]
    assert tok.decode(sp.encode(PROBES[0])) == PROBES[0]


def test_export_errors_name_the_file_and_fix(tmp_path, capsys):
    tiny_llama(tmp_path / "hf")
    assert convert(["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "tri"), "--from", "hf"]) == 0
    with pytest.raises(SystemExit, match=r"tokenizer .*missing.json does not exist.*pass --tokenizer FILE"):
        convert(["--load-dir", str(tmp_path / "tri"), "--save-dir", str(tmp_path / "o"), "--to", "hf",
                 "--tokenizer", str(tmp_path / "missing.json")])
    build_family("gpt2", tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(SystemExit, match=r"eos_token '<\|nope\|>' is not in tokenizer.json's vocabulary"):
        convert(["--load-dir", str(tmp_path / "tri"), "--save-dir", str(tmp_path / "o"), "--to", "hf",
                 "--tokenizer", str(tmp_path / "tok" / "tokenizer.json")])


def transformers4_python() -> Path:
    """A side virtual environment with transformers 4.57 (no torch: tokenizers and configs only), built once
    under build/; skips only when the package registry cannot be reached."""
    venv = ROOT / "build" / "transformers4-venv"
    python = venv / "bin" / "python"
    if (venv / "ready").is_file():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", TRANSFORMERS4, "sentencepiece", "protobuf"],
                             capture_output=True, text=True, timeout=600)
    if install.returncode:
        probe = subprocess.run([str(python), "-m", "pip", "download", "-q", "--no-deps", "-d", str(venv / "probe"),
                                TRANSFORMERS4], capture_output=True, text=True, timeout=120)
        if probe.returncode:
            pytest.skip(f"package registry unreachable, cannot install {TRANSFORMERS4}: {probe.stderr[-300:]}")
        raise AssertionError(f"installing {TRANSFORMERS4} failed:\n{install.stderr[-2000:]}")
    (venv / "ready").write_text(TRANSFORMERS4)
    return python


READER = """
import json, sys, transformers
from transformers import AutoConfig, AutoTokenizer
out = {"version": transformers.__version__}
for name, path in json.loads(sys.argv[1]).items():
    tok = AutoTokenizer.from_pretrained(path)
    out[name] = {"class": type(tok).__name__, "ids": [tok(t).input_ids for t in json.loads(sys.argv[2])],
                 "special": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id], "size": len(tok)}
    if name == "model":
        config = AutoConfig.from_pretrained(path)
        out[name]["config"] = [config.bos_token_id, config.eos_token_id, config.rope_theta]
print(json.dumps(out))
"""


def test_transformers4_loads_the_exports(sentencepiece, tmp_path):
    python = transformers4_python()
    build_family("qwen2.5-instruct", tmp_path / "qwen", vocab_size=320)
    im_end = AutoTokenizer.from_pretrained(tmp_path / "qwen").eos_token_id
    tiny_llama(tmp_path / "qwen", bos_token_id=None, eos_token_id=im_end, rope_theta=123456.0)
    assert convert(["--load-dir", str(tmp_path / "qwen"), "--save-dir", str(tmp_path / "tri"), "--from", "hf"]) == 0
    assert convert(["--load-dir", str(tmp_path / "tri"), "--save-dir", str(tmp_path / "model"), "--to", "hf"]) == 0
    (tmp_path / "sp").mkdir()
    export_tokenizer(sentencepiece, tmp_path / "sp")
    dirs = {"model": str(tmp_path / "model"), "sp": str(tmp_path / "sp")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(python), "-c", READER, json.dumps(dirs), json.dumps(PROBES)], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    v4 = json.loads(result.stdout.strip().splitlines()[-1])
    assert v4["version"].startswith("4.57")
    for name, path in dirs.items():
        v5 = AutoTokenizer.from_pretrained(path)
        assert v4[name]["class"] == "PreTrainedTokenizerFast"
        assert v4[name]["ids"] == [v5(t).input_ids for t in PROBES], name
        assert v4[name]["special"] == [v5.bos_token_id, v5.eos_token_id, v5.pad_token_id] and v4[name]["size"] == len(v5)
    # transformers 4 reads the special ids and the top-level rope_theta (not its 10000 default)
    assert v4["model"]["config"] == [None, im_end, 123456.0] and v4["model"]["special"][1] == im_end
