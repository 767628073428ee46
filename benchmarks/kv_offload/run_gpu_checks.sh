#!/usr/bin/env bash
# GPU checks of the CUDA copy library and the GPU<->CPU handlers, prepared for a GPU session.
#
# Usage (from anywhere):  [OUT=dir] [ARCHS="90"] benchmarks/kv_offload/run_gpu_checks.sh
#
# 1. Builds csrc/ with CMake + nvcc into vllm/_kv_offload_cuda<suffix> (skipped, keeping an
#    existing library, when nvcc or cmake is missing).
# 2. Builds and runs the standalone C self-test (benchmarks/kv_offload/copy_selftest.cpp): needs
#    only g++ and the library; bit-exact round trips for every copy method + a throughput table.
# 3. If python has torch, numpy, pytest and hypothesis: runs the CUDA tests (-m cuda, with
#    skip reasons) and then the whole of the copy/handler test files.
# 4. Runs bench_copy.py (every path) and a kernel-path max_ctas sweep for small blocks.
# Everything is logged to $OUT/run_gpu_checks.log (default OUT=build/gpu_checks); tables go to
# $OUT/*.md / *.json. Exits non-zero if any step failed. Each step has a time limit.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu_checks}
mkdir -p "$OUT" build
exec > >(tee "$OUT/run_gpu_checks.log") 2>&1

failed=()
step() {
  local name=$1
  shift
  echo "::: ${name}"
  local t0=$SECONDS
  if "$@"; then
    echo "::: ${name}: ok ($((SECONDS - t0)) s)"
  else
    echo "::: ${name}: FAILED (exit $?, $((SECONDS - t0)) s)"
    failed+=("${name}")
  fi
}

echo "date: $(date -u)"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
  --format=csv 2>/dev/null || echo "nvidia-smi unavailable"
nproc

PY=python3
if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import numpy" 2>/dev/null; then
  PY=.venv/bin/python
fi
SUFFIX=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX') or '.so')" 2>/dev/null || echo .so)
LIB="vllm/_kv_offload_cuda${SUFFIX}"
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}

build_library() {
  if [[ ! -x "$NVCC" ]] || ! command -v cmake >/dev/null; then
    echo "nvcc ($NVCC) or cmake missing: keeping the existing library"
    ls -l vllm/_kv_offload_cuda*.so
    return
  fi
  "$NVCC" --version | tail -n 2
  timeout 600 cmake -S . -B build/gpu_checks_cmake -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="${ARCHS:-90}" \
    -DKVO_OUTPUT_DIR="$PWD/vllm" -DKVO_OUTPUT_NAME="$(basename "$LIB")" >/dev/null &&
    timeout 600 cmake --build build/gpu_checks_cmake --parallel "$(nproc)" &&
    ls -l "$LIB"
}

selftest() {
  local lib
  lib=$(ls vllm/_kv_offload_cuda*.so | head -n 1) || return 1
  g++ -O2 -std=c++17 -Icsrc benchmarks/kv_offload/copy_selftest.cpp "$lib" \
    -Wl,-rpath,"$PWD/vllm" -o build/copy_selftest &&
    timeout 300 build/copy_selftest | tee "$OUT/copy_selftest.txt"
  return "${PIPESTATUS[0]}"
}

have_python_deps() {
  "$PY" -c "import torch, numpy, pytest, hypothesis" 2>/dev/null
}

cuda_tests() {
  PYTHONPATH=$PWD timeout 600 "$PY" -m pytest -p no:cacheprovider -m cuda -rs -v \
    tests/test_custom_ops.py tests/v1/kv_offload/cpu/test_gpu_worker.py \
    --junitxml="$OUT/cuda_tests.xml"
}

all_copy_tests() {
  PYTHONPATH=$PWD timeout 600 "$PY" -m pytest -p no:cacheprovider -q -rs \
    tests/test_custom_ops.py tests/v1/kv_offload/cpu/test_gpu_worker.py \
    tests/v1/kv_offload/worker
}

bench() {
  PYTHONPATH=$PWD timeout 600 "$PY" benchmarks/kv_offload/bench_copy.py --reps 9 \
    --markdown "$OUT/bench_copy.md" --json "$OUT/bench_copy.json"
}

ctas_sweep() {
  local n
  for n in 4 8 16 32 64; do
    echo "max_ctas=$n"
    PYTHONPATH=$PWD timeout 300 "$PY" benchmarks/kv_offload/bench_copy.py --paths cuda \
      --block-kib 16 64 --reps 7 --max-ctas "$n" --markdown "$OUT/bench_ctas_$n.md" || return 1
  done
}

step build-library build_library
step c-selftest selftest
if have_python_deps; then
  step cuda-tests cuda_tests
  step all-copy-tests all_copy_tests
  step bench-copy bench
  step kernel-ctas-sweep ctas_sweep
else
  echo "::: python tests and bench_copy: SKIPPED ($PY lacks torch/numpy/pytest/hypothesis);"
  echo "    the C self-test above covers the CUDA paths"
fi

if ((${#failed[@]})); then
  echo "FAILED steps: ${failed[*]}"
  exit 1
fi
echo "all GPU checks passed"
