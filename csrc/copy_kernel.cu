// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
// Kernel path of kvo_copy_blocks: a copy kernel on a bounded number of thread blocks, reading or
// writing host memory through its device mapping (pinned + mapped host memory).
//
// Work decomposition: an "item" is one copy (one region, one pair). Items are numbered region by
// region; thread block b handles items b, b + gridDim.x, ... and all of its threads copy an item
// together, with 16-byte vector accesses where the two addresses allow it. A grid of at most
// max_ctas blocks bounds the SMs the copy takes from concurrently running model kernels.
//
// Descriptors (regions with device-visible addresses, item offsets and both id arrays) are
// written into a pinned staging buffer, copied to device memory on the same stream, and read by
// the kernel from there. A staging slot is reused only after an event recorded behind the kernel
// has completed, so a later call never overwrites descriptors an earlier kernel still reads.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "kv_offload.h"
#include "kvo_common.cuh"

namespace kvo {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr size_t kMinSlotBytes = size_t{64} << 10;
constexpr size_t kMaxSlots = 32;

// A region as the kernel sees it: device-visible bases, and the offset of its first item.
struct DevRegion {
  uint64_t src_base;
  uint64_t src_block_stride;
  uint64_t src_sub_stride;
  int64_t src_sub_blocks;
  uint64_t dst_base;
  uint64_t dst_block_stride;
  uint64_t dst_sub_stride;
  int64_t dst_sub_blocks;
  uint64_t bytes;
  int64_t pair_begin;
};
static_assert(sizeof(DevRegion) % 8 == 0, "DevRegion must keep 8-byte alignment");

__device__ __forceinline__ uint64_t dev_address(uint64_t base, uint64_t block_stride,
                                                uint64_t sub_stride, int64_t sub_blocks,
                                                int64_t id) {
  return base + static_cast<uint64_t>(id / sub_blocks) * block_stride +
         static_cast<uint64_t>(id % sub_blocks) * sub_stride;
}

// All threads of the block copy n bytes from src to dst (non-overlapping), with accesses of
// sizeof(V) bytes for the part where both pointers are V-aligned. Requires (dst - src) % sizeof(V)
// == 0, so that aligning one pointer aligns the other.
template <typename V>
__device__ __forceinline__ void block_copy(char* __restrict__ dst, const char* __restrict__ src,
                                           uint64_t n) {
  constexpr uint64_t kW = sizeof(V);
  const uint64_t misalign = reinterpret_cast<uintptr_t>(src) % kW;
  const uint64_t head = misalign == 0 ? 0 : min(n, kW - misalign);
  for (uint64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
  const uint64_t body = (n - head) / kW;
  V* __restrict__ vd = reinterpret_cast<V*>(dst + head);
  const V* __restrict__ vs = reinterpret_cast<const V*>(src + head);
  const uint64_t stride = blockDim.x;
  uint64_t i = threadIdx.x;
  // Several independent loads in flight per thread hide the latency of reads over PCIe. Streaming
  // (evict-first) accesses: each byte is touched once, so it should not displace the model's
  // working set from L2.
  for (; i + (kUnroll - 1) * stride < body; i += kUnroll * stride) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcs(vs + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) __stcs(vd + i + u * stride, v[u]);
  }
  for (; i < body; i += stride) __stcs(vd + i, __ldcs(vs + i));
  for (uint64_t t = head + body * kW + threadIdx.x; t < n; t += blockDim.x) dst[t] = src[t];
}

__global__ void __launch_bounds__(kThreads)
    copy_blocks_kernel_impl(const DevRegion* __restrict__ regions,
                            const int64_t* __restrict__ item_begin, int num_regions,
                            const int64_t* __restrict__ src_ids,
                            const int64_t* __restrict__ dst_ids, int64_t num_items) {
  // The region of `item` is the last r with item_begin[r] <= item (item_begin is strictly
  // increasing: empty regions were dropped). A block's items only increase, so its region index
  // only moves forward: a short scan from the previous one instead of a search per item.
  int lo = 0;
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    while (lo + 1 < num_regions && item_begin[lo + 1] <= item) ++lo;
    const DevRegion& rg = regions[lo];
    const int64_t p = rg.pair_begin + (item - item_begin[lo]);
    char* dst = reinterpret_cast<char*>(dev_address(rg.dst_base, rg.dst_block_stride,
                                                    rg.dst_sub_stride, rg.dst_sub_blocks,
                                                    dst_ids[p]));
    const char* src = reinterpret_cast<const char*>(dev_address(
        rg.src_base, rg.src_block_stride, rg.src_sub_stride, rg.src_sub_blocks, src_ids[p]));
    const uintptr_t rel = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
    if ((rel & 15) == 0) {
      block_copy<uint4>(dst, src, rg.bytes);
    } else if ((rel & 7) == 0) {
      block_copy<uint2>(dst, src, rg.bytes);
    } else if ((rel & 3) == 0) {
      block_copy<uint32_t>(dst, src, rg.bytes);
    } else if ((rel & 1) == 0) {
      block_copy<uint16_t>(dst, src, rg.bytes);
    } else {
      block_copy<uint8_t>(dst, src, rg.bytes);
    }
  }
}

// Pinned host staging buffer + device copy of it, reusable once `done` has completed.
//
// Ownership: a slot is handed to one caller at a time (`in_use`, set and cleared under
// g_slots_mu). Only its holder reads or writes its buffers, capacity and event, and only with the
// mutex released: growing a slot frees its buffers (cudaFreeHost / cudaFree synchronise with the
// device), which must not hold up other threads taking other slots. A slot is handed out only
// once its event has completed (or its holder waits for it), so no kernel still reads the
// buffers it frees or overwrites.
struct Slot {
  int device = -1;
  size_t capacity = 0;
  char* host = nullptr;
  char* dev = nullptr;
  cudaEvent_t done = nullptr;
  bool in_use = false;
};

std::mutex g_slots_mu;
std::vector<Slot*> g_slots;  // never freed: lives for the process, like the CUDA context

// Replaces the idle slot's buffers with ones of at least `bytes` (the caller holds the slot).
int grow(Slot* slot, size_t bytes) {
  size_t capacity = kMinSlotBytes;
  while (capacity < bytes) capacity *= 2;
  if (slot->host != nullptr) KVO_CUDA_CHECK(cudaFreeHost(slot->host));
  slot->host = nullptr;
  if (slot->dev != nullptr) KVO_CUDA_CHECK(cudaFree(slot->dev));
  slot->dev = nullptr;
  slot->capacity = 0;
  KVO_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&slot->host), capacity,
                               cudaHostAllocDefault));
  KVO_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&slot->dev), capacity));
  slot->capacity = capacity;
  return KVO_OK;
}

void release_slot(Slot* s) {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  s->in_use = false;
}

// Takes a slot of `device` (current) with at least `bytes` of capacity and no work in flight
// (growing, creating or waiting for one); the caller releases it with release_slot.
int acquire_slot(int device, size_t bytes, Slot** out) {
  Slot* s = nullptr;
  bool wait = false;  // s still has work in flight: wait for its event before using it
  bool fresh = false;
  {
    std::lock_guard<std::mutex> lock(g_slots_mu);
    Slot* idle_small = nullptr;
    Slot* busy = nullptr;
    size_t count = 0;
    for (Slot* c : g_slots) {
      if (c->device != device) continue;
      ++count;
      if (c->in_use) continue;
      // Non-blocking, so cheap enough under the mutex.
      const cudaError_t err = cudaEventQuery(c->done);
      if (err == cudaErrorNotReady) {
        cudaGetLastError();
        if (busy == nullptr) busy = c;
        continue;
      }
      if (err != cudaSuccess) return fail_cuda(err, "cudaEventQuery(staging slot)");
      if (c->capacity >= bytes) {
        s = c;
        break;
      }
      if (idle_small == nullptr) idle_small = c;
    }
    if (s == nullptr) s = idle_small;
    if (s == nullptr && count >= kMaxSlots && busy != nullptr) {
      // Too many kernel jobs in flight: wait for one rather than growing without bound.
      s = busy;
      wait = true;
    }
    if (s == nullptr) {
      s = new Slot();
      s->device = device;
      g_slots.push_back(s);
      fresh = true;
    }
    s->in_use = true;
  }
  int rc = KVO_OK;
  if (fresh) {
    const cudaError_t err = cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      rc = fail_cuda(err, "cudaEventCreateWithFlags(staging slot)");
      std::lock_guard<std::mutex> lock(g_slots_mu);
      g_slots.erase(std::find(g_slots.begin(), g_slots.end(), s));
      delete s;
      return rc;
    }
  }
  if (wait) {
    const cudaError_t err = cudaEventSynchronize(s->done);
    if (err != cudaSuccess) rc = fail_cuda(err, "cudaEventSynchronize(staging slot)");
  }
  if (rc == KVO_OK && s->capacity < bytes) rc = grow(s, bytes);
  if (rc != KVO_OK) {
    release_slot(s);
    return rc;
  }
  *out = s;
  return KVO_OK;
}

size_t align8(size_t n) { return (n + 7) & ~size_t{7}; }

}  // namespace

int copy_blocks_kernel(int device, const KvoCopyRegion* regions, int64_t num_regions,
                       const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs,
                       int max_ctas, cudaStream_t stream) {
  thread_local std::vector<DevRegion> dev_regions;
  thread_local std::vector<int64_t> item_begin;
  dev_regions.clear();
  item_begin.clear();
  int64_t num_items = 0;
  for (int64_t r = 0; r < num_regions; ++r) {
    const KvoCopyRegion& rg = regions[r];
    if (rg.pair_count == 0) continue;  // keeps item_begin strictly increasing
    DevRegion d{};
    if (int rc = device_view(device, rg.src.base, side_extent(rg.src, rg.bytes), r, "src",
                             &d.src_base);
        rc != KVO_OK) {
      return rc;
    }
    if (int rc = device_view(device, rg.dst.base, side_extent(rg.dst, rg.bytes), r, "dst",
                             &d.dst_base);
        rc != KVO_OK) {
      return rc;
    }
    d.src_block_stride = rg.src.block_stride;
    d.src_sub_stride = rg.src.sub_stride;
    d.src_sub_blocks = rg.src.sub_blocks;
    d.dst_block_stride = rg.dst.block_stride;
    d.dst_sub_stride = rg.dst.sub_stride;
    d.dst_sub_blocks = rg.dst.sub_blocks;
    d.bytes = rg.bytes;
    d.pair_begin = rg.pair_begin;
    dev_regions.push_back(d);
    item_begin.push_back(num_items);
    num_items += rg.pair_count;
  }
  if (num_items == 0) return KVO_OK;
  if (dev_regions.size() > static_cast<size_t>(INT32_MAX)) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "too many non-empty regions (%zu)", dev_regions.size());
  }

  // Staging layout: [DevRegion x R][int64 item_begin x R][int64 src_ids x P][int64 dst_ids x P].
  const size_t regions_bytes = align8(dev_regions.size() * sizeof(DevRegion));
  const size_t begins_bytes = item_begin.size() * sizeof(int64_t);
  const size_t ids_bytes = static_cast<size_t>(num_pairs) * sizeof(int64_t);
  const size_t total = regions_bytes + begins_bytes + 2 * ids_bytes;

  Slot* slot = nullptr;
  if (int rc = acquire_slot(device, total, &slot); rc != KVO_OK) return rc;
  std::memcpy(slot->host, dev_regions.data(), dev_regions.size() * sizeof(DevRegion));
  std::memcpy(slot->host + regions_bytes, item_begin.data(), begins_bytes);
  if (ids_bytes > 0) {
    std::memcpy(slot->host + regions_bytes + begins_bytes, src_ids, ids_bytes);
    std::memcpy(slot->host + regions_bytes + begins_bytes + ids_bytes, dst_ids, ids_bytes);
  }

  int rc = KVO_OK;
  cudaError_t err = cudaMemcpyAsync(slot->dev, slot->host, total, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) {
    rc = fail_cuda(err, "cudaMemcpyAsync(kernel descriptors)");
  } else {
    const auto* d_regions = reinterpret_cast<const DevRegion*>(slot->dev);
    const auto* d_begin = reinterpret_cast<const int64_t*>(slot->dev + regions_bytes);
    const auto* d_src = reinterpret_cast<const int64_t*>(slot->dev + regions_bytes + begins_bytes);
    const auto* d_dst =
        reinterpret_cast<const int64_t*>(slot->dev + regions_bytes + begins_bytes + ids_bytes);
    const int grid = static_cast<int>(std::min<int64_t>(max_ctas, num_items));
    copy_blocks_kernel_impl<<<grid, kThreads, 0, stream>>>(
        d_regions, d_begin, static_cast<int>(dev_regions.size()), d_src, d_dst, num_items);
    err = cudaGetLastError();
    if (err != cudaSuccess) rc = fail_cuda(err, "copy kernel launch");
  }
  // Recorded even after a failure, so the slot is not reused before whatever was enqueued ran.
  const cudaError_t rec = cudaEventRecord(slot->done, stream);
  if (rec != cudaSuccess && rc == KVO_OK) rc = fail_cuda(rec, "cudaEventRecord(staging slot)");
  if (rec != cudaSuccess) {
    // The slot's event may not cover the enqueued work: never hand the slot out again.
    std::lock_guard<std::mutex> lock(g_slots_mu);
    slot->device = -2;
    slot->in_use = false;
    return rc;
  }
  release_slot(slot);
  return rc;
}

}  // namespace kvo
