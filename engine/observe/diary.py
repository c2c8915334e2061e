"""The generation diary (train.diary_prompts): what the model writes, checkpoint by checkpoint.

After each checkpoint save rank 0 loads the weights just saved (at whatever layout they were written) as
one whole model in its host memory and appends, for every prompt, its greedy continuation (and with
train.diary_sample a sampled one: temperature 0.8, top-p 0.95, seeded by train.seed + step) to
run.dir/diary.jsonl:

    {"step": 60, "prompt": "def ", "mode": "greedy", "text": "main():\\n    ..."}

An entry already in the diary for the same (step, prompt, mode) is not written again, so a resumed run
that saves a step again adds no duplicates. Generation is engine/evaluate/generate.py, as tools/generate.py uses.

It runs on the CPU, in a background thread of rank 0, one checkpoint after another: a whole model need not fit
on a training GPU next to the sharded one, and rank 0 goes on training at once instead of holding every peer
in the next collective for as long as loading and generating take (up to the collective timeout). `wait()`
finishes what is queued; the Trainer calls it before the run ends.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from pathlib import Path

import torch

from data.eod import eod_id_or_none
from engine.checkpoint.model_source import ModelSource, load_single_model
from engine.config.schema import ConfigError
from engine.evaluate.generate import Sampling, generate
from engine.evaluate.text_tokenizer import TextTokenizer

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


class Diary:
    def __init__(self, cfg, rank: int, dtype):
        t = cfg.train
        self.prompts = list(t.diary_prompts) if rank == 0 else []
        self.max_tokens, self.sample, self.seed = t.diary_max_tokens, t.diary_sample, t.seed
        self.path = Path(cfg.run.dir) / "diary.jsonl"
        # the host has no fp16 kernels worth using; bf16 keeps the model at half the memory of fp32
        self.dtype = torch.float32 if dtype == torch.float16 else dtype
        self.tokenizer, self.eod_id = None, None
        self.jobs: queue.Queue = queue.Queue()
        self.queued: set = set()  # (step, prompt, mode) handed to the worker, written or not yet
        self.worker: threading.Thread | None = None
        if self.prompts:
            try:
                self.tokenizer = TextTokenizer(cfg.data.tokenizer)
            except ValueError as exc:
                raise ConfigError(f"train.diary_prompts: {exc}") from exc
            # None (no end-of-document token): generation stops at the length limit
            self.eod_id = cfg.data.eod_token_id if cfg.data.eod_token_id >= 0 else eod_id_or_none(cfg.data.tokenizer)

    def modes(self, step: int) -> list[tuple[str, Sampling]]:
        greedy = [("greedy", Sampling(self.max_tokens))]
        return greedy + ([("sample", Sampling(self.max_tokens, seed=self.seed + step, **SAMPLED))]
                         if self.sample else [])

    def write(self, step: int, checkpoint: Path, wait=None) -> int:
        """Queue the entries of `step` to be generated from `checkpoint` (once `wait()`, the end of an asynchronous
        save, returns) on the background worker; returns how many were queued."""
        if not self.prompts:
            return 0
        if wait is not None:
            wait()
        done = {(e.get("step"), e.get("prompt"), e.get("mode")) for e in read_entries(self.path)} | self.queued
        todo = [(p, mode, s) for p in self.prompts for mode, s in self.modes(step) if (step, p, mode) not in done]
        if not todo:
            return 0
        self.queued.update((step, p, mode) for p, mode, _ in todo)
        if self.worker is None:
            self.worker = threading.Thread(target=self._work, name="trilith-diary", daemon=True)
            self.worker.start()
        self.jobs.put((step, checkpoint, todo))
        return len(todo)

    def wait(self) -> None:
        """Block until every queued continuation is written (or given up with a warning)."""
        if self.worker is not None:
            self.jobs.join()

    def _work(self) -> None:
        while True:
            step, checkpoint, todo = self.jobs.get()
            try:
                self._generate(step, checkpoint, todo)
            except Exception as exc:  # the diary only watches the run: say so and let training go on
                log.warning(f"WARNING: diary: the continuations of step {step} were not written "
                            f"({type(exc).__name__}: {exc})")
            finally:
                self.jobs.task_done()

    def _generate(self, step: int, checkpoint: Path, todo: list) -> None:
        source = ModelSource(checkpoint, verify=False)  # written a moment ago by this run
        try:
            model = load_single_model(source, torch.device("cpu"), self.dtype)
        finally:
            source.close()
        with open(self.path, "a", encoding="utf-8") as f:
            for prompt, mode, sampling in todo:
                new = generate(model, self.tokenizer.encode(prompt), sampling, self.eod_id)
                f.write(json.dumps({"step": step, "prompt": prompt, "mode": mode,
                                    "text": self.tokenizer.decode(new)}) + "\n")
        log.info(f"diary: {len(todo)} continuation(s) of step {step} in {self.path}")
