// C API of the vllm-kv-offload CUDA copy library.
//
// Loaded from Python with ctypes (vllm/_custom_ops.py): every argument is a plain integer, a raw
// pointer or a pointer to a plain struct, and CUDA streams and events are passed as their handles
// (cudaStream_t / cudaEvent_t cast to void*). Nothing here depends on Python or torch. The CUDA
// runtime is linked statically and the driver API is resolved at run time, so the library loads on
// a machine without a driver or GPU: argument checks (kvo_check_*) then still work, and every call
// that needs CUDA returns KVO_ERR_CUDA.
//
// Error convention: every function returns a KvoStatus. On failure, kvo_last_error() returns a
// NUL-terminated, thread-local message naming the offending argument or CUDA call; it stays valid
// until the next call into the library from the same thread. An argument error
// (KVO_ERR_INVALID_ARGUMENT) is always detected before anything is enqueued on a stream.
//
// Threading: every function may be called from any thread. The device used is the calling
// thread's current CUDA device (kvo_set_device); streams and events must belong to it.
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
#define KVO_ABI_VERSION 2

typedef enum KvoStatus {
  KVO_OK = 0,
  KVO_ERR_INVALID_ARGUMENT = 1,  // a bad count, size, pointer, id or handle; nothing was enqueued
  KVO_ERR_CUDA = 2,              // a CUDA call failed; see kvo_last_error()
} KvoStatus;

// How kvo_copy_blocks moves bytes.
typedef enum KvoCopyMethod {
  // Copy engines (DMA). All copies of the call are submitted with one cuMemcpyBatchAsync when the
  // driver provides it (resolved at run time) and the stream is not the legacy default stream;
  // otherwise one cudaMemcpyAsync per copy. Uses no SM; preferred for large pages.
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
// Library and device
// ---------------------------------------------------------------------------------------------

// Returns KVO_ABI_VERSION of the compiled library.
KVO_API int kvo_abi_version(void);

// sizeof(KvoCopyRegion) as compiled (104); the Python side checks it against its own layout.
KVO_API int kvo_copy_region_size(void);

// Message of the last failed call on this thread ("" if none).
KVO_API const char* kvo_last_error(void);

// Number of CUDA devices visible to the runtime, in *count (0 when there is no driver or GPU; the
// call still returns KVO_OK in that case).
KVO_API int kvo_device_count(int* count);

// The calling thread's current device, in *device.
KVO_API int kvo_get_device(int* device);

// Makes `device` the calling thread's current device (and its primary context current).
KVO_API int kvo_set_device(int device);

// Sets *available to 1 if the driver provides cuMemcpyBatchAsync (so KVO_COPY_DMA submits a job
// as one batch), else 0. Resolved once, at the first call, through the runtime's driver entry
// point query; the library never links libcuda. Returns KVO_OK even without a driver (then 0).
KVO_API int kvo_dma_batch_available(int* available);

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

// Enqueues every copy of every region on `stream` (see KvoCopyRegion), with `method`.
//
// The call is asynchronous: the copies run in stream order and are complete once an event
// recorded on `stream` after this call completes. The host arrays are consumed before the call
// returns (the caller may free or reuse them at once); the memory the regions address must stay
// valid, and must not be written by anyone else, until the copies are complete. Copies within a
// call run in no particular order and may run concurrently.
//
// Arguments: as kvo_check_copy_blocks (which this function runs first), plus
//   method: a KvoCopyMethod.
//   max_ctas: kernel path only: the most thread blocks the kernel may use (1..65535), or 0 for
//     the default (16). Bounds the SMs taken from concurrently running model kernels.
//   stream: the cudaStream_t to enqueue on (NULL means the legacy default stream, which the batch
//     API rejects; KVO_COPY_DMA then falls back to the cudaMemcpyAsync loop).
// Host memory should be pinned (kvo_host_register) for the DMA path to be asynchronous; the
// kernel path requires it to be pinned and mapped and reports KVO_ERR_INVALID_ARGUMENT otherwise.
KVO_API int kvo_copy_blocks(const KvoCopyRegion* regions, int64_t num_regions,
                            const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs,
                            int method, int max_ctas, void* stream);

// Enqueues n independent copies on `stream`: copy i moves sizes[i] bytes from src_ptrs[i] to
// dst_ptrs[i]. Pointers may be device or host addresses (the direction is inferred from them,
// cudaMemcpyDefault). Submitted as one cuMemcpyBatchAsync when available and the stream is not
// the legacy default stream, else as a cudaMemcpyAsync loop.
//
// Arguments:
//   dst_ptrs, src_ptrs, sizes: host arrays of n entries (may be NULL only when n == 0).
//   n: number of copies, n >= 0; n == 0 returns KVO_OK at once.
//   stream: the cudaStream_t to enqueue on (NULL means the legacy default stream).
// Requirements: every sizes[i] > 0, every pointer non-zero, no range wraps around the address
// space, and no copy's source and destination ranges overlap. Violations return
// KVO_ERR_INVALID_ARGUMENT before anything is enqueued.
KVO_API int kvo_memcpy_batch(const uint64_t* dst_ptrs, const uint64_t* src_ptrs,
                             const uint64_t* sizes, int64_t n, void* stream);

// ---------------------------------------------------------------------------------------------
// Streams and events (for callers without a CUDA build of torch)
// ---------------------------------------------------------------------------------------------

// Creates a non-blocking stream (no implicit synchronisation with the legacy default stream) on
// the current device, with `priority` (0 = default; lower numbers are higher priority and are
// clamped to the device's range). *stream receives the handle.
KVO_API int kvo_stream_create(void** stream, int priority);
KVO_API int kvo_stream_destroy(void* stream);
// Blocks the calling thread until all work enqueued on `stream` is complete.
KVO_API int kvo_stream_synchronize(void* stream);
// Makes all future work on `stream` wait for the completion of `event`'s last record (NULL stream:
// the legacy default stream).
KVO_API int kvo_stream_wait_event(void* stream, void* event);

// Creates an event; enable_timing != 0 allows kvo_event_elapsed_ms on it.
KVO_API int kvo_event_create(void** event, int enable_timing);
KVO_API int kvo_event_destroy(void* event);
// Records `event` on `stream` (NULL: the legacy default stream).
KVO_API int kvo_event_record(void* event, void* stream);
// *done = 1 if all work captured by the event's last record is complete (or it was never
// recorded), 0 if not yet. A failure of that work returns KVO_ERR_CUDA.
KVO_API int kvo_event_query(void* event, int* done);
// Blocks until the event's last record is complete.
KVO_API int kvo_event_synchronize(void* event);
// Milliseconds between two completed, timing-enabled events, in *ms.
KVO_API int kvo_event_elapsed_ms(void* start, void* end, float* ms);

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

// Page-locks (pins) the host range [ptr, ptr + bytes) with cudaHostRegister and `flags`
// (KVO_HOST_REGISTER_*). *already_registered (may be NULL) is set to 1, and KVO_OK returned, when
// the range was registered before (by this process): the caller then does not own the
// registration and must not unregister it.
KVO_API int kvo_host_register(void* ptr, uint64_t bytes, unsigned int flags,
                              int* already_registered);
// Unpins a range pinned by kvo_host_register; `ptr` must be the pointer that was registered.
KVO_API int kvo_host_unregister(void* ptr);
// The device address through which the kernel path reaches host address `host_ptr` (inside a
// range registered with KVO_HOST_REGISTER_MAPPED), in *device_ptr.
KVO_API int kvo_host_get_device_pointer(uint64_t host_ptr, uint64_t* device_ptr);

// Device memory, for tests and benchmarks run without a CUDA build of torch.
KVO_API int kvo_device_malloc(uint64_t bytes, uint64_t* ptr);
KVO_API int kvo_device_free(uint64_t ptr);
// Synchronous copy of `bytes` bytes between any two addresses (cudaMemcpyDefault).
KVO_API int kvo_memcpy_sync(uint64_t dst, uint64_t src, uint64_t bytes);
// Synchronous memset of device memory.
KVO_API int kvo_memset_sync(uint64_t ptr, int value, uint64_t bytes);

#ifdef __cplusplus
}  // extern "C"
#endif
