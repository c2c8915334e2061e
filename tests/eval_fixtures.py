"""Shared pieces of the evaluation tests: a small byte-level BPE tokenizer.json (made in-process, no
download), a tiny multiple-choice task, and lm-evaluation-harness in a side environment."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
          "import os\nimport sys\n", "class Point:\n    def __init__(self, x):\n        self.x = x\n",
          "héllo wörld, ça va? 日本語"] * 4
VOCAB = 320  # ≥ the tokenizer's 256 bytes + merges + <|endoftext|>

TASK = [{"context": "def add(a, b):\n    return a", "choices": ["+ b", "* b", "if"], "gold": 0},
        {"context": "for i in", "choices": ["range(10):", "class", "sys"], "gold": 0},
        {"context": "import ", "choices": ["os", "print(i)", "return a + b"], "gold": 0},
        {"context": "class Point: ", "choices": ["def __init__", "x", "ça"], "gold": 1}]


def make_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def write_task(path: Path, items=TASK) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared machine: one intra-op thread is faster than many competing for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lm_eval_python() -> Path:
    """build/lm-eval-venv: lm-evaluation-harness (with accelerate) over this checkout's packages, made once."""
    venv = ROOT / "build" / "lm-eval-venv"
    python = venv / "bin" / "python"
    if (venv / "ready").is_file():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
    site = next(p for p in sys.path if p.endswith("site-packages"))
    (venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" /
     "checkout.pth").write_text(site + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "lm_eval==0.4.13",
                              "accelerate"], capture_output=True, text=True)
    if install.returncode:
        probe = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(venv / "probe"),
                                "lm_eval==0.4.13"], capture_output=True, text=True)
        if probe.returncode:
            pytest.skip(f"the package registry is unreachable, so lm-evaluation-harness cannot be installed: "
                        f"{probe.stderr.strip()[-200:]}")
        raise AssertionError(f"installing lm-evaluation-harness failed: {install.stderr[-2000:]}")
    (venv / "ready").write_text("lm_eval==0.4.13\n")
    return python
