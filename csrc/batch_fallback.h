// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
// Whether a KVO_COPY_DMA job whose cuMemcpyBatchAsync call failed is resubmitted as a
// cudaMemcpyAsync loop. Header-only and free of CUDA headers, so that the C self-test
// (benchmarks/kv_offload/copy_selftest.cpp, built with a plain C++ compiler) tests it directly.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvo {

// CUresult values of cuda.h, repeated here for the self-test; copy_blocks.cu static_asserts that
// they match cuda.h.
constexpr int kCuErrorInvalidValue = 1;     // CUDA_ERROR_INVALID_VALUE
constexpr int kCuErrorNotSupported = 801;   // CUDA_ERROR_NOT_SUPPORTED

// fail_idx of a failure that the driver did not tie to one copy (the CUDA 13 signature has no
// failIdx at all, so every failure through it is reported so).
constexpr size_t kNoFailIndex = SIZE_MAX;

// True when the failure is the batch API's rather than the memory's, so the loop, which copies the
// same bytes through another API, is expected to work:
//   * CUDA_ERROR_NOT_SUPPORTED: the driver cannot do this batch (an attribute such as the
//     overlap-with-compute flag, or a pair of memory kinds the batch API does not handle);
//   * CUDA_ERROR_INVALID_VALUE not tied to a copy: the call's attributes were refused.
// A failure tied to one copy (INVALID_VALUE at fail_idx), or any other error (an illegal address,
// a lost context, out of memory), fails the job: the loop would fail too or hide a broken context.
// If the memory itself is bad, the loop then fails on it and names the copy.
inline bool batch_failure_falls_back(int result, size_t fail_idx) {
  if (result == kCuErrorNotSupported) return true;
  return result == kCuErrorInvalidValue && fail_idx == kNoFailIndex;
}

}  // namespace kvo
