#!/usr/bin/env bash
# The prepared GPU check of the kernels and the MFU benchmark, sized for one short lease of one GPU
# (at most 9½ minutes of work: each part has its own time limit, and a part that runs out is reported,
# not fatal). Everything it prints also lands in $OUT (default gpu_check_out/):
#   env.txt        GPU, driver, torch / CUDA / flash-attn / apex versions
#   tests.log      the kernel and monitor tests on this machine (CUDA-only ones included; they skip without CUDA)
#   engine/        the engine end to end on this device: 30 bf16 steps of the tiny model with validation,
#                  the training monitor and NVML health on (metrics.jsonl, logs/ with health-<node>.jsonl)
#   bench.md/.json tools/bench_gpu.py: eager backends × recompute modes (flash/apex rows say "skipped"
#                  when those packages are absent)
#   compile.md/.json  compiled blocks and loss kernels (inductor), chunked and fused output loss, 4 sequences
#                  per micro-batch (the best shape measured) × 8 per step (131k tokens: the optimizer's
#                  share nearer a real global batch's), each row with a kernel-time profile
# Usage, from the checkout, with the Python that has CUDA torch:  PY=python3 bash tools/gpu_check.sh
# Without CUDA it still runs (tiny shapes), which is how it was checked on CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
PY="${PY:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

part() {  # part NAME LIMIT_S COMMAND...: run with a time limit, say how it ended
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS status
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@"
  status=$?
  if [[ $status -eq 124 ]]; then echo "=== $name: stopped at its ${limit}s limit"
  else echo "=== $name: exit $status after $((SECONDS - start))s"; fi
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
  "$PY" - <<'EOF'
import importlib, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
for name in ("flash_attn", "apex", "triton"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', 'installed')}")
    except ImportError as exc:
        print(f"{name}: not installed ({exc})")
EOF
} 2>&1 | tee "$OUT/env.txt"

part "kernel tests" 100 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_model.py \
  tests/test_monitor.py -rs 2>&1 | tee "$OUT/tests.log"
part "engine" 50 env TRILITH_PYTHON="$PY" bash launch/run_pretrain.sh --config launch/configs/tiny.yaml \
  "run.dir=$OUT/engine" train.steps=30 train.precision=bf16 train.eval_interval=10 run.monitor_interval=10 \
  run.health_interval=10 2>&1
part "benchmark: eager" 230 "$PY" tools/bench_gpu.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.md"
part "benchmark: compiled" 190 "$PY" tools/bench_gpu.py --attention cudnn flash --norm torch apex --recompute none \
  --loss chunked fused --compile --micro-batch 4 --accum 8 --steps 4 --warmup 1 --profile 12 \
  --json "$OUT/compile.json" 2>&1 | tee "$OUT/compile.md"
