#!/usr/bin/env bash
# `make demo`: the whole Trilith workflow on this machine with no download:
#   the Python standard library's source as the corpus → cleaning (PII, quality, near-duplicates) → BPE
#   tokenizer → MMIDIDX shards with provenance to the raw lines → pretraining
#   through launch/run_pretrain.sh on 8 local CPU ranks (TP2 × PP2 × DP2), interrupted halfway and resumed
#   from its checkpoint → export to Hugging Face → a generated sample from transformers.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${TRILITH_PYTHON:-$ROOT/.venv/bin/python}"
OUT=demo_out
NPROC="${DEMO_NPROC:-8}"
LAYOUT=(parallel.tensor=2 parallel.pipeline=2)   # with 8 ranks: TP2 × PP2 × DP2

step() { printf '\n=== %s\n' "$*"; }

step "1/7 corpus: the standard library's .py files as JSONL"
[[ -s $OUT/corpus.jsonl ]] || "$PY" tools/stdlib_corpus.py --output $OUT/corpus.jsonl

step "2/7 cleaning: PII scrubbed, low-quality and near-duplicate files dropped, raw file:line kept"
[[ -s $OUT/clean.jsonl ]] || "$PY" tools/curate_data.py --input $OUT/corpus.jsonl --output $OUT/clean.jsonl --workers 2

step "3/7 tokenizer: byte-level BPE, 8192 tokens"
[[ -s $OUT/tokenizer/tokenizer.json ]] || \
  "$PY" tools/train_tokenizer.py --input $OUT/clean.jsonl --output-dir $OUT/tokenizer --vocab-size 8192

step "4/7 preprocess: tokenized shards, zstd-compressed (.arrow/.idx), and their provenance map"
[[ -s $OUT/data/stdlib_text_document.idx ]] || \
  "$PY" tools/preprocess_data.py --input $OUT/clean.jsonl --output-prefix $OUT/data/stdlib \
    --tokenizer-model $OUT/tokenizer/tokenizer.json --append-eod --workers 2 --compression zstd

step "5/7 pretrain: $NPROC local ranks (${LAYOUT[*]}), stopping after step 60 as if preempted"
rm -rf $OUT/run $OUT/hf
launch/run_pretrain.sh --nproc "$NPROC" --config launch/configs/demo.yaml "${LAYOUT[@]}" checkpoint.exit_after=60

step "6/7 resume: the same command picks up the latest checkpoint and trains to the end"
launch/run_pretrain.sh --nproc "$NPROC" --config launch/configs/demo.yaml "${LAYOUT[@]}"

"$PY" - <<PYEOF
import json
rows = [json.loads(l) for l in open("$OUT/run/metrics.jsonl")]
first, last = rows[0], rows[-1]
print(f"\nloss fell from {first['loss']:.3f} (step {first['step']}) to {last['loss']:.3f} (step {last['step']})")
assert last["loss"] < first["loss"], "the demo's loss did not fall"
evals = [r for r in rows if "eval_loss" in r]
print("validation loss (held-out files): " + ", ".join(f"{r['eval_loss']:.3f} (step {r['step']})" for r in evals))
assert evals and evals[-1]["eval_loss"] < evals[0]["eval_loss"], "the demo's validation loss did not fall"
tasks = [r for r in rows if "python_syntax/acc" in r]
print("task accuracy (launch/tasks/python_syntax.jsonl, 20 items): " + ", ".join(
    f"acc {r['python_syntax/acc']:.2f} acc_norm {r['python_syntax/acc_norm']:.2f} (step {r['step']})" for r in tasks))
assert tasks, "the demo logged no task accuracy"
diary = [json.loads(l) for l in open("$OUT/run/diary.jsonl")]
print("generation diary ($OUT/run/diary.jsonl), prompt 'def ':")
for e in diary:
    if e["prompt"] == "def ":
        print(f"  step {e['step']:>4}: {(e['prompt'] + e['text'])[:70]!r}")
import glob
assert glob.glob("$OUT/run/tensorboard/events.out.tfevents.*"), "the demo wrote no TensorBoard events"
PYEOF
echo "the run's first training sample, traced through cleaning back to the raw corpus:"
"$PY" tools/trace_sample.py --run-dir $OUT/run --sample 0
"$PY" tools/plot_metrics.py $OUT/run --keys loss eval_loss lr grad_norm attention_entropy head_grad_variance_ratio \
  | tail -n 1

step "7/7 export to Hugging Face and sample with transformers"
"$PY" tools/ckpt_convert.py --to hf --load-dir $OUT/run/checkpoints --save-dir $OUT/hf
"$PY" tools/hf_sample.py --model-dir $OUT/hf --prompt "def " --max-new-tokens 48
echo "bits per byte of 10 corpus files (training text) for the checkpoint and for its Hugging Face export:"
head -n 10 $OUT/clean.jsonl > $OUT/eval_docs.jsonl
"$PY" tools/evaluate.py --model $OUT/run/checkpoints --data $OUT/eval_docs.jsonl --output $OUT/eval_checkpoint.json \
  > /dev/null
"$PY" tools/evaluate.py --model $OUT/hf --data $OUT/eval_docs.jsonl --output $OUT/eval_hf.json > /dev/null
"$PY" - <<PYEOF
import json
for name in ("checkpoint", "hf"):
    r = json.load(open(f"$OUT/eval_{name}.json"))["all"]
    print(f"  {name}: loss {r['loss']:.4f}, bits/byte {r['bits_per_byte']:.4f} ({r['tokens']} tokens, {r['bytes']} bytes)")
PYEOF
echo "demo: run directory $OUT/run (config.yaml, metrics.jsonl, curves.png, tensorboard/, logs/, checkpoints/), Hugging Face model $OUT/hf"
echo "      curves in TensorBoard: $PY -m tensorboard.main --logdir $OUT/run/tensorboard"
