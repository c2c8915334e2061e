"""Zero-shot multiple-choice tasks inside the run (train.eval_tasks), scored as lm-evaluation-harness
scores its `multiple_choice` tasks on a causal model:

- a task file is JSONL, one item per line: {"context": str, "choices": [str, ...], "gold": int};
- choice i is the continuation target_delimiter + choices[i] of the context; the pair is split into
  tokens as lm-eval's `_encode_pair` does (trailing spaces of the context move to the continuation, the
  whole string is encoded, and the continuation is what follows the context's own encoding), each string
  encoded as its Hugging Face backend does (TextTokenizer.encode_as_harness: the tokenizer's own special
  tokens);
- a request longer than train.eval_window + 1 tokens keeps its last ones, as lm-eval truncates to its
  max_length, and costs only its own length, not the window's;
- its log-likelihood is the sum over the continuation's tokens (engine/evaluate/scoring.py);
- acc: the most likely choice is the gold one; acc_norm: the same after dividing each log-likelihood by
  the choice's length in characters (lm-eval's `completion_len`; equal to the byte length for ASCII).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from data.eod import eod_id_or_none
from engine.config.schema import ConfigError
from engine.evaluate.scoring import Scorer
from engine.evaluate.text_tokenizer import TextTokenizer
from parallel.p2p import PipelineComm

TARGET_DELIMITER = " "
log = logging.getLogger("trilith")


@dataclass
class TaskItem:
    context: str
    choices: list[str]
    gold: int


def load_task(path: str | Path, key: str = "train.eval_tasks") -> list[TaskItem]:
    """The items of a task file; a malformed line is one ValueError naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key}: {path} is not a readable UTF-8 task file ({exc})") from exc
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            item = TaskItem(row["context"], row["choices"], row["gold"])
            ok = isinstance(item.context, str) and item.context and isinstance(item.choices, list) \
                and len(item.choices) >= 2 and all(isinstance(c, str) and c for c in item.choices) \
                and isinstance(item.gold, int) and not isinstance(item.gold, bool) \
                and 0 <= item.gold < len(item.choices)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise ValueError(f"{key}: {path} line {number} is not a task item: it needs a JSON object with a "
                             f"non-empty 'context', at least two non-empty 'choices' and 'gold' (the index of "
                             f"the correct choice)")
        items.append(item)
    if not items:
        raise ValueError(f"{key}: {path} holds no task items")
    return items


def encode_pair(encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) split as lm-evaluation-harness's `_encode_pair` splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head):]


def requests(items: list[TaskItem], encode) -> list[tuple[list[int], int]]:
    """One scoring request per (item, choice): all the tokens, and how many at the end are the choice's."""
    out = []
    for item in items:
        for choice in item.choices:
            head, tail = encode_pair(encode, item.context, TARGET_DELIMITER + choice)
            out.append((head + tail, len(tail)))
    return out


def accuracy(items: list[TaskItem], nll_sums: list[float]) -> dict:
    """{"acc", "acc_norm"} from each choice's summed negative log-likelihood (in request order)."""
    acc = norm = 0
    k = 0
    for item in items:
        lls = [-s for s in nll_sums[k:k + len(item.choices)]]
        k += len(item.choices)
        acc += max(range(len(lls)), key=lambda i: lls[i]) == item.gold  # ties: the first, as numpy's argmax
        normed = [ll / len(c) for ll, c in zip(lls, item.choices)]
        norm += max(range(len(normed)), key=lambda i: normed[i]) == item.gold
    return {"acc": acc / len(items), "acc_norm": norm / len(items)}


class TaskSuite:
    """The run's tasks, tokenized once: {name: accuracies} per evaluation. The name is the file's stem."""

    def __init__(self, paths: list[str], encode):
        self.tasks = {}
        for path in paths:
            name = Path(path).stem
            name = name if name not in self.tasks else f"{name}#{len(self.tasks)}"
            items = load_task(path)
            self.tasks[name] = (items, requests(items, encode))

    def evaluate(self, scorer) -> dict[str, float]:
        """{"<task>/acc": …, "<task>/acc_norm": …} for every task."""
        record = {}
        for name, (items, reqs) in self.tasks.items():
            for metric, value in accuracy(items, scorer.nll_sums(reqs)).items():
                record[f"{name}/{metric}"] = value
        return record


class InRunTasks:
    """train.eval_tasks every train.eval_tasks_interval steps (and at the last step), at the run's layout."""

    def __init__(self, cfg, topo, chunks, dtype, device):
        t = cfg.train
        self.cfg, self.topo, self.chunks, self.dtype, self.device = cfg, topo, chunks, dtype, device
        self.suite, self.scorer = None, None
        if t.eval_tasks:
            try:
                tokenizer = TextTokenizer(cfg.data.tokenizer)
                eod = cfg.data.eod_token_id if cfg.data.eod_token_id >= 0 else eod_id_or_none(cfg.data.tokenizer)
                prefix = tokenizer.prefix_id(eod)
                self.suite = TaskSuite(t.eval_tasks, lambda text: tokenizer.encode_as_harness(text, prefix))
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc

    def due(self, step: int) -> bool:
        interval = self.cfg.train.eval_tasks_interval
        return self.suite is not None and interval > 0 and (step % interval == 0 or step == self.cfg.train.steps)

    def evaluate(self) -> dict[str, float]:
        if self.scorer is None:  # one sequence per micro-batch: the stages exchange [1, its length, h]
            t, sp = self.topo, self.cfg.parallel.sequence_parallel
            pipe = PipelineComm.for_model(t, self.cfg.model, 1, sp, self.dtype, self.device) if t.pp_size > 1 else None
            cp = self.chunks[0].cp
            self.scorer = Scorer(self.chunks, self.cfg.train.eval_window or self.cfg.model.seq_length, self.device,
                                 pipe, t.dp_group, t.dp_rank, t.dp_size, sequence_shards=t.tp_size if sp else 1,
                                 context=cp if cp.size > 1 else None)
        record = self.suite.evaluate(self.scorer)
        log.info("tasks: " + ", ".join(f"{k} {v:.3f}" for k, v in record.items()))  # rank 0's log only
        return record
