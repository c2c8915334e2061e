#!/usr/bin/env bash
# Clean or tokenize a corpus as an array of tasks plus a merge, on SLURM or as local processes.
#   launch/run_data_job.sh --tasks N [--after JOBID] [--sbatch "OPTIONS"] curate|preprocess TOOL_ARGS...
#   launch/run_data_job.sh --tasks N --local curate|preprocess TOOL_ARGS...
# SLURM: submits an array job of N tasks (task i runs the tool with --num-shards N; the tool reads its index
# from SLURM_ARRAY_TASK_ID) and a merge job that starts only when all of them succeeded
# (--dependency=afterok). Prints the merge job's id on stdout: pass it as --after to the next step, e.g.
#   CLEAN=$(launch/run_data_job.sh --tasks 64 curate --input raw/ --output clean/corpus.jsonl)
#   launch/run_data_job.sh --tasks 64 --after "$CLEAN" preprocess --input clean/corpus.jsonl \
#       --output-prefix data/corpus --tokenizer-model tok/ --append-eod
# Every task leaves a done-marker (its input bytes' sizes and hashes): after a failure or preemption, submit
# the same command again and only the unfinished tasks do work. --local runs the N tasks as processes on this
# machine, then the merge: the same code and outputs. Outputs equal a single-process run's, byte for byte.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${TRILITH_PYTHON:-}" ]]; then PY="$TRILITH_PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"
else PY="python3"; fi

usage() { echo "usage: $0 --tasks N [--local] [--after JOBID] [--sbatch \"OPTIONS\"] curate|preprocess TOOL_ARGS..." >&2; exit 2; }
TASKS="" LOCAL=0 AFTER="" SBATCH_OPTS=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tasks) TASKS="${2:-}"; shift 2 ;;
    --local) LOCAL=1; shift ;;
    --after) AFTER="${2:-}"; shift 2 ;;
    --sbatch) SBATCH_OPTS="${2:-}"; shift 2 ;;
    --tasks=*) TASKS="${1#*=}"; shift ;;
    --after=*) AFTER="${1#*=}"; shift ;;
    --sbatch=*) SBATCH_OPTS="${1#*=}"; shift ;;
    curate|preprocess) break ;;
    *) echo "run_data_job.sh: unknown option '$1'" >&2; usage ;;
  esac
done
[[ $# -gt 0 ]] || usage
if ! [[ "$TASKS" =~ ^[1-9][0-9]*$ ]]; then echo "run_data_job.sh: --tasks needs a positive number, got '$TASKS'" >&2; exit 2; fi
if [[ -n "$AFTER" && ! "$AFTER" =~ ^[0-9]+$ ]]; then echo "run_data_job.sh: --after needs a job id, got '$AFTER'" >&2; exit 2; fi
TOOL="$ROOT/tools/$1_data.py"
shift
ARGS=("$@" --num-shards "$TASKS")

if [[ "$LOCAL" == 1 ]]; then
  pids=()
  for ((i = 0; i < TASKS; i++)); do
    "$PY" "$TOOL" "${ARGS[@]}" --shard-index "$i" & pids+=($!)
  done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  if [[ "$failed" == 1 ]]; then
    echo "run_data_job.sh: a task failed; run the same command again (finished tasks are skipped)" >&2; exit 1
  fi
  exec "$PY" "$TOOL" "${ARGS[@]}" --merge-shards
fi

command -v sbatch >/dev/null || { echo "run_data_job.sh: sbatch not found; use --local to run here" >&2; exit 2; }
# Quoted once for the batch shell that --wrap starts.
TASK_CMD="$(printf '%q ' "$PY" "$TOOL" "${ARGS[@]}")"
DEPEND=()
# A failed previous step cancels this one rather than leaving it pending forever.
[[ -n "$AFTER" ]] && DEPEND=(--dependency="afterok:$AFTER" --kill-on-invalid-dep=yes)
# shellcheck disable=SC2086  # SBATCH_OPTS is a list of sbatch options, split on purpose
ARRAY=$(sbatch --parsable --job-name="trilith-$(basename "$TOOL" .py)" --array="0-$((TASKS - 1))" \
  "${DEPEND[@]}" $SBATCH_OPTS --wrap "$TASK_CMD")
ARRAY="${ARRAY%%;*}"
# shellcheck disable=SC2086
MERGE=$(sbatch --parsable --job-name="trilith-$(basename "$TOOL" .py)-merge" --dependency="afterok:$ARRAY" \
  --kill-on-invalid-dep=yes $SBATCH_OPTS --wrap "$TASK_CMD --merge-shards")
MERGE="${MERGE%%;*}"
echo "run_data_job.sh: array job $ARRAY ($TASKS tasks), merge job $MERGE after it" >&2
echo "$MERGE"
