"""Generation (engine/evaluate/generate.py, tools/generate.py) and the generation diary (engine/observe/diary.py)."""
import json
from types import SimpleNamespace

import pytest
import torch

from engine.config.schema import ConfigError, ModelConfig, load_config, validate
from engine.evaluate.generate import Sampling, generate
from engine.model import CausalLM
from engine.observe.diary import read_entries
from engine.observe.metrics import MetricsLog
from engine.train import Trainer
from parallel.distributed import DistEnv
from tests.eval_fixtures import VOCAB, make_tokenizer, one_thread  # noqa: F401 (autouse fixture)
from tools import generate as generate_tool

TINY = "launch/configs/tiny.yaml"


def tiny_model(**fields) -> CausalLM:
    cfg = ModelConfig(**{"hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2,
                         "ffn_hidden_size": 128, "vocab_size": 97, "seq_length": 48, **fields})
    model = CausalLM(cfg)
    model.init_weights(7)
    with torch.no_grad():  # weights wide enough that the logits are far from uniform: ties cannot hide a bug
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    return model.eval()


@pytest.mark.parametrize("fields", [{}, {"position_embedding": "alibi"}, {"attention_window": 5},
                                    {"num_kv_heads": 1, "attention_bias": True}],
                         ids=["rope-gqa", "alibi", "sliding-window", "mqa-bias"])
def test_kv_cache_gives_the_same_tokens_as_recomputing(fields):
    model = tiny_model(**fields)
    for sampling in (Sampling(30), Sampling(30, temperature=1.0, top_p=0.9, seed=5)):
        cached = generate(model, [3, 14, 15, 92], sampling)
        plain = generate(model, [3, 14, 15, 92], sampling, use_cache=False)
        assert len(cached) == 30 and cached == plain
    assert len(set(generate(model, [3, 14], Sampling(30, temperature=1.0, seed=s))[0] for s in range(8))) > 1


def test_cached_logits_equal_the_full_forward():
    from engine.evaluate.generate import forward_cached
    from kernels.rope import rope_cos_sin
    model = tiny_model()
    tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    full = model.full_logits(model(tokens))
    rope = rope_cos_sin(48, model.cfg.head_dim, model.cfg.rope_theta)
    caches: dict = {}
    pieces = [forward_cached(model, tokens[:, :12], 0, caches, rope)]
    pieces += [forward_cached(model, tokens[:, i:i + 1], i, caches, rope) for i in range(12, 20)]
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=1e-5)


def test_stops_at_end_of_document_length_and_top_p():
    model = tiny_model()
    greedy = generate(model, [1, 2, 3], Sampling(10))
    assert generate(model, [1, 2, 3], Sampling(10), eod_id=greedy[2]) == greedy[:2]
    assert len(generate(model, [1, 2, 3], Sampling(100), max_length=8)) == 5  # 3 + 5 positions
    # a top-p so small that only the most likely token survives: sampling is greedy
    assert generate(model, [1, 2, 3], Sampling(10, temperature=2.0, top_p=1e-6, seed=1)) == greedy
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [1], Sampling(4, temperature=1.0, top_p=0.0))
    with pytest.raises(ValueError, match="limit is 48"):
        generate(model, list(range(48)), Sampling(4))


def diary_run(tmp_path, *overrides):
    tokenizer = make_tokenizer(tmp_path / "tok")
    cfg = load_config(TINY, ["model.num_layers=2", f"model.vocab_size={VOCAB}", "train.steps=4",
                             f"data.tokenizer={tokenizer}", "train.diary_prompts=[\"def \", \"import\"]",
                             "train.diary_max_tokens=6", "train.diary_sample=true", "checkpoint.interval=2",
                             f"run.dir={tmp_path / 'run'}", *overrides])
    validate(cfg, 1)
    (tmp_path / "run").mkdir(exist_ok=True)
    trainer = Trainer(cfg, DistEnv())
    trainer.train(MetricsLog(tmp_path / "run", enabled=False))
    return trainer


def test_diary_written_at_each_save_and_resume_adds_no_duplicates(tmp_path, capsys):
    diary_run(tmp_path, "checkpoint.exit_after=2")  # stops after the save of step 2, as if preempted
    first = read_entries(tmp_path / "run" / "diary.jsonl")
    assert [(e["step"], e["prompt"], e["mode"]) for e in first] == [
        (2, "def ", "greedy"), (2, "def ", "sample"), (2, "import", "greedy"), (2, "import", "sample")]
    trainer = diary_run(tmp_path)  # resumes from step 2, saves step 4
    entries = read_entries(tmp_path / "run" / "diary.jsonl")
    keys = [(e["step"], e["prompt"], e["mode"]) for e in entries]
    assert len(keys) == len(set(keys)) == 8 and {k[0] for k in keys} == {2, 4}
    assert entries[:4] == first
    assert trainer.diary.write(4, tmp_path / "run" / "checkpoints" / "step_00000004") == 0  # saved again
    # the diary's greedy text is what tools/generate.py writes for that checkpoint
    assert generate_tool.main(["--model", str(tmp_path / "run" / "checkpoints"), "--prompt", "def ",
                               "--max-new-tokens", "6"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["text"] == next(e["text"] for e in entries if e["step"] == 4 and e["prompt"] == "def "
                                   and e["mode"] == "greedy")


def test_diary_and_generate_refuse_bad_input_in_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match="need data.tokenizer"):
        validate(load_config(TINY, ["train.diary_prompts=[hi]"]), 1)
    assert generate_tool.main(["--model", str(tmp_path), "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("generate: ") and "neither a Trilith checkpoint" in err and "\n" not in err


def test_the_diary_generates_on_the_host_in_the_background(tmp_path, monkeypatch):
    """Rank 0 hands the save's continuations to a worker and trains on: its peers never wait in a collective
    for the generation, and the whole model goes to host memory, not next to the sharded one on the GPU."""
    import threading

    from engine.observe import diary as diary_module
    tokenizer = make_tokenizer(tmp_path / "tok")
    cfg = load_config(TINY, [f"model.vocab_size={VOCAB}", f"data.tokenizer={tokenizer}",
                             f"run.dir={tmp_path / 'run'}", "train.diary_prompts=[\"def \"]", "train.diary_max_tokens=3"])
    (tmp_path / "run").mkdir()
    release, loaded_on = threading.Event(), []

    def load_slowly(source, device, dtype):
        loaded_on.append((device, threading.current_thread().name))
        release.wait(30)  # a big model still loading
        return tiny_model(vocab_size=VOCAB)

    monkeypatch.setattr(diary_module, "load_single_model", load_slowly)
    monkeypatch.setattr(diary_module, "ModelSource", lambda path, verify: SimpleNamespace(close=lambda: None))
    diary = diary_module.Diary(cfg, 0, torch.bfloat16)
    assert diary.write(2, tmp_path / "checkpoint") == 1  # returns while the model is still loading
    assert diary.write(2, tmp_path / "checkpoint") == 0  # queued already: not again
    assert read_entries(diary.path) == []
    release.set()
    diary.wait()
    assert loaded_on == [(torch.device("cpu"), "trilith-diary")]
    assert [(e["step"], e["prompt"], e["mode"]) for e in read_entries(diary.path)] == [(2, "def ", "greedy")]
