#!/usr/bin/env bash
# `make demo`: pretrain a small Llama on this machine, end to end, with no download.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${DEMO_OUT:-demo_out}"
rm -rf "$OUT/run"
launch/run_pretrain.sh --config launch/configs/tiny.yaml run.dir="$OUT/run" train.steps=40
echo "demo: metrics in $OUT/run/metrics.jsonl"
