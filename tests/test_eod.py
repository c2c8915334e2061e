"""One definition of the end of document (data/eod.py): preprocessing appends what Megatron-LM appends
(its Hugging Face tokenizer's eos_token_id) for every tokenizer family, and training reads the same id."""
import json

import numpy as np
import pytest

from data.eod import eod_id_from_tokenizer, special_tokens
from engine.config.schema import ConfigError, load_config
from engine.train import resolve_eod_id as train_eod_id
from tests._tokenizer_families import FAMILIES, TEXTS, build_family
from tools import preprocess_data

EXPECTED_EOD = {"llama3-instruct": "<|eot_id|>", "qwen2.5-instruct": "<|im_end|>", "smollm2-instruct": "<|im_end|>",
                "gpt2": "<|endoftext|>"}


def write_corpus(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def preprocess(tmp_path, *args):
    prefix = str(tmp_path / "out")
    preprocess_data.main(["--input", write_corpus(tmp_path / "c.jsonl", TEXTS), "--output-prefix", prefix,
                          "--quiet", "--append-eod", *args])
    return prefix + "_text_document"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shards_are_what_megatron_writes(tmp_path, family):
    """Megatron-LM's preprocess writes, per document, AutoTokenizer(text).input_ids + [eos_token_id] as uint16."""
    from transformers import AutoTokenizer
    directory = build_family(family, tmp_path / "tok")
    reference = AutoTokenizer.from_pretrained(directory)
    assert reference.convert_ids_to_tokens(reference.eos_token_id) == EXPECTED_EOD[family]
    expected = [i for t in TEXTS for i in reference(t).input_ids + [reference.eos_token_id]]
    path = preprocess(tmp_path, "--tokenizer-model", str(directory / "tokenizer.json"))
    assert open(path + ".bin", "rb").read() == np.asarray(expected, np.uint16).tobytes()
    # training's end-of-document id is the same token
    cfg = load_config("launch/configs/tiny.yaml", ["data.eod_mask_loss=true", f"data.tokenizer={directory}"])
    assert train_eod_id(cfg) == reference.eos_token_id


def test_gpt2_vocab_and_merges_end_with_endoftext(tmp_path):
    from tokenizers import Tokenizer
    directory = build_family("gpt2", tmp_path / "tok")
    model = json.loads((directory / "tokenizer.json").read_text())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(model["vocab"]))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(
        (m if isinstance(m, str) else " ".join(m)) + "\n" for m in model["merges"]))
    path = preprocess(tmp_path, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"),
                      "--merge-file", str(tmp_path / "merges.txt"))
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    expected = [i for t in TEXTS for i in tok.encode(t).ids + [tok.token_to_id("<|endoftext|>")]]
    assert np.fromfile(path + ".bin", np.uint16).tolist() == expected


def test_eod_token_option_and_config_override_the_tokenizer(tmp_path):
    directory = build_family("llama3-instruct", tmp_path / "tok")
    eot = special_tokens(directory)["eos_token"][1]
    path = preprocess(tmp_path, "--tokenizer-model", str(directory), "--eod-token", "<|end_of_text|>")
    from tokenizers import Tokenizer
    end_of_text = Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id("<|end_of_text|>")
    assert np.fromfile(path + ".bin", np.uint16)[-1] == end_of_text != eot
    path = preprocess(tmp_path, "--tokenizer-model", str(directory), "--eod-token", "7")
    assert np.fromfile(path + ".bin", np.uint16)[-1] == 7
    assert eod_id_from_tokenizer(directory) == eot
    cfg = load_config("launch/configs/tiny.yaml", ["data.eod_mask_loss=true", f"data.tokenizer={directory}",
                                                   "data.eod_token_id=9"])
    assert train_eod_id(cfg) == 9


def test_bare_tokenizer_json_falls_back_to_names_and_declared_roles_win(tmp_path):
    from tokenizers import Tokenizer, models
    vocab = {"a": 0, "</s>": 1, "<|endoftext|>": 2, "<|im_end|>": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    assert eod_id_from_tokenizer(tmp_path / "tokenizer.json") == 2  # FALLBACK_NAMES order, one list
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert eod_id_from_tokenizer(tmp_path / "tokenizer.json") == 3
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert eod_id_from_tokenizer(tmp_path / "tokenizer.json") == 1


@pytest.mark.parametrize("config, message", [
    ({"eos_token": None}, "declares no eos_token; add one"),
    ({"eos_token": "<|nope|>"}, r"eos_token '<\|nope\|>' is not in tokenizer.json's vocabulary"),
])
def test_bad_or_missing_eos_is_one_clear_error(tmp_path, capsys, config, message):
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        eod_id_from_tokenizer(tmp_path)
    with pytest.raises(SystemExit) as exc:
        preprocess(tmp_path, "--tokenizer-model", str(tmp_path))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--append-eod: " in err and "Traceback" not in err
    with pytest.raises(ConfigError, match=message):
        train_eod_id(load_config("launch/configs/tiny.yaml", ["data.eod_mask_loss=true",
                                                              f"data.tokenizer={tmp_path}"]))


def test_eod_token_outside_the_vocabulary_is_refused(tmp_path, capsys):
    directory = build_family("gpt2", tmp_path / "tok")
    for bad in ("<|nope|>", "99999"):
        with pytest.raises(SystemExit):
            preprocess(tmp_path, "--tokenizer-model", str(directory), "--eod-token", bad)
        assert "not in the tokenizer's vocabulary" in capsys.readouterr().err
