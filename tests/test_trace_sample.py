"""tools/trace_sample.py: a training sample of a real (tiny) run traced to its raw record and line."""
import json

from engine.config.schema import load_config, save_config
from tests.helpers import run_tool


def run(*args, check=True):
    done = run_tool(*args)
    if check:
        done.check_returncode()
    return done


def test_a_sample_is_traced_to_its_raw_line_and_text(tmp_path):
    run("tools/stdlib_corpus.py", "--output", tmp_path / "c.jsonl", "--limit", "30")
    run("tools/train_tokenizer.py", "--input", tmp_path / "c.jsonl", "--output-dir", tmp_path / "tok",
        "--vocab-size", "512")
    run("tools/preprocess_data.py", "--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "d",
        "--tokenizer-model", tmp_path / "tok" / "tokenizer.json", "--append-eod", "--workers", "1")
    cfg = load_config("launch/configs/tiny.yaml", ["data.mock=false", f"data.paths=[{tmp_path / 'd_text_document'}]",
                                                   f"data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}",
                                                   "model.vocab_size=512", f"run.dir={tmp_path / 'run'}"])
    (tmp_path / "run").mkdir()
    save_config(cfg, tmp_path / "run" / "config.yaml")
    done = run("tools/trace_sample.py", "--run-dir", tmp_path / "run", "--step", "2", "--json")
    samples = [json.loads(line) for line in done.stdout.splitlines()]
    assert [s["sample"] for s in samples] == list(range(8, 16))  # tiny.yaml: global batch 8
    raw = (tmp_path / "c.jsonl").read_text().splitlines()
    for s in samples:
        for piece in s["pieces"]:
            record = json.loads(raw[piece["line"] - 1])
            assert piece["source_file"] == str(tmp_path / "c.jsonl") and piece["source_name"] == record["path"]
            assert record["text"].startswith(piece["source_text"])
        if len(s["pieces"]) == 1:  # inside one document: the decoded sample is a slice of the raw text
            assert s["text"] in json.loads(raw[s["pieces"][0]["line"] - 1])["text"]
    assert any(len(s["pieces"]) == 1 for s in samples)
    ramped = tmp_path / "ramped"
    ramped.mkdir()
    cfg.train.batch_size_ramp = [2, 2, 24]  # batches 2, 2, 2, 2, then 4: step 5 reads samples 8-11
    save_config(cfg, ramped / "config.yaml")
    done = run("tools/trace_sample.py", "--run-dir", ramped, "--step", "5", "--json")
    assert [json.loads(line)["sample"] for line in done.stdout.splitlines()] == [8, 9, 10, 11]
    readable = run("tools/trace_sample.py", "--run-dir", tmp_path / "run", "--sample", "3").stdout
    assert readable.startswith("sample 3 (33 tokens)") and "line" in readable and "as trained:" in readable
    missing = run("tools/trace_sample.py", "--run-dir", tmp_path / "nowhere", "--sample", "1", check=False)
    assert missing.returncode == 1 and "config.yaml" in missing.stderr
