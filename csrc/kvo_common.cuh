// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
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

// Checks `device` (>= 0) and makes it the calling thread's current device, primary context
// included (see "Devices" in kv_offload.h). Every entry point that uses CUDA calls it after its
// argument checks and before any other CUDA call.
int bind_device(int device);

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

// Enqueues the kernel path of kvo_copy_blocks on `stream` of `device` (already current); the
// arguments were checked already.
int copy_blocks_kernel(int device, const KvoCopyRegion* regions, int64_t num_regions,
                       const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs,
                       int max_ctas, cudaStream_t stream);

// Device views (device_views.cu): the address through which a kernel on `device` (current)
// reaches [addr, addr + extent) of region r's side `which`: the address itself for device memory,
// the mapping for pinned and mapped host memory. KVO_ERR_INVALID_ARGUMENT when a kernel cannot
// reach the whole extent. Results for ranges this library registered, and for device memory, are
// remembered (see kvo_copy_blocks).
int device_view(int device, uint64_t addr, uint64_t extent, int64_t r, const char* which,
                uint64_t* out);

// Records a host range this library registered (kvo_host_register), so that device_view resolves
// addresses inside it without a CUDA call.
void note_host_registration(uint64_t base, uint64_t bytes, unsigned int flags);

// Forgets the registration starting at `base` and every device view resolved through it; called
// before the range is unregistered.
void forget_host_registration(uint64_t base);

}  // namespace kvo

#define KVO_CUDA_CHECK(call)                                             \
  do {                                                                   \
    cudaError_t kvo_err_ = (call);                                       \
    if (kvo_err_ != cudaSuccess) return kvo::fail_cuda(kvo_err_, #call); \
  } while (0)
