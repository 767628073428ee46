#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
# GPU checks of the CUDA copy library, the GPU<->CPU handlers and the engine on a GPU, in one go.
#
# Usage (from anywhere):
#   [OUT=dir] [BUDGET_S=570] [ARCHS=90] [FORCE_BUILD=1] [ONLY="step ..."] [PYTHON=python3] \
#     benchmarks/kv_offload/run_gpu_checks.sh
#
# Steps (each with its own time limit, all within BUDGET_S seconds in total; a step that would
# start with too little time left is skipped and reported):
#   build-library  builds csrc/ with CMake + nvcc into vllm/ when no library is there (or with
#                  FORCE_BUILD=1); otherwise uses the library found (any vllm/_kv_offload_cuda*.so:
#                  it has no Python ABI).
#   preflight      the library loads, has this checkout's ABI and sees a GPU (else the reason, e.g.
#                  a driver older than the library's CUDA runtime), and torch sees a GPU.
#   c-selftest     builds benchmarks/kv_offload/copy_selftest.cpp (g++ and the library only) and
#                  runs it: bit-exact round trips of every copy method, device binding, then a
#                  throughput table; then twice more with a forced cuMemcpyBatchAsync result: 801
#                  (must fall back to the loop, bit-exact) and 700 (must fail, naming it).
#   cuda-tests     every test marked cuda (python -m pytest -m cuda tests): the library, the
#                  handlers over library and torch CUDA memory, the engine and `run` on cuda,
#                  the transformer's batch invariance and loads on cuda.
#   bench-copy     benchmarks/kv_offload/bench_copy.py, every path.
#   ctas-sweep     kernel path max_ctas 8 and 32 for 16 KiB blocks (16 is the default, measured by
#                  bench-copy).
#   cli-run        python -m vllm.entrypoints.cli.main run --device cuda on a small workload, with
#                  the transformer (preset small) computing on the GPU
#                  (RUN_DEVICE=cpu runs it on the CPU, to try the script without a GPU).
#   full-tests     the whole test suite (python -m pytest -q -x), with whatever time is left.
#
# Needs on the machine: python3 with torch (CUDA build), numpy, pytest, hypothesis, msgspec and
# pytest-asyncio (the engine and the CLI need msgspec; the async tests pytest-asyncio); g++;
# nvcc + cmake only to build the library. Writes at most 8 files under $OUT (default
# build/gpu_checks): run_gpu_checks.log (everything), copy_selftest.txt, cuda_tests.xml,
# bench_copy.md, bench_copy.json, bench_ctas.md, run_cuda.json, full_tests.xml.
# Exits non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu_checks}
BUDGET_S=${BUDGET_S:-570}
mkdir -p "$OUT" build
exec > >(tee "$OUT/run_gpu_checks.log") 2>&1

failed=()
skipped=()
STEP_LIMIT=0
# step NAME MAX_SECONDS FUNCTION: runs FUNCTION with STEP_LIMIT = min(MAX_SECONDS, time left).
step() {
  local name=$1 want=$2
  shift 2
  if [[ -n "${ONLY:-}" && " ${ONLY} " != *" ${name} "* ]]; then
    return
  fi
  local left=$((BUDGET_S - SECONDS - 5))
  if ((left < 20)); then
    echo "::: ${name}: SKIPPED (${left} s of the ${BUDGET_S} s budget left)"
    skipped+=("${name}")
    return
  fi
  STEP_LIMIT=$((want < left ? want : left))
  echo "::: ${name} (limit ${STEP_LIMIT} s, at ${SECONDS} s)"
  local t0=$SECONDS
  if "$@"; then
    echo "::: ${name}: ok ($((SECONDS - t0)) s)"
  else
    echo "::: ${name}: FAILED (exit $?, $((SECONDS - t0)) s)"
    failed+=("${name}")
  fi
}

PY=${PYTHON:-python3}
if [[ -z "${PYTHON:-}" && -x .venv/bin/python ]] && .venv/bin/python -c "import numpy" 2>/dev/null; then
  PY=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
NVCC=${CUDACXX:-${CUDA_HOME:+$CUDA_HOME/bin/nvcc}}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}

echo "date: $(date -u)"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
  --format=csv 2>/dev/null || echo "nvidia-smi unavailable"
echo "cpus: $(nproc)"
"$PY" - <<'PY' || echo "python environment incomplete (see above)"
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "numpy", "pytest", "hypothesis", "msgspec", "pytest_asyncio"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name} {getattr(mod, '__version__', '?')}")
    except ImportError:
        print(f"  {name} MISSING")
import torch
print("  torch CUDA", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("  device 0:", torch.cuda.get_device_name(0))
PY

library() {
  ls vllm/_kv_offload_cuda*.so 2>/dev/null | head -n 1
}

build_library() {
  if [[ -n "$(library)" && -z "${FORCE_BUILD:-}" ]]; then
    echo "using $(library) (FORCE_BUILD=1 rebuilds it)"
    return 0
  fi
  if [[ ! -x "$NVCC" ]] || ! command -v cmake >/dev/null; then
    echo "no library and no nvcc ($NVCC) or cmake to build one"
    return 1
  fi
  local suffix
  suffix=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX') or '.so')")
  "$NVCC" --version | tail -n 2
  timeout "$STEP_LIMIT" cmake -S . -B build/gpu_checks_cmake -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="${ARCHS:-90}" \
    -DKVO_OUTPUT_DIR="$PWD/vllm" -DKVO_OUTPUT_NAME="_kv_offload_cuda${suffix}" >/dev/null &&
    timeout "$STEP_LIMIT" cmake --build build/gpu_checks_cmake --parallel "$(nproc)" &&
    ls -l vllm/_kv_offload_cuda*.so
}

preflight() {
  timeout "$STEP_LIMIT" "$PY" - <<'PY'
import sys
from vllm import _custom_ops as ops
lib = ops.cuda_library()
devices = ops.cuda_devices()
print("library:", lib, "ABI", ops.ABI_VERSION)
print("GPUs:", devices.count, devices.problem)
if lib is None or devices.count == 0:
    sys.exit("the CUDA copy library is unusable: " + devices.problem)
print("backend:", ops.copy_backend(), "| cuMemcpyBatchAsync:", lib.dma_batch_available())
import torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no GPU: the torch CUDA tests would all be skipped")
PY
}

selftest() {
  local lib
  lib=$(library) || return 1
  g++ -O2 -std=c++17 -pthread -Icsrc benchmarks/kv_offload/copy_selftest.cpp "$lib" \
    -Wl,-rpath,"$PWD/vllm" -o build/copy_selftest || return 1
  (
    rc=0
    echo "== copy_selftest"
    timeout "$STEP_LIMIT" build/copy_selftest || rc=1
    echo "== copy_selftest --forced-batch-result=801 (falls back to the loop)"
    timeout 60 build/copy_selftest --forced-batch-result=801 || rc=1
    echo "== copy_selftest --forced-batch-result=700 (fails, naming CUDA_ERROR_ILLEGAL_ADDRESS)"
    timeout 60 build/copy_selftest --forced-batch-result=700 || rc=1
    exit $rc
  ) | tee "$OUT/copy_selftest.txt"
  return "${PIPESTATUS[0]}"
}

cuda_tests() {
  timeout "$STEP_LIMIT" "$PY" -m pytest -p no:cacheprovider -m cuda -rs -q tests \
    --junitxml="$OUT/cuda_tests.xml"
}

bench() {
  timeout "$STEP_LIMIT" "$PY" benchmarks/kv_offload/bench_copy.py --reps 7 \
    --markdown "$OUT/bench_copy.md" --json "$OUT/bench_copy.json"
}

ctas_sweep() {
  local n md
  : >"$OUT/bench_ctas.md"
  for n in 8 32; do
    md=$(mktemp)
    timeout "$STEP_LIMIT" "$PY" benchmarks/kv_offload/bench_copy.py --paths cuda --block-kib 16 \
      --reps 5 --max-ctas "$n" --markdown "$md" || return 1
    { echo "## max_ctas=$n"; cat "$md"; echo; } >>"$OUT/bench_ctas.md"
    rm -f "$md"
  done
}

cli_run() {
  local fs
  fs=$(mktemp -d)
  timeout "$STEP_LIMIT" "$PY" -m vllm.entrypoints.cli.main run --device "${RUN_DEVICE:-cuda}" \
    --workload documents --num-clients 2 --num-sessions 12 --turns 2 --document-tokens 512 \
    --num-documents 6 --turn-tokens 32 --output-tokens 4 --think-time 0.001 \
    --model transformer --model-preset small --block-size 16 --gpu-blocks 96 --max-num-seqs 4 \
    --max-num-batched-tokens 256 --cpu-bytes 8MiB --fs-root "$fs" --no-progress --timeout 240 \
    --json "$OUT/run_cuda.json"
  local rc=$?
  rm -rf "$fs"
  return $rc
}

full_tests() {
  timeout "$STEP_LIMIT" "$PY" -m pytest -p no:cacheprovider -q -x tests \
    --junitxml="$OUT/full_tests.xml"
}

step build-library 240 build_library
step preflight 60 preflight
step c-selftest 120 selftest
step cuda-tests 240 cuda_tests
step bench-copy 120 bench
step ctas-sweep 60 ctas_sweep
step cli-run 120 cli_run
step full-tests 600 full_tests

echo "elapsed: ${SECONDS} s of ${BUDGET_S} s"
if ((${#skipped[@]})); then
  echo "SKIPPED for time: ${skipped[*]}"
fi
if ((${#failed[@]})); then
  echo "FAILED steps: ${failed[*]}"
  exit 1
fi
echo "all GPU checks passed"
