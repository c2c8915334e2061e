"""Turn an lm-evaluation-harness multiple-choice task into a Trilith task file (train.eval_tasks), offline.

    # once, where the task's data is available: lm-eval writes every item it scored
    lm_eval --model hf --model_args pretrained=hf/x --tasks arc_easy --limit 200 --log_samples --output_path out
    python tools/tasks_from_lm_eval.py out/*/samples_arc_easy_*.jsonl launch/tasks/arc_easy.jsonl

Each logged item becomes {"context", "choices", "gold"}: the context and continuations lm-eval scored (so
templates and few-shot examples are kept as rendered), the continuations without their leading
target_delimiter " " (the in-run scorer adds it back), and gold from the item's target. Check the task's
licence before shipping the file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def convert(row: dict, where: str) -> dict:
    args = row.get("arguments") if isinstance(row, dict) else None
    if not isinstance(args, dict) or not args:
        raise ValueError(f"{where}: no 'arguments' (is this an lm-eval --log_samples file?)")
    pairs = [(a.get("arg_0"), a.get("arg_1")) for a in args.values() if isinstance(a, dict)]
    contexts = {c for c, _ in pairs}
    if len(pairs) < 2 or len(contexts) != 1 or not all(isinstance(x, str) for x in contexts):
        raise ValueError(f"{where}: not a multiple-choice item (one context, two or more continuations)")
    if not all(isinstance(x, str) and x.startswith(" ") for _, x in pairs):
        raise ValueError(f"{where}: a continuation does not start with the target_delimiter ' ', which the "
                         f"in-run scorer adds; this task uses another delimiter and cannot be converted")
    choices = [x[1:] for _, x in pairs]
    target = row.get("target")
    if isinstance(target, str) and target.isdigit():
        target = int(target)
    gold = target if isinstance(target, int) else choices.index(target) if target in choices else None
    if gold is None or not 0 <= gold < len(choices):
        raise ValueError(f"{where}: its target {str(target)[:40]!r} is neither a choice index nor a choice")
    return {"context": contexts.pop(), "choices": choices, "gold": gold}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/tasks_from_lm_eval.py", description=__doc__.split("\n")[0])
    ap.add_argument("samples", help="an lm-eval samples_<task>_<date>.jsonl (from --log_samples)")
    ap.add_argument("output", help="the task file to write (JSONL)")
    args = ap.parse_args(argv)
    try:
        rows = [(n, json.loads(line)) for n, line in
                enumerate(Path(args.samples).read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
        rows.sort(key=lambda r: r[1].get("doc_id", 0) if isinstance(r[1], dict) else 0)
        items = [convert(row, f"{args.samples} line {n}") for n, row in rows]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        print(f"tasks_from_lm_eval: {exc}", file=sys.stderr)
        return 1
    Path(args.output).write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items),
                                 encoding="utf-8")
    print(f"tasks_from_lm_eval: wrote {len(items)} items to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
