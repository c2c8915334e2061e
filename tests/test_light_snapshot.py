"""Light snapshots (checkpoint.light_interval): bf16 weights only, verified like checkpoints, own retention,
read by evaluate / generate / ckpt_convert --to hf, never resumed from."""
import json
import os

import pytest
import torch

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.manifest import open_verified
from engine.config.schema import load_config
from engine.observe.metrics import MetricsLog
from engine.train import Trainer
from parallel.distributed import DistEnv
from tests.eval_fixtures import CORPUS, VOCAB, make_tokenizer, one_thread  # noqa: F401 (autouse fixture)
from tools import ckpt_convert
from tools import evaluate as evaluate_tool
from tools import generate as generate_tool

TINY = "launch/configs/tiny.yaml"


def run(tmp_path, name, *overrides) -> Trainer:
    tok = tmp_path / "tok" / "tokenizer.json"
    if not tok.is_file():
        make_tokenizer(tmp_path / "tok")
    cfg = load_config(TINY, ["model.num_layers=2", f"model.vocab_size={VOCAB}", "train.steps=4",
                             f"data.tokenizer={tok}", f"run.dir={tmp_path / name}", *overrides])
    (tmp_path / name).mkdir(exist_ok=True)
    trainer = Trainer(cfg, DistEnv())
    trainer.train(MetricsLog(tmp_path / name, enabled=False))
    return trainer


def test_light_snapshot_equals_the_full_checkpoint_of_its_step_in_bf16(tmp_path, capsys):
    run(tmp_path, "full", "checkpoint.interval=2", "checkpoint.keep=5")
    run(tmp_path, "light", "checkpoint.interval=4", "checkpoint.light_interval=1", "checkpoint.light_keep=2")
    light_root = tmp_path / "light" / "light_checkpoints"
    assert sorted(p.name for p in light_root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert sorted(os.listdir(tmp_path / "light" / "checkpoints")) == ["latest", "step_00000004"]  # full at 4
    light, full = light_root / "step_00000002", tmp_path / "full" / "checkpoints" / "step_00000002"
    reader = open_verified(light)  # sizes and SHA-256 of every file, as for full checkpoints
    assert json.loads((light / "metadata.json").read_text())["light"] is True
    assert {e["dtype"] for e in reader.tensors.values()} == {"bfloat16"}
    assert sum(f.stat().st_size for f in light.glob("*.safetensors")) * 5 < \
        sum(f.stat().st_size for f in full.glob("*.safetensors"))  # 2 bytes instead of 3 × 4
    for name, tool_dir in (("light", light), ("full", full)):
        assert ckpt_convert.main(["--to", "hf", "--load-dir", str(tool_dir), "--save-dir",
                                  str(tmp_path / f"hf_{name}")]) == 0
    from safetensors.torch import load_file
    a, b = (load_file(tmp_path / f"hf_{n}" / "model.safetensors") for n in ("light", "full"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k].bfloat16().float()) for k in a)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in sorted(set(CORPUS))))
    got, want = (evaluate_tool.evaluate(str(p), [str(data)])["all"] for p in (light, full))
    assert got["bits_per_byte"] == pytest.approx(want["bits_per_byte"], rel=1e-2) and got != want
    assert generate_tool.main(["--model", str(light_root), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompt"] == "def "


def test_training_never_resumes_from_a_light_snapshot(tmp_path, caplog):
    run(tmp_path, "light", "train.steps=2", "checkpoint.light_interval=1")
    assert (tmp_path / "light" / "light_checkpoints" / "step_00000002").is_dir()
    with caplog.at_level("INFO", logger="trilith"):
        again = Trainer(load_config(TINY, ["model.num_layers=2", f"model.vocab_size={VOCAB}", "train.steps=2",
                                           f"run.dir={tmp_path / 'light'}"]), DistEnv())
    assert again.step == 0  # its light snapshots are not checkpoints to resume from
    assert "light snapshot(s) in" in caplog.text and "resuming uses full checkpoints only" in caplog.text
    snapshot = tmp_path / "light" / "light_checkpoints" / "step_00000002"
    with pytest.raises(CheckpointError, match="is a light snapshot .* training resumes from full checkpoints only"):
        Trainer(load_config(TINY, ["model.num_layers=2", f"model.vocab_size={VOCAB}", f"checkpoint.load={snapshot}",
                                   f"run.dir={tmp_path / 'other'}"]), DistEnv())


def test_damaged_light_snapshot_is_refused_by_its_checksums(tmp_path, capsys):
    run(tmp_path, "light", "train.steps=1", "checkpoint.light_interval=1")
    snapshot = tmp_path / "light" / "light_checkpoints" / "step_00000001"
    shard = next(snapshot.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert ckpt_convert.main(["--to", "hf", "--load-dir", str(snapshot), "--save-dir", str(tmp_path / "hf")]) == 1
    assert "SHA-256 differs from the manifest" in capsys.readouterr().err
