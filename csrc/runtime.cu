// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
// Error plumbing, devices, stream, event and memory entry points of the copy library.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>

#include "kv_offload.h"
#include "kvo_common.cuh"

namespace kvo {
namespace {

thread_local char g_last_error[512] = "";

// "13.0" from 13000 (CUDA's version encoding).
void format_version(int v, char* out, size_t size) {
  std::snprintf(out, size, "%d.%d", v / 1000, (v % 1000) / 10);
}

}  // namespace

int fail(int status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return status;
}

int fail_cuda(cudaError_t err, const char* what) {
  cudaGetLastError();
  return fail(KVO_ERR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorString(err),
              cudaGetErrorName(err));
}

void clear_error() { g_last_error[0] = '\0'; }

int bind_device(int device) {
  if (device < 0) return fail(KVO_ERR_INVALID_ARGUMENT, "device=%d must be >= 0", device);
  // Also when `device` is current already: on a thread that never used CUDA the runtime has not
  // made its primary context current yet, which the driver API (cuMemcpyBatchAsync) needs.
  const cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return fail(KVO_ERR_CUDA, "cudaSetDevice(%d) failed: %s (%s)", device,
                cudaGetErrorString(err), cudaGetErrorName(err));
  }
  return KVO_OK;
}

}  // namespace kvo

using kvo::bind_device;
using kvo::clear_error;
using kvo::fail;

// Argument checks run before bind_device, so that they work without a GPU and a bad argument is
// reported as such rather than as whatever CUDA says about the device.
#define KVO_BIND(device)                               \
  do {                                                 \
    if (int kvo_rc_ = bind_device(device); kvo_rc_ != KVO_OK) return kvo_rc_; \
  } while (0)

extern "C" {

int kvo_abi_version(void) { return KVO_ABI_VERSION; }

int kvo_copy_region_size(void) { return static_cast<int>(sizeof(KvoCopyRegion)); }

const char* kvo_last_error(void) { return kvo::g_last_error; }

int kvo_device_count(int* count) {
  clear_error();
  if (count == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "count must be non-NULL");
  *count = 0;
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaSuccess) {
    *count = n;
    return KVO_OK;
  }
  cudaGetLastError();
  if (err == cudaErrorNoDevice) return KVO_OK;  // a working driver that sees no GPU
  // Every other failure makes CUDA unusable in this process; say why, since "0 devices" would
  // read as "no GPU" when the usual cause is a driver older than the runtime linked in here.
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) {
    cudaGetLastError();
    driver = 0;
  }
  char runtime_v[16], driver_v[16];
  kvo::format_version(CUDART_VERSION, runtime_v, sizeof(runtime_v));
  kvo::format_version(driver, driver_v, sizeof(driver_v));
  if (driver == 0) {
    return fail(KVO_ERR_CUDA,
                "cudaGetDeviceCount failed: %s (%s); no NVIDIA driver is loaded (libcuda.so.1 "
                "not found)",
                cudaGetErrorString(err), cudaGetErrorName(err));
  }
  if (driver < CUDART_VERSION) {
    return fail(KVO_ERR_CUDA,
                "cudaGetDeviceCount failed: %s (%s); the NVIDIA driver supports CUDA %s but this "
                "library was built with the CUDA %s runtime: install a newer driver (CUDA 13.x "
                "needs R580 or newer) or rebuild csrc/ with a CUDA toolkit of at most %s "
                "(CUDACXX=/path/to/nvcc or CUDA_HOME)",
                cudaGetErrorString(err), cudaGetErrorName(err), driver_v, runtime_v, driver_v);
  }
  return fail(KVO_ERR_CUDA,
              "cudaGetDeviceCount failed: %s (%s); driver CUDA %s, library built with CUDA %s",
              cudaGetErrorString(err), cudaGetErrorName(err), driver_v, runtime_v);
}

// --------------------------------------------------------------------------------------------
// Streams and events
// --------------------------------------------------------------------------------------------

int kvo_stream_create(int device, void** stream, int priority) {
  clear_error();
  if (stream == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "stream must be non-NULL");
  *stream = nullptr;
  KVO_BIND(device);
  int least = 0, greatest = 0;
  KVO_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  // Numerically lower is higher priority: greatest <= priority <= least.
  const int clamped = std::min(least, std::max(greatest, priority));
  cudaStream_t s = nullptr;
  KVO_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, clamped));
  *stream = s;
  return KVO_OK;
}

int kvo_stream_destroy(int device, void* stream) {
  clear_error();
  if (stream == nullptr) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "stream must be a stream created by kvo_stream_create");
  }
  KVO_BIND(device);
  KVO_CUDA_CHECK(cudaStreamDestroy(static_cast<cudaStream_t>(stream)));
  return KVO_OK;
}

int kvo_stream_synchronize(int device, void* stream) {
  clear_error();
  KVO_BIND(device);
  KVO_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return KVO_OK;
}

int kvo_stream_wait_event(int device, void* stream, void* event) {
  clear_error();
  if (event == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "event must be non-NULL");
  KVO_BIND(device);
  KVO_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
  return KVO_OK;
}

int kvo_event_create(int device, void** event, int enable_timing) {
  clear_error();
  if (event == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "event must be non-NULL");
  *event = nullptr;
  KVO_BIND(device);
  cudaEvent_t e = nullptr;
  KVO_CUDA_CHECK(
      cudaEventCreateWithFlags(&e, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
  *event = e;
  return KVO_OK;
}

int kvo_event_destroy(int device, void* event) {
  clear_error();
  if (event == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "event must be non-NULL");
  KVO_BIND(device);
  KVO_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  return KVO_OK;
}

int kvo_event_record(int device, void* event, void* stream) {
  clear_error();
  if (event == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "event must be non-NULL");
  KVO_BIND(device);
  KVO_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
  return KVO_OK;
}

int kvo_event_query(int device, void* event, int* done) {
  clear_error();
  if (event == nullptr || done == nullptr) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "event and done must be non-NULL");
  }
  *done = 0;
  KVO_BIND(device);
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return KVO_OK;
  }
  if (err != cudaSuccess) return kvo::fail_cuda(err, "cudaEventQuery");
  *done = 1;
  return KVO_OK;
}

int kvo_event_synchronize(int device, void* event) {
  clear_error();
  if (event == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "event must be non-NULL");
  KVO_BIND(device);
  KVO_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  return KVO_OK;
}

int kvo_event_elapsed_ms(int device, void* start, void* end, float* ms) {
  clear_error();
  if (start == nullptr || end == nullptr || ms == nullptr) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "start, end and ms must be non-NULL");
  }
  KVO_BIND(device);
  KVO_CUDA_CHECK(
      cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
  return KVO_OK;
}

// --------------------------------------------------------------------------------------------
// Host memory
// --------------------------------------------------------------------------------------------

int kvo_host_register(int device, void* ptr, uint64_t bytes, unsigned int flags,
                      int* already_registered) {
  clear_error();
  if (already_registered != nullptr) *already_registered = 0;
  if (ptr == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "ptr must be non-NULL");
  if (bytes == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "bytes must be > 0");
  if (reinterpret_cast<uint64_t>(ptr) > UINT64_MAX - bytes) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "range [%p, +%llu) wraps around the address space", ptr,
                (unsigned long long)bytes);
  }
  constexpr unsigned int kKnown = KVO_HOST_REGISTER_PORTABLE | KVO_HOST_REGISTER_MAPPED;
  if ((flags & ~kKnown) != 0) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "flags=%#x has bits outside KVO_HOST_REGISTER_*", flags);
  }
  KVO_BIND(device);
  const cudaError_t err = cudaHostRegister(ptr, static_cast<size_t>(bytes), flags);
  if (err == cudaErrorHostMemoryAlreadyRegistered) {
    cudaGetLastError();
    if (already_registered != nullptr) *already_registered = 1;
    return KVO_OK;
  }
  if (err != cudaSuccess) return kvo::fail_cuda(err, "cudaHostRegister");
  kvo::note_host_registration(reinterpret_cast<uint64_t>(ptr), bytes, flags);
  return KVO_OK;
}

int kvo_host_unregister(int device, void* ptr) {
  clear_error();
  if (ptr == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "ptr must be non-NULL");
  KVO_BIND(device);
  // Forgotten first: a kernel job resolving an address from now on probes CUDA and is refused
  // once the range is unregistered, instead of using a mapping that is going away.
  kvo::forget_host_registration(reinterpret_cast<uint64_t>(ptr));
  KVO_CUDA_CHECK(cudaHostUnregister(ptr));
  return KVO_OK;
}

// --------------------------------------------------------------------------------------------
// Test support
// --------------------------------------------------------------------------------------------

int kvo_device_malloc(int device, uint64_t bytes, uint64_t* ptr) {
  clear_error();
  if (ptr == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "ptr must be non-NULL");
  *ptr = 0;
  if (bytes == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "bytes must be > 0");
  KVO_BIND(device);
  void* p = nullptr;
  KVO_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(bytes)));
  *ptr = reinterpret_cast<uint64_t>(p);
  return KVO_OK;
}

int kvo_device_free(int device, uint64_t ptr) {
  clear_error();
  if (ptr == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "ptr must be non-zero");
  KVO_BIND(device);
  KVO_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(ptr)));
  return KVO_OK;
}

int kvo_memcpy_sync(int device, uint64_t dst, uint64_t src, uint64_t bytes) {
  clear_error();
  if (dst == 0 || src == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "dst and src must be non-zero");
  if (dst > UINT64_MAX - bytes || src > UINT64_MAX - bytes) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "a range wraps around the address space");
  }
  if (bytes == 0) return KVO_OK;
  KVO_BIND(device);
  KVO_CUDA_CHECK(cudaMemcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                            static_cast<size_t>(bytes), cudaMemcpyDefault));
  return KVO_OK;
}

int kvo_memset_sync(int device, uint64_t ptr, int value, uint64_t bytes) {
  clear_error();
  if (ptr == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "ptr must be non-zero");
  if (ptr > UINT64_MAX - bytes) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "the range wraps around the address space");
  }
  if (bytes == 0) return KVO_OK;
  KVO_BIND(device);
  KVO_CUDA_CHECK(cudaMemsetAsync(reinterpret_cast<void*>(ptr), value, static_cast<size_t>(bytes),
                                 cudaStreamLegacy));
  KVO_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  return KVO_OK;
}

}  // extern "C"
