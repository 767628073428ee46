// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
// C API of the vllm-kv-offload CUDA copy library.
//
// Loaded from Python with ctypes (vllm/kv_copy/cuda_library.py): every argument is a plain
// integer, a raw pointer or a pointer to a plain struct, and CUDA streams and events are passed as
// their handles (cudaStream_t / cudaEvent_t cast to void*). Nothing here depends on Python or
// torch. The CUDA runtime is linked statically and the driver API is resolved at run time, so the
// library loads on a machine without a driver or GPU: argument checks (kvo_check_*) then still
// work, and every call that needs CUDA returns KVO_ERR_CUDA.
//
// Driver requirement: the static runtime is the toolkit's, so the driver must support that CUDA
// version (CUDA 13.x: R580 or newer). kvo_device_count reports an older driver as an error naming
// both versions; build with an older toolkit to run on an older driver (see README.md).
//
// Error convention: every function returns a KvoStatus. On failure, kvo_last_error() returns a
// NUL-terminated, thread-local message naming the offending argument or CUDA call; it stays valid
// until the next call into the library from the same thread. An argument error
// (KVO_ERR_INVALID_ARGUMENT) is always detected before anything is enqueued on a stream.
//
// Devices: every entry point that uses CUDA takes `device`, the ordinal of the device it acts on
// (as CUDA numbers them, after CUDA_VISIBLE_DEVICES), and makes it the calling thread's current
// device (cudaSetDevice, which also makes its primary context current) before any other CUDA call.
// So any thread may call any entry point whatever device it had current, and no context is ever
// created on a device the caller did not name. The device stays current after the call: switching
// back could create a context on the previous device. Streams and events passed to a call must
// belong to `device`. Host memory registered with KVO_HOST_REGISTER_PORTABLE serves every device.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVO_API __attribute__((visibility("default")))

// Version of this C API; bumped on any incompatible change. The Python side refuses a mismatch.
//   1: kvo_memcpy_batch only.
//   2: block copies (KvoCopyRegion), DMA batch/loop and kernel paths, stream/event/host-register
//      helpers.
//   3: every entry point that uses CUDA takes its device (no implicit current device; the
//      kvo_get_device / kvo_set_device pair is gone); kvo_device_count fails, naming the CUDA error,
//      when CUDA is unusable (it used to report 0 devices); kvo_dma_batch_fallbacks added;
//      kvo_memcpy_batch and kvo_host_get_device_pointer removed (no caller).
#define KVO_ABI_VERSION 3

typedef enum KvoStatus {
  KVO_OK = 0,
  KVO_ERR_INVALID_ARGUMENT = 1,  // a bad count, size, pointer, id or handle; nothing was enqueued
  KVO_ERR_CUDA = 2,              // a CUDA call failed; see kvo_last_error()
} KvoStatus;

// How kvo_copy_blocks moves bytes.
typedef enum KvoCopyMethod {
  // Copy engines (DMA). All copies of the call are submitted with one cuMemcpyBatchAsync when the
  // driver provides it (resolved at run time) and the stream is not the legacy default stream;
  // otherwise one cudaMemcpyAsync per copy. Uses no SM; preferred for large pages. A batch call
  // that the driver refuses for reasons of the batch API itself (CUDA_ERROR_NOT_SUPPORTED, or
  // CUDA_ERROR_INVALID_VALUE not tied to one copy) is resubmitted as the cudaMemcpyAsync loop and
  // counted (kvo_dma_batch_fallbacks); any other failure fails the call, naming the CUresult.
  KVO_COPY_DMA = 0,
  // Copy engines, always one cudaMemcpyAsync per copy (the fallback of KVO_COPY_DMA, selectable
  // for testing and comparison).
  KVO_COPY_DMA_LOOP = 1,
  // A copy kernel running on at most max_ctas thread blocks: host memory is read or written
  // through its device mapping, so it must be pinned and mapped (kvo_host_register with
  // KVO_HOST_REGISTER_MAPPED, or cudaHostAlloc'd). 16-byte vector accesses whenever the source and
  // destination addresses of a copy agree modulo 16 (8, 4 and 2 otherwise; bytes at the unaligned
  // head and tail are copied one by one). For batches of many small pages, where the per-copy
  // cost of the copy engines dominates.
  KVO_COPY_KERNEL = 2,
} KvoCopyMethod;

// One side (source or destination) of a KvoCopyRegion: memory addressed by block id.
//
// Layout: `num_blocks` blocks, block b starting at `base + b * block_stride`. A block holds
// `sub_blocks` sub-blocks, sub-block j starting `j * sub_stride` bytes after its block. An id `i`
// (an entry of src_ids/dst_ids) addresses sub-block `i % sub_blocks` of block `i / sub_blocks`:
//
//     address(i) = base + (i / sub_blocks) * block_stride + (i % sub_blocks) * sub_stride
//
// With sub_blocks == 1 an id is simply a block id (sub_stride is then ignored). The GPU side of an
// offload uses sub_blocks == 1; the CPU side uses sub_blocks == k when one offloaded block holds k
// GPU blocks (block_size_factor), so that GPU block g of a job maps to CPU id `c * k + j`.
//
// Requirements (checked, with `bytes` the region's bytes per copy):
//   base != 0; num_blocks >= 1; sub_blocks >= 1;
//   sub_blocks > 1 implies bytes <= sub_stride (sub-blocks of a block never overlap);
//   num_blocks > 1 implies span <= block_stride, where span = (sub_blocks-1)*sub_stride + bytes
//   (blocks never overlap); the extent [base, base + (num_blocks-1)*block_stride + span) does not
//   wrap around the address space.
typedef struct KvoBlockSide {
  uint64_t base;          // address of sub-block 0 of block 0 (device, or host)
  uint64_t block_stride;  // bytes from block b to block b + 1
  uint64_t sub_stride;    // bytes from sub-block j to sub-block j + 1 of a block
  int64_t num_blocks;     // number of blocks addressable from base
  int64_t sub_blocks;     // sub-blocks per block (>= 1)
} KvoBlockSide;

// One tensor's share of a job: for each pair p in [pair_begin, pair_begin + pair_count), copy
// `bytes` bytes from src.address(src_ids[p]) to dst.address(dst_ids[p]).
//
// A job over T canonical KV tensors and G KV-cache groups is one region per (group, tensor of the
// group); the regions of a group share its pair range. Per-layer layouts ([2, num_blocks, ...]
// split into a K and a V tensor, or [num_blocks, 2, ...] as one tensor per layer) and the
// cross-layer layout (one tensor in which a block of every layer is contiguous) only differ in
// the number of regions and their strides.
//
// Requirements (checked): bytes > 0; pair_begin >= 0; pair_count >= 0;
// pair_begin + pair_count <= num_pairs; every id in range (0 <= id < num_blocks * sub_blocks of
// its side); the source and destination extents do not overlap; the destination ids of a region
// are pairwise distinct (so no two copies of a region write the same bytes). Regions whose
// destination extents overlap must not name the same destination bytes; this is not checked.
typedef struct KvoCopyRegion {
  KvoBlockSide src;
  KvoBlockSide dst;
  uint64_t bytes;      // bytes per copy
  int64_t pair_begin;  // first pair of this region in src_ids / dst_ids
  int64_t pair_count;  // number of pairs of this region
} KvoCopyRegion;

// Flags of kvo_host_register (the values of cudaHostRegisterPortable / cudaHostRegisterMapped).
#define KVO_HOST_REGISTER_PORTABLE 1u  // pinned for every CUDA context, not just the current one
#define KVO_HOST_REGISTER_MAPPED 2u    // also mapped into the device address space (kernel path)

// ---------------------------------------------------------------------------------------------
// Library and devices
// ---------------------------------------------------------------------------------------------

// Returns KVO_ABI_VERSION of the compiled library.
KVO_API int kvo_abi_version(void);

// sizeof(KvoCopyRegion) as compiled (104); the Python side checks it against its own layout.
KVO_API int kvo_copy_region_size(void);

// Message of the last failed call on this thread ("" if none).
KVO_API const char* kvo_last_error(void);

// Number of CUDA devices visible to the runtime, in *count.
//
// Returns KVO_OK with *count == 0 when the driver works but reports no device
// (cudaErrorNoDevice, e.g. CUDA_VISIBLE_DEVICES=""). Returns KVO_ERR_CUDA (and *count == 0) when
// CUDA cannot be used at all: no driver, a driver older than the CUDA runtime this library was
// built with (cudaErrorInsufficientDriver), and so on; kvo_last_error() then names the CUDA error
// and the driver's and the library's CUDA versions.
KVO_API int kvo_device_count(int* count);

// Sets *available to 1 if the driver provides cuMemcpyBatchAsync (so KVO_COPY_DMA submits a job
// as one batch), else 0. Resolved once, at the first call, through the runtime's driver entry
// point query; the library never links libcuda. Returns KVO_OK even without a driver (then 0).
KVO_API int kvo_dma_batch_available(int* available);

// KVO_COPY_DMA jobs whose cuMemcpyBatchAsync call the driver refused for reasons of the batch API
// and that were resubmitted as a cudaMemcpyAsync loop, since the library was loaded: the count in
// *count, and the message of the first such refusal (naming its CUresult; "" if none) copied into
// reason[0 .. reason_size) (NUL-terminated, truncated to fit; reason may be NULL when
// reason_size == 0).
//
// Test hook: when the environment variable VLLM_KV_OFFLOAD_TEST_BATCH_RESULT holds a non-zero
// CUresult at the first use of the batch API, every batch call is treated as having failed with it
// (the driver is not called), so tests can drive the fallback and the error report on any GPU.
KVO_API int kvo_dma_batch_fallbacks(uint64_t* count, char* reason, uint64_t reason_size);

// ---------------------------------------------------------------------------------------------
// Block copies
// ---------------------------------------------------------------------------------------------

// Checks the arguments of kvo_copy_blocks without touching CUDA or dereferencing any address
// (only the host arrays are read). Works on a machine without a GPU.
//
// Arguments:
//   regions: host array of num_regions KvoCopyRegion (NULL only when num_regions == 0).
//   num_regions: >= 0.
//   src_ids, dst_ids: host int64 arrays of num_pairs ids each (NULL only when num_pairs == 0).
//   num_pairs: >= 0.
// Returns KVO_OK or KVO_ERR_INVALID_ARGUMENT with a message naming the region, pair and field.
KVO_API int kvo_check_copy_blocks(const KvoCopyRegion* regions, int64_t num_regions,
                                  const int64_t* src_ids, const int64_t* dst_ids,
                                  int64_t num_pairs);

// Enqueues every copy of every region on `stream` of `device` (see KvoCopyRegion), with `method`.
//
// The call is asynchronous: the copies run in stream order and are complete once an event
// recorded on `stream` after this call completes. The host arrays are consumed before the call
// returns (the caller may free or reuse them at once); the memory the regions address must stay
// valid, and must not be written by anyone else, until the copies are complete. Copies within a
// call run in no particular order and may run concurrently; copies that a refused batch call had
// already enqueued may run twice when it is resubmitted as a loop (see KVO_COPY_DMA), which writes
// the same bytes as long as no destination of the call is also one of its sources.
//
// Arguments: device (>= 0), then as kvo_check_copy_blocks (which this function runs first), then
//   method: a KvoCopyMethod.
//   max_ctas: kernel path only: the most thread blocks the kernel may use (1..65535), or 0 for
//     the default (16). Bounds the SMs taken from concurrently running model kernels.
//   stream: the cudaStream_t to enqueue on (NULL means the legacy default stream, which the batch
//     API rejects; KVO_COPY_DMA then uses the cudaMemcpyAsync loop).
// Host memory should be pinned (kvo_host_register) for the DMA path to be asynchronous; the
// kernel path requires it to be pinned and mapped and reports KVO_ERR_INVALID_ARGUMENT otherwise.
// The kernel path resolves each region side's device address once and remembers it: for host
// memory registered by kvo_host_register until kvo_host_unregister, for device memory for the
// life of the process (the library cannot see device memory being freed; a job must not address
// freed memory anyway). Other host memory is resolved on every call.
KVO_API int kvo_copy_blocks(int device, const KvoCopyRegion* regions, int64_t num_regions,
                            const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs,
                            int method, int max_ctas, void* stream);

// ---------------------------------------------------------------------------------------------
// Streams and events (for callers without a CUDA build of torch)
// ---------------------------------------------------------------------------------------------

// Creates a non-blocking stream (no implicit synchronisation with the legacy default stream) on
// `device`, with `priority` (0 = default; lower numbers are higher priority and are clamped to the
// device's range). *stream receives the handle.
KVO_API int kvo_stream_create(int device, void** stream, int priority);
KVO_API int kvo_stream_destroy(int device, void* stream);
// Blocks the calling thread until all work enqueued on `stream` is complete.
KVO_API int kvo_stream_synchronize(int device, void* stream);
// Makes all future work on `stream` wait for the completion of `event`'s last record (NULL stream:
// the legacy default stream).
KVO_API int kvo_stream_wait_event(int device, void* stream, void* event);

// Creates an event on `device`; enable_timing != 0 allows kvo_event_elapsed_ms on it.
KVO_API int kvo_event_create(int device, void** event, int enable_timing);
KVO_API int kvo_event_destroy(int device, void* event);
// Records `event` on `stream` (NULL: the legacy default stream).
KVO_API int kvo_event_record(int device, void* event, void* stream);
// *done = 1 if all work captured by the event's last record is complete (or it was never
// recorded), 0 if not yet. A failure of that work returns KVO_ERR_CUDA.
KVO_API int kvo_event_query(int device, void* event, int* done);
// Blocks until the event's last record is complete.
KVO_API int kvo_event_synchronize(int device, void* event);
// Milliseconds between two completed, timing-enabled events, in *ms.
KVO_API int kvo_event_elapsed_ms(int device, void* start, void* end, float* ms);

// ---------------------------------------------------------------------------------------------
// Host memory
// ---------------------------------------------------------------------------------------------

// Page-locks (pins) the host range [ptr, ptr + bytes) with cudaHostRegister and `flags`
// (KVO_HOST_REGISTER_*), from `device`'s context. *already_registered (may be NULL) is set to 1,
// and KVO_OK returned, when the range was registered before (by this process): the caller then
// does not own the registration and must not unregister it.
KVO_API int kvo_host_register(int device, void* ptr, uint64_t bytes, unsigned int flags,
                              int* already_registered);
// Unpins a range pinned by kvo_host_register; `ptr` must be the pointer that was registered. A
// range registered here must be unregistered here (not with cudaHostUnregister), since the
// kernel path remembers its mapping until then.
KVO_API int kvo_host_unregister(int device, void* ptr);

// ---------------------------------------------------------------------------------------------
// Test support: device memory for tests, the C self-test and benchmarks run without a CUDA build
// of torch. Not used by the offload path.
// ---------------------------------------------------------------------------------------------

KVO_API int kvo_device_malloc(int device, uint64_t bytes, uint64_t* ptr);
KVO_API int kvo_device_free(int device, uint64_t ptr);
// Synchronous copy of `bytes` bytes between any two addresses (cudaMemcpyDefault).
KVO_API int kvo_memcpy_sync(int device, uint64_t dst, uint64_t src, uint64_t bytes);
// Synchronous memset of device memory.
KVO_API int kvo_memset_sync(int device, uint64_t ptr, int value, uint64_t bytes);

#ifdef __cplusplus
}  // extern "C"
#endif
