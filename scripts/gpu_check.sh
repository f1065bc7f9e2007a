#!/usr/bin/env bash
# The CUDA checks, in one run of about 6 minutes on a GPU machine (issue #34):
#   1. set-up: DeepSpeed and what it needs beside the machine's CUDA torch, and DeepSpeed's CPU Adam compiled for it
#      (in the background while the tests that do not need it run);
#   2. every test marked `gpu`: ZeRO 1/2/3 with and without offload in fp32, bf16-mixed and 16-mixed (dynamic loss
#      scaling) under the Trainer and Fabric on nccl, each equal to one plain process; the export of a CUDA-trained
#      checkpoint, loaded by a process that sees no GPU;
#   3. bench/train_throughput.py for zero2, zero3 and zero2_offload: the Trainer against the hand-written engine loop,
#      Lightning's own DeepSpeedStrategy and a Fabric loop;
#   4. OUT_DIR/results.json: what passed and failed (with the failures' messages), the figures, the device.
#
#   bash scripts/gpu_check.sh [OUT_DIR]      (default: $OUT where the device tool runs it, else ./gpu_check_out)
#
# Set-up: with GPU_CHECK_WHEELS=DIR the wheels in DIR are installed beside the interpreter's own torch, offline (a
# machine that reaches no registry: carry DeepSpeed, hjson and pydantic as wheels); otherwise, where lightspeed does
# not import, CUDA torch (when the interpreter's torch has no CUDA) and `pip install -e ".[test]"` from the registry.
# PYTHON picks the interpreter (default python3). On a machine without a GPU it is a dry run of every phase: the gpu
# tests report skipped and the benchmark runs briefly on 2 CPU ranks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-$PWD/gpu_check_out}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
SETUP_LOG=$OUT_DIR/setup.log
: >"$SETUP_LOG"
phase_start=$(date +%s)
declare -A SECONDS_OF STATUS_OF
finish_phase() { SECONDS_OF[$1]=$(($(date +%s) - phase_start)); STATUS_OF[$1]=$2; phase_start=$(date +%s); echo "[gpu_check] $1: exit $2 in ${SECONDS_OF[$1]} s"; }

# ------------------------------------------------------------------------------------------------------ 1. set-up
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  site=/tmp/gpu_check_site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$GPU_CHECK_WHEELS"/*.whl >>"$SETUP_LOG" 2>&1
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
elif ! "$PY" -c "import lightspeed, deepspeed, pytest" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    "$PY" -m pip install -q torch >>"$SETUP_LOG" 2>&1  # the registry's default torch is a CUDA build
  fi
  "$PY" -m pip install -q setuptools wheel ninja >>"$SETUP_LOG" 2>&1
  "$PY" -m pip install -q --no-build-isolation -e ".[test]" >>"$SETUP_LOG" 2>&1
fi
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD${PYTHONPATH:+:$PYTHONPATH}
HAS_GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>>"$SETUP_LOG" || echo 0)
{
  echo "== machine"; nvidia-smi 2>&1 | head -15; nproc; free -g | head -2
  "$PY" - <<'PYEOF'
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("deepspeed", "lightning", "torchmetrics", "safetensors", "pydantic", "transformers"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
PYEOF
} >>"$SETUP_LOG" 2>&1
if [ "$HAS_GPU" = 1 ]; then
  # DeepSpeed builds its ops for the card it runs on, once, into a cache every rank shares
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/gpu_check_extensions}
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
  export TORCH_CUDA_ARCH_LIST
  "$PY" -c "
import time; start = time.time()
from deepspeed.ops.op_builder import CPUAdamBuilder
CPUAdamBuilder().load(verbose=False)
print(f'[gpu_check] DeepSpeed CPU Adam built for the device in {time.time() - start:.0f} s')
" >>"$SETUP_LOG" 2>&1 &
  build=$!
else
  echo "[gpu_check] no CUDA device visible: a dry run (gpu tests skip, the benchmark runs briefly on the CPU)" | tee -a "$SETUP_LOG"
  build=""
fi
"$PY" -c "import lightspeed, deepspeed, lightning" >>"$SETUP_LOG" 2>&1
finish_phase setup $?

# ------------------------------------------------------------------------------------------------------ 2. tests
mapfile -t gpu_files < <(grep -rl "pytest.mark.gpu" tests --include="test_*.py" | sort)
parallel=()
# three launches (Trainer, Fabric, export) on one GPU at a time each would take three times as long
if [ "$HAS_GPU" = 1 ] && "$PY" -c "import xdist" >/dev/null 2>&1; then parallel=(-n 4 --dist loadfile); fi
timeout "${GPU_CHECK_TEST_TIMEOUT:-330}" "$PY" -m pytest -m gpu -p no:cacheprovider -rA --timeout 280 "${parallel[@]}" \
  --junitxml="$OUT_DIR/junit.xml" -o junit_family=xunit1 "${gpu_files[@]}" >"$OUT_DIR/pytest.log" 2>&1
finish_phase tests $?
tail -5 "$OUT_DIR/pytest.log"
[ -n "$build" ] && { wait "$build"; echo "[gpu_check] CPU Adam build exit $?" >>"$SETUP_LOG"; }

# ------------------------------------------------------------------------------------------------------ 3. benchmark
if [ "$HAS_GPU" = 1 ]; then
  bench_args=(--names zero2,zero3,zero2_offload --devices 1 --warmup 3 --steps 20 --repeats 3)
else
  bench_args=(--names zero2 --devices 2 --warmup 1 --steps 2 --repeats 1)
fi
timeout "${GPU_CHECK_BENCH_TIMEOUT:-200}" "$PY" bench/train_throughput.py "${bench_args[@]}" \
  --json "$OUT_DIR/throughput.json" >"$OUT_DIR/bench.log" 2>&1
finish_phase bench $?
tail -12 "$OUT_DIR/bench.log"

# ------------------------------------------------------------------------------------------------------ 4. results
phases=$(for p in setup tests bench; do printf '%s=%s:%s ' "$p" "${STATUS_OF[$p]}" "${SECONDS_OF[$p]}"; done)
"$PY" scripts/gpu_check_report.py "$OUT_DIR" $phases
