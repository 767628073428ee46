// C API of the vllm-kv-offload CUDA copy library.
//
// Loaded from Python with ctypes (vllm/_custom_ops.py): every argument is a plain integer or a raw
// pointer, and a CUDA stream is passed as its handle (cudaStream_t cast to void*). Nothing here
// depends on Python or torch.
//
// Error convention: every function returns a KvoStatus. On failure, kvo_last_error() returns a
// NUL-terminated, thread-local message naming the offending argument or CUDA call; it stays valid
// until the next call into the library from the same thread.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVO_API __attribute__((visibility("default")))

typedef enum KvoStatus {
  KVO_OK = 0,
  KVO_ERR_INVALID_ARGUMENT = 1,  // a bad count, size, pointer or stream; nothing was enqueued
  KVO_ERR_CUDA = 2,              // a CUDA call failed; see kvo_last_error()
} KvoStatus;

// Version of this C API; bumped on any incompatible change. The Python side refuses a mismatch.
KVO_API int kvo_abi_version(void);

// Message of the last failed call on this thread ("" if none).
KVO_API const char* kvo_last_error(void);

// Number of CUDA devices visible to the runtime, in *count (0 when there is no driver or GPU; the
// call still returns KVO_OK in that case).
KVO_API int kvo_device_count(int* count);

// Enqueues n independent copies on `stream`: copy i moves sizes[i] bytes from src_ptrs[i] to
// dst_ptrs[i]. Pointers may be device or host addresses (the direction is inferred from them,
// cudaMemcpyDefault). Host memory should be pinned or host-registered for the copies to be
// asynchronous.
//
// Arguments:
//   dst_ptrs, src_ptrs, sizes: host arrays of n entries (may be NULL only when n == 0).
//   n: number of copies, n >= 0; n == 0 returns KVO_OK at once.
//   stream: the cudaStream_t to enqueue on (NULL means the legacy default stream).
// Requirements: every sizes[i] > 0, every pointer non-zero, and no copy's source and destination
// ranges overlap. Violations return KVO_ERR_INVALID_ARGUMENT before anything is enqueued.
KVO_API int kvo_memcpy_batch(const uint64_t* dst_ptrs, const uint64_t* src_ptrs,
                             const uint64_t* sizes, int64_t n, void* stream);

#ifdef __cplusplus
}  // extern "C"
#endif
