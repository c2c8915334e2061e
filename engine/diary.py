"""The generation diary (train.diary_prompts): what the model writes, checkpoint by checkpoint.

After each checkpoint save rank 0 loads the weights just saved (at whatever layout they were written) as
one whole model and appends, for every prompt, its greedy continuation (and with train.diary_sample a
sampled one: temperature 0.8, top-p 0.95, seeded by train.seed + step) to run.dir/diary.jsonl:

    {"step": 60, "prompt": "def ", "mode": "greedy", "text": "main():\\n    ..."}

An entry already in the diary for the same (step, prompt, mode) is not written again, so a resumed run
that saves a step again adds no duplicates. Generation is engine/generate.py, as tools/generate.py uses.
The other ranks carry on meanwhile and wait for rank 0 at the next step's collectives.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from data.eod import eod_id_from_tokenizer
from engine.config import ConfigError
from engine.generate import Sampling, generate
from engine.model_source import ModelSource, load_single_model
from engine.text_tokenizer import TextTokenizer

log = logging.getLogger("trilith")
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def read_entries(path: Path) -> list[dict]:
    """The diary's entries; a line cut short by a crash mid-write is skipped."""
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def eod_or_none(tokenizer: str) -> int | None:
    try:
        return eod_id_from_tokenizer(tokenizer)
    except (OSError, ValueError):  # a tokenizer without an end-of-document token: stop at the length limit
        return None


class Diary:
    def __init__(self, cfg, rank: int, device, dtype):
        t = cfg.train
        self.prompts = list(t.diary_prompts) if rank == 0 else []
        self.max_tokens, self.sample, self.seed = t.diary_max_tokens, t.diary_sample, t.seed
        self.path = Path(cfg.run.dir) / "diary.jsonl"
        self.device, self.dtype = device, dtype
        self.tokenizer, self.eod_id = None, None
        if self.prompts:
            try:
                self.tokenizer = TextTokenizer(cfg.data.tokenizer)
            except ValueError as exc:
                raise ConfigError(f"train.diary_prompts: {exc}") from exc
            self.eod_id = cfg.data.eod_token_id if cfg.data.eod_token_id >= 0 else eod_or_none(cfg.data.tokenizer)

    def modes(self, step: int) -> list[tuple[str, Sampling]]:
        greedy = [("greedy", Sampling(self.max_tokens))]
        return greedy + ([("sample", Sampling(self.max_tokens, seed=self.seed + step, **SAMPLED))]
                         if self.sample else [])

    def write(self, step: int, checkpoint: Path, wait=None) -> int:
        """Append the entries of `step` generated from `checkpoint` (once `wait()`, the end of an asynchronous
        save, returns); returns how many were written."""
        if not self.prompts:
            return 0
        if wait is not None:
            wait()
        done = {(e.get("step"), e.get("prompt"), e.get("mode")) for e in read_entries(self.path)}
        todo = [(p, mode, s) for p in self.prompts for mode, s in self.modes(step) if (step, p, mode) not in done]
        if not todo:
            return 0
        source = ModelSource(checkpoint, verify=False)  # written a moment ago by this run
        try:
            model = load_single_model(source, self.device, self.dtype)
        finally:
            source.close()
        with open(self.path, "a", encoding="utf-8") as f:
            for prompt, mode, sampling in todo:
                new = generate(model, self.tokenizer.encode(prompt), sampling, self.eod_id)
                f.write(json.dumps({"step": step, "prompt": prompt, "mode": mode,
                                    "text": self.tokenizer.decode(new)}) + "\n")
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.info(f"diary: {len(todo)} continuation(s) of step {step} in {self.path}")
        return len(todo)
