#!/usr/bin/env bash
# Start Trilith pretraining.
#   launch/run_pretrain.sh --config FILE [section.key=value ...]             one process
#   launch/run_pretrain.sh --nproc N --config FILE [overrides]               N local processes (gloo/nccl)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${TRILITH_PYTHON:-}" ]]; then PY="$TRILITH_PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"
else PY="python3"; fi

NPROC=1
ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc) NPROC="$2"; shift 2 ;;
    --nproc=*) NPROC="${1#*=}"; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ "$NPROC" -gt 1 ]]; then
  # Share the cores between ranks instead of every rank spawning one thread per core.
  CORES=$(nproc)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}"
  exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m engine.train "${ARGS[@]}"
fi
exec "$PY" -m engine.train "${ARGS[@]}"
