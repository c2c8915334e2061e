# Sourced by launch/run_pretrain.sh: the stop file the ranks write, the pre-start check, and the one loop that
# starts the ranks again after a failure (--max-restarts). Uses ROOT, PY, MODULE, MODE, NODE_RANK, ARGS,
# MAX_RESTARTS.

# Before any rank starts: the configuration, for the world size (a pre-flight's, scaled down), CUDA where GPUs
# were asked for, and (training, on the node of rank 0, which takes the lock) that no live run holds run.dir.
# A failure is launch/check.py's one line and status 2, not a line per rank and torchrun's report of a failed
# child.
check_launch() {  # check_launch WORLD_SIZE
  local lock=()
  [[ "$MODULE" == engine.train && "$NODE_RANK" -eq 0 ]] && lock=(--lock)
  "$PY" "$ROOT/launch/check.py" --world-size "$1" "${lock[@]}" "${MODE[@]}" "${ARGS[@]}" || exit "$?"
}

# The ranks' stop file (engine/stop.py): a code on the first line, after a GPU-health stop a second line
# `unhealthy NODE[,NODE...]`. The ranks exit 0 from an early stop (so that srun --kill-on-bad-exit and
# torchrun do not cut the others short or report a failure of their own) and rank 0 leaves the code here.
make_stop_file() {
  TRILITH_STOP_FILE="$(mktemp "${TMPDIR:-/tmp}/trilith-stop.XXXXXX")"
  export TRILITH_STOP_FILE
  trap 'rm -f "$TRILITH_STOP_FILE"' EXIT
}

# Whatever can write the stop file must not reach bash arithmetic or sbatch --wrap: only digits are a code
# (anything else is a failure, 1) and only SLURM node-name characters are names.
STOP_CODE="" UNHEALTHY=""
read_stop_file() {
  local code nodes shown
  STOP_CODE="" UNHEALTHY=""
  [[ -s "$TRILITH_STOP_FILE" ]] || return 0
  code="$(head -n 1 "$TRILITH_STOP_FILE")"
  nodes="$(sed -n 's/^unhealthy //p' "$TRILITH_STOP_FILE" | head -n 1)"
  if [[ "$code" =~ ^[0-9]{1,3}$ ]] && (( 10#$code <= 255 )); then
    STOP_CODE=$(( 10#$code ))
  else
    printf -v shown '%q' "${code:0:60}"
    echo "run_pretrain.sh: the ranks' stop file holds no exit code (first line $shown); the run failed" >&2
    STOP_CODE=1
  fi
  if [[ "$nodes" =~ ^[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*$ ]]; then
    UNHEALTHY="$nodes"
  elif [[ -n "$nodes" ]]; then
    printf -v shown '%q' "${nodes:0:60}"
    echo "run_pretrain.sh: ignoring the stop file's unhealthy nodes $shown (not SLURM node names)" >&2
  fi
}

# A failed run is started again (all ranks; they resume from the latest checkpoint) while restarts are
# left. Not after success, a signal to this launcher, or a code the ranks left in the stop file: an early
# stop (3 preempted, 4 GPU health) or a failure a restart would repeat (2 configuration, 1 an unloadable
# checkpoint or non-finite training; see engine/stop.py).
# ATTEMPT (0 first, then 1, 2, ...) is global: the --nnodes launchers rendezvous on a port of their attempt.
INTERRUPTED=0 ATTEMPT=0
run_attempts() {  # run_attempts START: START (a function) starts the ranks once and sets STATUS
  while :; do
    : > "$TRILITH_STOP_FILE"
    "$1"
    read_stop_file
    STATUS="${STOP_CODE:-$STATUS}"
    [[ "$STATUS" -ne 0 && ! -s "$TRILITH_STOP_FILE" && "$INTERRUPTED" -eq 0 && "$ATTEMPT" -lt "$MAX_RESTARTS" ]] ||
      return 0
    echo "run_pretrain.sh: the run failed (exit $STATUS); restart $(( ATTEMPT + 1 )) of $MAX_RESTARTS, resuming" \
      "from the latest checkpoint" >&2
    ATTEMPT=$(( ATTEMPT + 1 ))
  done
}
