# Sourced by launch/run_pretrain.sh for --nproc N (and --nnodes M): this node's ranks under torchrun, again
# after a failure (--max-restarts). torchrun reports any non-zero rank exit as its own failure (1), so the
# ranks exit 0 from an early stop and rank 0 leaves the code (3 preempted, 4 GPU health) in the stop file;
# with --nnodes > 1 only node 0's launcher holds rank 0 and returns the code, the other nodes return 0.

# Share the cores between ranks instead of every rank spawning one thread per core.
CORES=$(nproc)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}"
# --nnodes M: torchrun's static rendezvous, a store that node 0's torchrun serves on --master-port. A restart
# must not meet the last attempt's store: a node whose ranks died restarts at once, while node 0's torchrun of
# that attempt may still be up, and the restarted ranks would take its stale keys for a rendezvous, fail, and
# leave node 0's next torchrun waiting for a node that has given up. So attempt k (0 first) uses port P + k on
# every node, and each node's launcher restarts once per failure of the job, in step with the others.
[[ "$NNODES" -eq 1 || -n "$MASTER" ]] ||
  { echo "run_pretrain.sh: --nnodes $NNODES needs --master-addr (node 0's address)" >&2; exit 2; }
PORT="${PORT:-29500}"
[[ "$NNODES" -eq 1 ]] || { [[ "$PORT" =~ ^[0-9]{1,5}$ ]] && (( 10#$PORT + MAX_RESTARTS <= 65535 )); } ||
  { echo "run_pretrain.sh: --master-port must be a port number with room for --max-restarts after it" \
      "(attempt k uses port + k), got '$PORT'" >&2; exit 2; }
rendezvous() {  # the torchrun flags of attempt ATTEMPT
  if [[ "$NNODES" -eq 1 ]]; then
    RDZV=(--standalone)
  else
    RDZV=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER"
      --master-port "$(( 10#$PORT + ATTEMPT ))")
  fi
}

# Signals for the job go to the ranks (torchrun's children) themselves: SIGTERM/SIGUSR1 stop them after a
# checkpoint (torchrun would kill them 30 s later and fail); SIGINT interrupts them as it would one process
# (a Ctrl-C reaches torchrun too, which then does the same). Before the ranks exist, torchrun is just ended.
# A signalled run is not restarted.
TORCHRUN=""
signal_ranks() {
  local ranks
  INTERRUPTED=1
  [[ -n "$TORCHRUN" ]] || return 0
  ranks="$(cat /proc/"$TORCHRUN"/task/*/children 2>/dev/null || true)"
  if [[ -n "$ranks" ]]; then kill -s "$1" $ranks 2>/dev/null || true
  else kill -s TERM "$TORCHRUN" 2>/dev/null || true; fi
}

# torchrun's stderr passes through launch/lib/torchrun_report.py: the ranks' lines reach the console, torchrun's
# own report of a failed child goes to run.dir/logs/torchrun.log, and the reason for the last line to REASON.
REASON="$(mktemp "${TMPDIR:-/tmp}/trilith-reason.XXXXXX")"
start_torchrun() {
  local fifo="$REASON.fifo" filter
  : > "$REASON"
  rm -f "$fifo" && mkfifo "$fifo"
  rendezvous
  "$PY" "$ROOT/launch/lib/torchrun_report.py" "$REASON" "${ARGS[@]}" < "$fifo" >&2 &
  filter=$!
  "$PY" -m torch.distributed.run "${RDZV[@]}" --nproc-per-node "$NPROC" -m "$MODULE" "${ARGS[@]}" 2> "$fifo" &
  TORCHRUN=$!
  # A trapped signal interrupts `wait` while torchrun still runs: wait again until it has exited.
  while kill -0 "$TORCHRUN" 2>/dev/null; do wait "$TORCHRUN" || true; done
  STATUS=0
  wait "$TORCHRUN" || STATUS=$?
  while kill -0 "$filter" 2>/dev/null; do wait "$filter" || true; done
  rm -f "$fifo"
}

check_launch "$(( NPROC * NNODES ))"
make_stop_file
trap 'signal_ranks TERM' TERM
trap 'signal_ranks USR1' USR1
trap 'signal_ranks INT' INT
run_attempts start_torchrun
# The last line of a failed run: its exit status (docs/launching.md) and the one-line reason.
if [[ "$STATUS" -ne 0 && -s "$REASON" ]]; then
  echo "run_pretrain.sh: the run failed (exit $STATUS): $(head -n 1 "$REASON")" >&2
fi
rm -f "$REASON"
exit "$STATUS"
