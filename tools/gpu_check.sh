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
#   offload.md    tools/bench_offload.py at the 1B shape, ZeRO-1 bf16, offload_fraction 0 / 0.5 / 1, overlap
#                  false and auto, 8k and 128k tokens per step (4 × 2048 tokens, × 16 micro-batches): the GPU
#                  step ratio of docs/offload.md's goal (≤ 1.3×). Not in the default PARTS (the four above take
#                  the 9½ minutes): run it in a lease of its own, PARTS=offload
# Usage, from the checkout, with the Python that has CUDA torch:  PY=python3 bash tools/gpu_check.sh
# (PARTS="kernels engine eager compiled offload" picks the parts; the default is the first four)
# Without CUDA it still runs (tiny shapes), which is how it was checked on CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
PY="${PY:-python3}"
mkdir -p "$OUT"
PARTS="${PARTS:-kernels engine eager compiled}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

part() {  # part KEY NAME LIMIT_S COMMAND...: run with a time limit when KEY is in PARTS, say how it ended
  [[ " $PARTS " == *" $1 "* ]] || return 0
  local name="$2" limit="$3"; shift 3
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

part kernels "kernel tests" 100 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_model.py \
  tests/test_monitor.py -rs 2>&1 | tee "$OUT/tests.log"
part engine "engine" 50 env TRILITH_PYTHON="$PY" bash launch/run_pretrain.sh --config launch/configs/tiny.yaml \
  "run.dir=$OUT/engine" train.steps=30 train.precision=bf16 train.eval_interval=10 run.monitor_interval=10 \
  run.health_interval=10 2>&1
part eager "benchmark: eager" 230 "$PY" tools/bench_gpu.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.md"
part compiled "benchmark: compiled" 190 "$PY" tools/bench_gpu.py --attention cudnn flash --norm torch apex --recompute none \
  --loss chunked fused --compile --micro-batch 4 --accum 8 --steps 4 --warmup 1 --profile 12 \
  --json "$OUT/compile.json" 2>&1 | tee "$OUT/compile.md"
SHAPE_1B=(--hidden 2048 --layers 16 --heads 16 --kv-heads 8 --ffn 5632 --vocab 32000 --seq 2048 --batch 4
  --precision bf16 --fractions 0.5,1 --overlap false,auto --steps 4 --warmup 1)
part offload "offload: 1B, 8k tokens per step" 120 "$PY" tools/bench_offload.py "${SHAPE_1B[@]}" --accum 1 2>&1 \
  | tee "$OUT/offload.md"
part offload "offload: 1B, 128k tokens per step" 300 "$PY" tools/bench_offload.py "${SHAPE_1B[@]}" --accum 16 2>&1 \
  | tee -a "$OUT/offload.md"
