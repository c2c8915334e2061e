"""tools/train_tokenizer.py and tools/stdlib_corpus.py smoke tests."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import stdlib_corpus, train_tokenizer  # noqa: E402


def test_stdlib_corpus_is_sorted_and_deterministic(tmp_path):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    stdlib_corpus.main(["--output", a, "--limit", "20"])
    stdlib_corpus.main(["--output", b, "--limit", "20"])
    assert open(a, "rb").read() == open(b, "rb").read()
    paths = [json.loads(line)["path"] for line in open(a)]
    assert paths == sorted(paths) and all(p.endswith(".py") and "site-packages" not in p for p in paths)


def test_bpe_training_reports_compression_and_reserves_specials(tmp_path, capsys):
    corpus = str(tmp_path / "c.jsonl")
    stdlib_corpus.main(["--output", corpus, "--limit", "60"])
    out = tmp_path / "tok"
    train_tokenizer.main(["--input", corpus, "--output-dir", str(out), "--vocab-size", "600",
                          "--reserved-tokens", "4", "--holdout-fraction", "0.2", "--nfkc",
                          "--strip-control", "--source-weights", "*.jsonl=0.5"])
    report = json.load(open(out / "report.json"))
    assert report["holdout_documents"] > 0 and report["unknown_token_rate"] == 0
    assert report["bytes_per_token"] > 1.5  # merges learned: better than one byte per token
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ["<|endoftext|>", "<|pad|>", "<|reserved_3|>"]] == [0, 1, 5]
    declared = json.load(open(out / "tokenizer_config.json"))  # roles declared, not guessed from names later
    assert (declared["bos_token"], declared["eos_token"], declared["pad_token"]) == (None, "<|endoftext|>", "<|pad|>")
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(out)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (None, 0, 1)
    assert tok.encode("x\x07y").ids == tok.encode("xy").ids  # control character stripped
    assert "bytes/token" in capsys.readouterr().out


def test_token_hit_rate_of_domain_terms(tmp_path, capsys):
    corpus = str(tmp_path / "c.jsonl")
    stdlib_corpus.main(["--output", corpus, "--limit", "60"])
    terms = tmp_path / "terms.txt"
    terms.write_text("# frequent in the standard library, so merged into one token\nself\nreturn\nimport\n\n"
                     "Xylophonically\n")
    out = tmp_path / "tok"
    train_tokenizer.main(["--input", corpus, "--output-dir", str(out), "--vocab-size", "2000",
                          "--hit-terms", str(terms)])
    report = json.load(open(out / "report.json"))
    assert report["hit_terms"] == 4 and report["token_hit_rate"] == 0.75
    assert [m["term"] for m in report["term_misses"]] == ["Xylophonically"] and report["term_misses"][0]["tokens"] > 1
    assert "token hit rate: 75.0% of 4 terms are one token; split: 'Xylophonically'" in capsys.readouterr().out
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(SystemExit) as exc:
        train_tokenizer.main(["--input", corpus, "--output-dir", str(out), "--hit-terms", str(tmp_path / "empty.txt")])
    assert exc.value.code == 2 and "holds no terms" in capsys.readouterr().err
