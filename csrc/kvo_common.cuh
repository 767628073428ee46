// Internal helpers shared by the translation units of the copy library (not part of the C API).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kv_offload.h"

namespace kvo {

// Formats the thread-local last-error message and returns `status`.
int fail(int status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Reports a failed CUDA runtime call: clears the runtime's (non-sticky) last error so that a later
// cudaGetLastError() does not blame an unrelated call, and returns KVO_ERR_CUDA.
int fail_cuda(cudaError_t err, const char* what);

// Empties the last-error message; every entry point calls it first.
void clear_error();

// Makes the calling thread's current device's primary context current for the driver API (the
// runtime does this lazily; a driver entry point such as cuMemcpyBatchAsync needs it up front).
int ensure_context();

// Checked addressing of one side of a region (see KvoBlockSide).
inline uint64_t side_address(const KvoBlockSide& s, int64_t id) {
  const uint64_t block = static_cast<uint64_t>(id / s.sub_blocks);
  const uint64_t sub = static_cast<uint64_t>(id % s.sub_blocks);
  return s.base + block * s.block_stride + sub * s.sub_stride;
}

// Validates regions and ids (the contract of kvo_check_copy_blocks).
int check_copy_blocks(const KvoCopyRegion* regions, int64_t num_regions, const int64_t* src_ids,
                      const int64_t* dst_ids, int64_t num_pairs);

// Bytes from base to the end of the last byte any id of `s` can address, for copies of `bytes`
// (valid only for a side that passed the checks).
uint64_t side_extent(const KvoBlockSide& s, uint64_t bytes);

// Enqueues the kernel path of kvo_copy_blocks; the arguments were checked already.
int copy_blocks_kernel(const KvoCopyRegion* regions, int64_t num_regions, const int64_t* src_ids,
                       const int64_t* dst_ids, int64_t num_pairs, int max_ctas,
                       cudaStream_t stream);

}  // namespace kvo

#define KVO_CUDA_CHECK(call)                                  \
  do {                                                        \
    cudaError_t kvo_err_ = (call);                            \
    if (kvo_err_ != cudaSuccess) return kvo::fail_cuda(kvo_err_, #call); \
  } while (0)
