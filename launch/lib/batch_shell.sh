# Sourced by launch/run_pretrain.sh in an sbatch job's batch shell (not a rank): start one rank per task with
# srun, again after a failure (--max-restarts), then requeue the job after a preemption or a GPU-health stop.

# The rendezvous port: one free on this node (rank 0's) now, chosen again for every attempt (the last one's
# may still be held for a moment). Ports derived from the job id would collide between jobs 20,000 ids apart
# sharing a first node; the kernel knows which ports are taken.
start_srun() {
  MASTER_PORT="${USER_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}"
  export MASTER_PORT
  set +e
  srun --kill-on-bad-exit=1 --export=ALL bash "$ROOT/launch/run_pretrain.sh" "${MODE[@]}" "${ARGS[@]}"
  STATUS=$?
  set -e
}

# A GPU-health stop: the same GPU would fail again, so the job goes back to the queue without the nodes the
# ranks named (added to any it already excluded) and resumes from run.dir on others. SLURM does not change a
# running job's excluded nodes: a one-task job that starts once this one has ended holds it in the queue, sets
# them and releases it.
requeue_without_unhealthy() {
  local job_info excluded job_out where=() field value requeue note
  job_info="$(scontrol show job "$SLURM_JOB_ID")"
  job_field() {  # job_field NAME: the value scontrol shows for the job, empty for (null)
    sed -n "s/.*[[:space:]]$1=\([^ ]*\).*/\1/p" <<<"$job_info" | head -n 1 | sed 's/^(null)$//'
  }
  excluded="$(job_field ExcNodeList)"
  excluded="${excluded:+$excluded,}$UNHEALTHY"
  job_out="$(job_field StdOut)"
  # The helper is charged and queued like the job itself (same partition and account).
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
}

# Each start of the job (a requeue appends to the same output: --open-mode=append) says where and when.
echo "run_pretrain.sh: job $SLURM_JOB_ID starting (SLURM restart count ${SLURM_RESTART_COUNT:-0})" \
  "on $(hostname) at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
check_launch "${SLURM_NTASKS:-1}"
make_stop_file  # rank 0 runs on this, the first, node
trap 'INTERRUPTED=1' TERM USR1 INT
USER_PORT="${MASTER_PORT:-}"
run_attempts start_srun
if [[ "$STATUS" -eq 3 && "${TRILITH_REQUEUE:-1}" == 1 ]]; then
  echo "run_pretrain.sh: preempted (exit 3); requeueing job $SLURM_JOB_ID to resume from run.dir" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
if [[ "$STATUS" -eq 4 && -n "$UNHEALTHY" && "${TRILITH_EXCLUDE_UNHEALTHY:-1}" == 1 ]]; then
  requeue_without_unhealthy
fi
exit "$STATUS"
