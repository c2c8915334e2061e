#!/usr/bin/env bash
# Start Trilith pretraining: one script for local, torchrun, SLURM and MPI runs.
#   launch/run_pretrain.sh --config FILE [section.key=value ...]               one process
#   launch/run_pretrain.sh --nproc N --config FILE [overrides]                 N local processes (gloo/nccl)
#   launch/run_pretrain.sh --nproc N --nnodes M --node-rank R --master-addr HOST --config FILE   node R of M
#   sbatch launch/run_pretrain.sh --config FILE                                SLURM batch (defaults below)
#   srun launch/run_pretrain.sh --config FILE                                  one task per rank in an allocation
#   mpirun -np N launch/run_pretrain.sh --config FILE                          Open MPI / MPICH
#   launch/run_pretrain.sh --preflight [--nproc N] --config FILE               scaled-down check, pass/fail report
#   --max-restarts K (with --nproc, or in an sbatch job): after a failure (a rank died, a collective timed
#   out), start all ranks again, up to K times; they resume from the latest checkpoint.
# Exit status: 0 done, 2 configuration error (or run.dir in use by a live training), 3 preempted after a
# checkpoint (a SLURM batch job requeues itself), 4 stopped by a GPU-health threshold after a checkpoint (a
# SLURM batch job requeues itself without the node(s) named; TRILITH_EXCLUDE_UNHEALTHY=0 stops instead),
# anything else: failure.
#
# SLURM defaults: edit, or override on the sbatch command line (sbatch --nodes=4 ...).
#SBATCH --job-name=trilith
#SBATCH --nodes=1
#SBATCH --ntasks=8                   # one rank per task (per GPU); multi-node: --nodes=N --ntasks-per-node=8
##SBATCH --gpus-per-node=8        # GPU clusters: remove one # (one rank per GPU)
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@180
#SBATCH --requeue
#SBATCH --output=slurm-%j.out
#SBATCH --open-mode=append           # a requeued job keeps the earlier attempts' output (SLURM would truncate it)
set -euo pipefail

# sbatch runs a spooled copy of this file: find the checkout from TRILITH_ROOT or the submit directory.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${TRILITH_ROOT:-}" ]]; then ROOT="$TRILITH_ROOT"
elif [[ ! -f "$ROOT/engine/train.py" && -f "${SLURM_SUBMIT_DIR:-}/engine/train.py" ]]; then ROOT="$SLURM_SUBMIT_DIR"
fi
if [[ ! -f "$ROOT/engine/train.py" ]]; then
  echo "run_pretrain.sh: cannot find the Trilith checkout (looked in $ROOT); set TRILITH_ROOT" >&2; exit 2
fi
if [[ -n "${TRILITH_PYTHON:-}" ]]; then PY="$TRILITH_PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"
else PY="python3"; fi

NPROC=1 NNODES=1 NODE_RANK=0 MASTER="" PORT="" MODULE=engine.train MAX_RESTARTS=0
ARGS=() MODE=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc|--nnodes|--node-rank|--master-addr|--master-port|--max-restarts)
      [[ $# -ge 2 ]] || { echo "run_pretrain.sh: $1 needs a value" >&2; exit 2; }
      case "$1" in
        --nproc) NPROC="$2" ;; --nnodes) NNODES="$2" ;; --node-rank) NODE_RANK="$2" ;;
        --master-addr) MASTER="$2" ;; --master-port) PORT="$2" ;; --max-restarts) MAX_RESTARTS="$2" ;;
      esac
      shift 2 ;;
    --nproc=*) NPROC="${1#*=}"; shift ;;
    --nnodes=*) NNODES="${1#*=}"; shift ;;
    --node-rank=*) NODE_RANK="${1#*=}"; shift ;;
    --master-addr=*) MASTER="${1#*=}"; shift ;;
    --master-port=*) PORT="${1#*=}"; shift ;;
    --max-restarts=*) MAX_RESTARTS="${1#*=}"; shift ;;
    --preflight) MODULE=engine.preflight; MODE=(--preflight); shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
for v in "$NPROC" "$NNODES" "$NODE_RANK" "$MAX_RESTARTS"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "run_pretrain.sh: --nproc/--nnodes/--node-rank/--max-restarts must be integers, got '$v'" >&2; exit 2; }
done

# A failed run is started again (all ranks; they resume from the latest checkpoint) while restarts are
# left. Not after success, a signal to this launcher, or a code the ranks left in the stop file: an early
# stop (3 preempted, 4 GPU health) or a failure a restart would repeat (2 configuration, 1 an unloadable
# checkpoint or non-finite training; see engine/stop.py).
INTERRUPTED=0
restart_allowed() {  # restart_allowed STATUS ATTEMPT
  [[ "$1" -ne 0 && ! -s "$TRILITH_STOP_FILE" && "$INTERRUPTED" -eq 0 && "$2" -lt "$MAX_RESTARTS" ]]
}
announce_restart() {  # announce_restart STATUS ATTEMPT
  echo "run_pretrain.sh: the run failed (exit $1); restart $(( $2 + 1 )) of $MAX_RESTARTS, resuming from the latest checkpoint" >&2
}
# The ranks' stop file (engine/stop.py): a code on the first line, after a GPU-health stop a second line
# `unhealthy NODE[,NODE...]`. Whatever can write it must not reach bash arithmetic or sbatch --wrap: only
# digits are a code (anything else is a failure, 1) and only SLURM node-name characters are names.
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
# Before any rank starts: the configuration, for the world size, and (training, on the node of rank 0,
# which takes the lock) that no live run holds run.dir. A failure is launch/check.py's one line and status
# 2, not a line per rank and torchrun's report of a failed child.
check_launch() {  # check_launch WORLD_SIZE
  local lock=()
  [[ "$MODULE" == engine.train && "$NODE_RANK" -eq 0 ]] && lock=(--lock)
  "$PY" "$ROOT/launch/check.py" --world-size "$1" "${lock[@]}" "${ARGS[@]}" || exit "$?"
}

cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# sbatch: this is the batch shell, not a rank. Start one rank per task with srun; requeue on preemption.
if [[ -n "${SLURM_JOB_ID:-}" && -z "${SLURM_STEP_ID:-}" && -z "${RANK:-}" && "$NPROC" -eq 1 ]]; then
  # Each start of the job (a requeue appends to the same output: --open-mode=append) says where and when.
  echo "run_pretrain.sh: job $SLURM_JOB_ID starting (SLURM restart count ${SLURM_RESTART_COUNT:-0})" \
    "on $(hostname) at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  check_launch "${SLURM_NTASKS:-1}"
  # Ranks report an early stop here (rank 0 runs on this, the first, node) and exit 0 so that
  # --kill-on-bad-exit does not cut the others short, and a final failure's code; see engine/stop.py.
  TRILITH_STOP_FILE="$(mktemp "${TMPDIR:-/tmp}/trilith-stop.XXXXXX")"
  export TRILITH_STOP_FILE
  trap 'rm -f "$TRILITH_STOP_FILE"' EXIT
  trap 'INTERRUPTED=1' TERM USR1 INT
  # The rendezvous port: one free on this node (rank 0's) now, chosen again for every attempt (the last
  # one's may still be held for a moment). Ports derived from the job id would collide between jobs
  # 20,000 ids apart sharing a first node; the kernel knows which ports are taken.
  USER_PORT="${MASTER_PORT:-}"
  attempt=0
  while :; do
    : > "$TRILITH_STOP_FILE"
    MASTER_PORT="${USER_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}"
    export MASTER_PORT
    set +e
    srun --kill-on-bad-exit=1 --export=ALL bash "$ROOT/launch/run_pretrain.sh" "${MODE[@]}" "${ARGS[@]}"
    status=$?
    set -e
    read_stop_file
    status="${STOP_CODE:-$status}"
    restart_allowed "$status" "$attempt" || break
    announce_restart "$status" "$attempt"
    attempt=$(( attempt + 1 ))
  done
  if [[ "$status" -eq 3 && "${TRILITH_REQUEUE:-1}" == 1 ]]; then
    echo "run_pretrain.sh: preempted (exit 3); requeueing job $SLURM_JOB_ID to resume from run.dir" >&2
    scontrol requeue "$SLURM_JOB_ID"
  fi
  # A GPU-health stop: the same GPU would fail again, so the job goes back to the queue without the nodes
  # the ranks named (added to any it already excluded) and resumes from run.dir on others. SLURM does not
  # change a running job's excluded nodes: a one-task job that starts once this one has ended holds it in
  # the queue, sets them and releases it.
  if [[ "$status" -eq 4 && -n "$UNHEALTHY" && "${TRILITH_EXCLUDE_UNHEALTHY:-1}" == 1 ]]; then
    job_info="$(scontrol show job "$SLURM_JOB_ID")"
    job_field() {  # job_field NAME: the value scontrol shows for the job, empty for (null)
      sed -n "s/.*[[:space:]]$1=\([^ ]*\).*/\1/p" <<<"$job_info" | head -n 1 | sed 's/^(null)$//'
    }
    excluded="$(job_field ExcNodeList)"
    excluded="${excluded:+$excluded,}$UNHEALTHY"
    job_out="$(job_field StdOut)"
    # The helper is charged and queued like the job itself (same partition and account).
    where=()
    for field in Partition Account; do
      value="$(job_field "$field")"
      [[ -n "$value" ]] && where+=("--${field,,}=$value")
    done
    # Every value is quoted for the helper's shell (sbatch --wrap runs a script of the text).
    printf -v requeue 'scontrol requeuehold %q && scontrol update JobId=%q ExcNodeList=%q && scontrol release %q' \
      "$SLURM_JOB_ID" "$SLURM_JOB_ID" "$excluded" "$SLURM_JOB_ID"
    printf -v note 'echo %q >> %q' "run_pretrain.sh: job $SLURM_JOB_ID requeued without node(s) $excluded" "$job_out"
    if sbatch --quiet "${where[@]}" --job-name="trilith-exclude-$SLURM_JOB_ID" --dependency="afterany:$SLURM_JOB_ID" \
        --ntasks=1 --cpus-per-task=1 --time=10 --output=/dev/null --wrap "$requeue && $note"
    then
      echo "run_pretrain.sh: GPU health stop (exit 4) on $UNHEALTHY; job $SLURM_JOB_ID goes back to the queue" \
        "without node(s) $excluded once it has ended, to resume from run.dir elsewhere" >&2
    else
      echo "run_pretrain.sh: GPU health stop (exit 4) on $UNHEALTHY; could not submit the requeue; do it by hand:" \
        "$requeue" >&2
    fi
  fi
  exit "$status"
fi

# srun task: the rendezvous host is the first node of the job (Python parses the list without scontrol).
if [[ -n "${SLURM_PROCID:-}" && -z "${MASTER_ADDR:-}" && -z "${RANK:-}" ]] && command -v scontrol >/dev/null; then
  MASTER_ADDR="$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" | head -n 1)"
  export MASTER_ADDR
fi
# One CPU share per rank: SLURM says how many; under MPI split the cores between the node's ranks.
LOCAL_RANKS="${OMPI_COMM_WORLD_LOCAL_SIZE:-${MPI_LOCALNRANKS:-}}"
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$SLURM_CPUS_PER_TASK}"
elif [[ "$LOCAL_RANKS" =~ ^[1-9][0-9]*$ ]]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / LOCAL_RANKS > 0 ? $(nproc) / LOCAL_RANKS : 1 ))}"
fi

if [[ "$NPROC" -gt 1 || "$NNODES" -gt 1 ]]; then
  # Share the cores between ranks instead of every rank spawning one thread per core.
  CORES=$(nproc)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}"
  if [[ "$NNODES" -eq 1 ]]; then
    RDZV=(--standalone)
  else
    [[ -n "$MASTER" ]] || { echo "run_pretrain.sh: --nnodes $NNODES needs --master-addr (node 0's address)" >&2; exit 2; }
    RDZV=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER" --master-port "${PORT:-29500}")
  fi
  # torchrun reports any non-zero rank exit as its own failure (1), so the ranks exit 0 from an early stop
  # and rank 0 leaves the code (3 preempted, 4 GPU health) here; see engine/stop.py. With --nnodes > 1
  # only node 0's launcher holds rank 0 and returns the code; the other nodes return 0.
  check_launch "$(( NPROC * NNODES ))"
  TRILITH_STOP_FILE="$(mktemp "${TMPDIR:-/tmp}/trilith-stop.XXXXXX")"
  export TRILITH_STOP_FILE
  trap 'rm -f "$TRILITH_STOP_FILE"' EXIT
  # Signals for the job go to the ranks (torchrun's children) themselves: SIGTERM/SIGUSR1 stop them after
  # a checkpoint (torchrun would kill them 30 s later and fail); SIGINT interrupts them as it would one
  # process (a Ctrl-C reaches torchrun too, which then does the same). Before the ranks exist, torchrun is
  # just ended. A signalled run is not restarted.
  TORCHRUN=""
  signal_ranks() {
    local ranks
    INTERRUPTED=1
    [[ -n "$TORCHRUN" ]] || return 0
    ranks="$(cat /proc/"$TORCHRUN"/task/*/children 2>/dev/null || true)"
    if [[ -n "$ranks" ]]; then kill -s "$1" $ranks 2>/dev/null || true
    else kill -s TERM "$TORCHRUN" 2>/dev/null || true; fi
  }
  trap 'signal_ranks TERM' TERM
  trap 'signal_ranks USR1' USR1
  trap 'signal_ranks INT' INT
  attempt=0
  while :; do
    : > "$TRILITH_STOP_FILE"
    "$PY" -m torch.distributed.run "${RDZV[@]}" --nproc-per-node "$NPROC" -m "$MODULE" "${ARGS[@]}" &
    TORCHRUN=$!
    # A trapped signal interrupts `wait` while torchrun still runs: wait again until it has exited.
    while kill -0 "$TORCHRUN" 2>/dev/null; do wait "$TORCHRUN" || true; done
    status=0
    wait "$TORCHRUN" || status=$?
    read_stop_file
    status="${STOP_CODE:-$status}"
    restart_allowed "$status" "$attempt" || exit "$status"
    announce_restart "$status" "$attempt"
    attempt=$(( attempt + 1 ))
  done
fi
exec "$PY" -m "$MODULE" "${ARGS[@]}"
