// Error plumbing, device, stream, event and memory entry points of the copy library.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>

#include "kv_offload.h"
#include "kvo_common.cuh"

namespace kvo {
namespace {

thread_local char g_last_error[512] = "";

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

int ensure_context() {
  // cudaSetDevice makes the device's primary context current on this thread (initialising it if
  // needed), which the runtime otherwise only does lazily on its own calls.
  int device = 0;
  KVO_CUDA_CHECK(cudaGetDevice(&device));
  KVO_CUDA_CHECK(cudaSetDevice(device));
  return KVO_OK;
}

}  // namespace kvo

using kvo::clear_error;
using kvo::fail;

extern "C" {

int kvo_abi_version(void) { return KVO_ABI_VERSION; }

int kvo_copy_region_size(void) { return static_cast<int>(sizeof(KvoCopyRegion)); }

const char* kvo_last_error(void) { return kvo::g_last_error; }

int kvo_device_count(int* count) {
  clear_error();
  if (count == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "count must be non-NULL");
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for this query
    n = 0;
  }
  *count = n;
  return KVO_OK;
}

int kvo_get_device(int* device) {
  clear_error();
  if (device == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "device must be non-NULL");
  KVO_CUDA_CHECK(cudaGetDevice(device));
  return KVO_OK;
}

int kvo_set_device(int device) {
  clear_error();
  if (device < 0) return fail(KVO_ERR_INVALID_ARGUMENT, "device=%d must be >= 0", device);
  KVO_CUDA_CHECK(cudaSetDevice(device));
  return KVO_OK;
}

// --------------------------------------------------------------------------------------------
// Streams and events
// --------------------------------------------------------------------------------------------

int kvo_stream_create(void** stream, int priority) {
  clear_error();
  if (stream == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "stream must be non-NULL");
  *stream = nullptr;
  int least = 0, greatest = 0;
  KVO_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  // Numerically lower is higher priority: greatest <= priority <= least.
  const int clamped = std::min(least, std::max(greatest, priority));
  cudaStream_t s = nullptr;
  KVO_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, clamped));
  *stream = s;
  return KVO_OK;
}

int kvo_stream_destroy(void* stream) {
  clear_error();
  if (stream == nullptr) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "stream must be a stream created by kvo_stream_create");
  }
  KVO_CUDA_CHECK(cudaStreamDestroy(static_cast<cudaStream_t>(stream)));
  return KVO_OK;
}

int kvo_stream_synchronize(void* stream) {
  clear_error();
  KVO_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return KVO_OK;
}

int kvo_stream_wait_event(void* stream, void* event) {
  clear_error();
  if (event == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "event must be non-NULL");
  KVO_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
  return KVO_OK;
}

int kvo_event_create(void** event, int enable_timing) {
  clear_error();
  if (event == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "event must be non-NULL");
  *event = nullptr;
  cudaEvent_t e = nullptr;
  KVO_CUDA_CHECK(
      cudaEventCreateWithFlags(&e, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
  *event = e;
  return KVO_OK;
}

int kvo_event_destroy(void* event) {
  clear_error();
  if (event == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "event must be non-NULL");
  KVO_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  return KVO_OK;
}

int kvo_event_record(void* event, void* stream) {
  clear_error();
  if (event == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "event must be non-NULL");
  KVO_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
  return KVO_OK;
}

int kvo_event_query(void* event, int* done) {
  clear_error();
  if (event == nullptr || done == nullptr) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "event and done must be non-NULL");
  }
  *done = 0;
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return KVO_OK;
  }
  if (err != cudaSuccess) return kvo::fail_cuda(err, "cudaEventQuery");
  *done = 1;
  return KVO_OK;
}

int kvo_event_synchronize(void* event) {
  clear_error();
  if (event == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "event must be non-NULL");
  KVO_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  return KVO_OK;
}

int kvo_event_elapsed_ms(void* start, void* end, float* ms) {
  clear_error();
  if (start == nullptr || end == nullptr || ms == nullptr) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "start, end and ms must be non-NULL");
  }
  KVO_CUDA_CHECK(
      cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
  return KVO_OK;
}

// --------------------------------------------------------------------------------------------
// Memory
// --------------------------------------------------------------------------------------------

int kvo_host_register(void* ptr, uint64_t bytes, unsigned int flags, int* already_registered) {
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
  const cudaError_t err = cudaHostRegister(ptr, static_cast<size_t>(bytes), flags);
  if (err == cudaErrorHostMemoryAlreadyRegistered) {
    cudaGetLastError();
    if (already_registered != nullptr) *already_registered = 1;
    return KVO_OK;
  }
  if (err != cudaSuccess) return kvo::fail_cuda(err, "cudaHostRegister");
  return KVO_OK;
}

int kvo_host_unregister(void* ptr) {
  clear_error();
  if (ptr == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "ptr must be non-NULL");
  KVO_CUDA_CHECK(cudaHostUnregister(ptr));
  return KVO_OK;
}

int kvo_host_get_device_pointer(uint64_t host_ptr, uint64_t* device_ptr) {
  clear_error();
  if (host_ptr == 0 || device_ptr == nullptr) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "host_ptr and device_ptr must be non-zero");
  }
  *device_ptr = 0;
  cudaPointerAttributes attrs{};
  KVO_CUDA_CHECK(cudaPointerGetAttributes(&attrs, reinterpret_cast<const void*>(host_ptr)));
  if (attrs.type != cudaMemoryTypeHost || attrs.devicePointer == nullptr) {
    return fail(KVO_ERR_INVALID_ARGUMENT,
                "host_ptr=%#llx is not in a host range registered with KVO_HOST_REGISTER_MAPPED",
                (unsigned long long)host_ptr);
  }
  *device_ptr = reinterpret_cast<uint64_t>(attrs.devicePointer);
  return KVO_OK;
}

int kvo_device_malloc(uint64_t bytes, uint64_t* ptr) {
  clear_error();
  if (ptr == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "ptr must be non-NULL");
  *ptr = 0;
  if (bytes == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "bytes must be > 0");
  void* p = nullptr;
  KVO_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(bytes)));
  *ptr = reinterpret_cast<uint64_t>(p);
  return KVO_OK;
}

int kvo_device_free(uint64_t ptr) {
  clear_error();
  if (ptr == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "ptr must be non-zero");
  KVO_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(ptr)));
  return KVO_OK;
}

int kvo_memcpy_sync(uint64_t dst, uint64_t src, uint64_t bytes) {
  clear_error();
  if (dst == 0 || src == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "dst and src must be non-zero");
  if (bytes == 0) return KVO_OK;
  if (dst > UINT64_MAX - bytes || src > UINT64_MAX - bytes) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "a range wraps around the address space");
  }
  KVO_CUDA_CHECK(cudaMemcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                            static_cast<size_t>(bytes), cudaMemcpyDefault));
  return KVO_OK;
}

int kvo_memset_sync(uint64_t ptr, int value, uint64_t bytes) {
  clear_error();
  if (ptr == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "ptr must be non-zero");
  if (bytes == 0) return KVO_OK;
  if (ptr > UINT64_MAX - bytes) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "the range wraps around the address space");
  }
  KVO_CUDA_CHECK(cudaMemsetAsync(reinterpret_cast<void*>(ptr), value, static_cast<size_t>(bytes),
                                 cudaStreamLegacy));
  KVO_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  return KVO_OK;
}

}  // extern "C"
