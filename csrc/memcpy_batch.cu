// Batched memcpy entry point and the library's shared error plumbing.
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>

#include "kv_offload.h"

namespace {

constexpr int kAbiVersion = 1;
thread_local char g_last_error[512] = "";

int fail(int status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return status;
}

int check_batch_args(const uint64_t* dst_ptrs, const uint64_t* src_ptrs, const uint64_t* sizes,
                     int64_t n) {
  if (n < 0) return fail(KVO_ERR_INVALID_ARGUMENT, "n=%lld must be >= 0", (long long)n);
  if (n > 0 && (dst_ptrs == nullptr || src_ptrs == nullptr || sizes == nullptr)) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "dst_ptrs, src_ptrs and sizes must be non-NULL when n=%lld",
                (long long)n);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (sizes[i] == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "sizes[%lld] is 0", (long long)i);
    if (dst_ptrs[i] == 0 || src_ptrs[i] == 0) {
      return fail(KVO_ERR_INVALID_ARGUMENT, "copy %lld has a null pointer", (long long)i);
    }
    const uint64_t d = dst_ptrs[i], s = src_ptrs[i], len = sizes[i];
    if (d < s + len && s < d + len) {
      return fail(KVO_ERR_INVALID_ARGUMENT, "copy %lld: source and destination overlap",
                  (long long)i);
    }
  }
  return KVO_OK;
}

}  // namespace

extern "C" {

int kvo_abi_version(void) { return kAbiVersion; }

const char* kvo_last_error(void) { return g_last_error; }

int kvo_device_count(int* count) {
  g_last_error[0] = '\0';
  if (count == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "count must be non-NULL");
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    n = 0;
  }
  *count = n;
  return KVO_OK;
}

int kvo_memcpy_batch(const uint64_t* dst_ptrs, const uint64_t* src_ptrs, const uint64_t* sizes,
                     int64_t n, void* stream) {
  g_last_error[0] = '\0';
  if (int rc = check_batch_args(dst_ptrs, src_ptrs, sizes, n); rc != KVO_OK) return rc;
  auto s = static_cast<cudaStream_t>(stream);
  for (int64_t i = 0; i < n; ++i) {
    cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(dst_ptrs[i]),
                                      reinterpret_cast<const void*>(src_ptrs[i]), sizes[i],
                                      cudaMemcpyDefault, s);
    if (err != cudaSuccess) {
      return fail(KVO_ERR_CUDA, "cudaMemcpyAsync failed at copy %lld of %lld: %s", (long long)i,
                  (long long)n, cudaGetErrorString(err));
    }
  }
  return KVO_OK;
}

}  // extern "C"
