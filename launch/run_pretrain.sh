#!/usr/bin/env bash
# Start Trilith pretraining: one script for local, torchrun, SLURM and MPI runs.
#   launch/run_pretrain.sh --config FILE [section.key=value ...]               one process
#   launch/run_pretrain.sh --nproc N --config FILE [overrides]                 N local processes (gloo/nccl)
#   launch/run_pretrain.sh --nproc N --nnodes M --node-rank R --master-addr HOST --config FILE   node R of M
#   sbatch launch/run_pretrain.sh --config FILE                                SLURM batch (defaults below)
#   srun launch/run_pretrain.sh --config FILE                                  one task per rank in an allocation
#   mpirun -np N launch/run_pretrain.sh --config FILE                          Open MPI / MPICH
#   launch/run_pretrain.sh --preflight [--nproc N] --config FILE               scaled-down check, pass/fail report
#   launch/run_pretrain.sh --dry-run --world-size N [--ranks all|cover|LIST] --config FILE   every rank's program
#       on one CPU (fake process group, meta tensors): schedule, memory and volumes checked (engine/dry_run)
#   --max-restarts K (with --nproc, or in an sbatch job): after a failure (a rank died, a collective timed
#   out), start all ranks again, up to K times; they resume from the latest checkpoint.
# Exit status: 0 done, 2 configuration error (or run.dir in use by a live training), 3 preempted after a
# checkpoint (a SLURM batch job requeues itself), 4 stopped by a GPU-health threshold after a checkpoint (a
# SLURM batch job requeues itself without the node(s) named; TRILITH_EXCLUDE_UNHEALTHY=0 stops instead),
# anything else: failure.
#
# SLURM defaults: edit, or override on the sbatch command line (sbatch --nodes=4 ...).
# One rank per task, one task per GPU. Only --ntasks-per-node is set here: sbatch --nodes=N gives N × 8 ranks,
# --ntasks-per-node=K K per node, sbatch -n M M ranks on as many nodes as they need. A --ntasks here would
# win over a command line's --nodes × --ntasks-per-node, and a --nodes would refuse an -n that needs more.
# The rule: SLURM refuses any job whose nodes declare fewer than ntasks-per-node × cpus-per-task CPUs
# ("Requested node configuration is not available"), even -n 2 -c 1 on a node of 2 cores: on smaller nodes
# pass both, e.g. sbatch -n 4 --ntasks-per-node=2 -c 1 (K × c ≤ the node's CPUs).
#SBATCH --job-name=trilith
#SBATCH --ntasks-per-node=8
##SBATCH --gpus-per-node=8        # GPU clusters: remove one # (each rank picks its GPU by local rank)
#SBATCH --cpus-per-task=8            # per rank: data-loading threads and OMP_NUM_THREADS; × tasks ≤ cores per node
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
    --dry-run) MODULE=engine.dry_run; shift ;;  # one process: --world-size, --ranks, --jobs go to it
    *) ARGS+=("$1"); shift ;;
  esac
done
for v in "$NPROC" "$NNODES" "$NODE_RANK" "$MAX_RESTARTS"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "run_pretrain.sh: --nproc/--nnodes/--node-rank/--max-restarts must be integers, got '$v'" >&2; exit 2; }
done

# The stop file, the pre-start check and the restart loop (--max-restarts) that both launching paths share.
source "$ROOT/launch/lib/attempts.sh"

cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# sbatch: this shell is the batch script, not a rank. It starts one rank per task with srun, restarts and
# requeues (launch/lib/batch_shell.sh), and exits there.
if [[ -n "${SLURM_JOB_ID:-}" && -z "${SLURM_STEP_ID:-}" && -z "${RANK:-}" && "$NPROC" -eq 1 ]]; then
  source "$ROOT/launch/lib/batch_shell.sh"
fi

# Below: one rank (an srun or MPI task, or the single process), or this machine's ranks under torchrun.
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

# --nproc / --nnodes: start this node's ranks under torchrun (launch/lib/local_ranks.sh), which exits there.
if [[ "$NPROC" -gt 1 || "$NNODES" -gt 1 ]]; then
  source "$ROOT/launch/lib/local_ranks.sh"
fi
exec "$PY" -m "$MODULE" "${ARGS[@]}"
