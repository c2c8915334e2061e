#!/usr/bin/env bash
# `make demo`: the whole Trilith workflow on this machine with no download:
#   the Python standard library's source as the corpus → BPE tokenizer → MMIDIDX shards → pretraining
#   through launch/run_pretrain.sh on several local CPU ranks → loss curve.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${TRILITH_PYTHON:-$ROOT/.venv/bin/python}"
OUT=demo_out
NPROC="${DEMO_NPROC:-8}"
LAYOUT=(parallel.tensor=2 parallel.pipeline=2)   # with 8 ranks: TP2 × PP2 × DP2

step() { printf '\n=== %s\n' "$*"; }

step "1/4 corpus: the standard library's .py files as JSONL"
[[ -s $OUT/corpus.jsonl ]] || "$PY" tools/stdlib_corpus.py --output $OUT/corpus.jsonl

step "2/4 tokenizer: byte-level BPE, 8192 tokens"
[[ -s $OUT/tokenizer/tokenizer.json ]] || \
  "$PY" tools/train_tokenizer.py --input $OUT/corpus.jsonl --output-dir $OUT/tokenizer --vocab-size 8192

step "3/4 preprocess: tokenized binary shards (.bin/.idx)"
[[ -s $OUT/data/stdlib_text_document.idx ]] || \
  "$PY" tools/preprocess_data.py --input $OUT/corpus.jsonl --output-prefix $OUT/data/stdlib \
    --tokenizer-model $OUT/tokenizer/tokenizer.json --append-eod --workers 2

step "4/4 pretrain: $NPROC local ranks (${LAYOUT[*]})"
rm -rf $OUT/run
launch/run_pretrain.sh --nproc "$NPROC" --config launch/configs/demo.yaml "${LAYOUT[@]}"

"$PY" - <<PYEOF
import json
rows = [json.loads(l) for l in open("$OUT/run/metrics.jsonl")]
first, last = rows[0], rows[-1]
print(f"\nloss fell from {first['loss']:.3f} (step {first['step']}) to {last['loss']:.3f} (step {last['step']})")
assert last["loss"] < first["loss"], "the demo's loss did not fall"
PYEOF
echo "demo: run directory $OUT/run (config.yaml, metrics.jsonl, logs/, checkpoints/)"
