// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
// Block copies: argument checks, the DMA paths (cuMemcpyBatchAsync, with its fallback to a
// cudaMemcpyAsync loop) and the dispatch of kvo_copy_blocks.
#include <cuda.h>
#include <cuda_runtime.h>
#if CUDART_VERSION >= 12080
#include <cudaTypedefs.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "batch_fallback.h"
#include "kv_offload.h"
#include "kvo_common.cuh"

namespace kvo {
namespace {

constexpr int kDefaultMaxCtas = 16;
constexpr int kMaxCtas = 65535;

// Checks one side of region r for copies of `bytes`; *id_limit receives num_blocks * sub_blocks
// and *end the first byte past the side's extent.
int check_side(const KvoBlockSide& s, uint64_t bytes, int64_t r, const char* which,
               int64_t* id_limit, uint64_t* end) {
  if (s.base == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "regions[%lld].%s.base is 0", (long long)r, which);
  if (s.num_blocks < 1) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "regions[%lld].%s.num_blocks=%lld must be >= 1",
                (long long)r, which, (long long)s.num_blocks);
  }
  if (s.sub_blocks < 1) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "regions[%lld].%s.sub_blocks=%lld must be >= 1",
                (long long)r, which, (long long)s.sub_blocks);
  }
  uint64_t span = bytes;
  if (s.sub_blocks > 1) {
    if (bytes > s.sub_stride) {
      return fail(KVO_ERR_INVALID_ARGUMENT,
                  "regions[%lld]: bytes=%llu exceeds %s.sub_stride=%llu (sub-blocks would overlap)",
                  (long long)r, (unsigned long long)bytes, which,
                  (unsigned long long)s.sub_stride);
    }
    uint64_t subs_span = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(s.sub_blocks - 1), s.sub_stride, &subs_span) ||
        __builtin_add_overflow(subs_span, bytes, &span)) {
      return fail(KVO_ERR_INVALID_ARGUMENT, "regions[%lld].%s: sub-block span overflows",
                  (long long)r, which);
    }
  }
  uint64_t extent = span;
  if (s.num_blocks > 1) {
    if (span > s.block_stride) {
      return fail(KVO_ERR_INVALID_ARGUMENT,
                  "regions[%lld].%s: a block spans %llu bytes but block_stride=%llu (blocks would "
                  "overlap)",
                  (long long)r, which, (unsigned long long)span,
                  (unsigned long long)s.block_stride);
    }
    uint64_t blocks_span = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(s.num_blocks - 1), s.block_stride,
                               &blocks_span) ||
        __builtin_add_overflow(blocks_span, span, &extent)) {
      return fail(KVO_ERR_INVALID_ARGUMENT, "regions[%lld].%s: extent overflows", (long long)r,
                  which);
    }
  }
  if (__builtin_add_overflow(s.base, extent, end)) {
    return fail(KVO_ERR_INVALID_ARGUMENT,
                "regions[%lld].%s: [base, base + %llu) wraps around the address space",
                (long long)r, which, (unsigned long long)extent);
  }
  if (__builtin_mul_overflow(s.num_blocks, s.sub_blocks, id_limit)) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "regions[%lld].%s: num_blocks * sub_blocks overflows",
                (long long)r, which);
  }
  return KVO_OK;
}

// The destination ids of one pair range, sorted, to find duplicates (reused across calls).
thread_local std::vector<int64_t> t_sorted_ids;

// Copies expanded from regions, adjacent ones merged (reused across calls).
struct CopyList {
  std::vector<uint64_t> dst;
  std::vector<uint64_t> src;
  std::vector<size_t> size;

  void clear() {
    dst.clear();
    src.clear();
    size.clear();
  }
  void add(uint64_t d, uint64_t s, uint64_t n) {
    // Merge with the previous copy when both ranges continue it: the same bytes move, in fewer
    // (larger) copies, which is what the copy engines are fast at.
    if (!size.empty() && dst.back() + size.back() == d && src.back() + size.back() == s) {
      size.back() += n;
      return;
    }
    dst.push_back(d);
    src.push_back(s);
    size.push_back(n);
  }
};
thread_local CopyList t_copies;

void expand(const KvoCopyRegion* regions, int64_t num_regions, const int64_t* src_ids,
            const int64_t* dst_ids, CopyList* out) {
  out->clear();
  for (int64_t r = 0; r < num_regions; ++r) {
    const KvoCopyRegion& rg = regions[r];
    for (int64_t p = rg.pair_begin; p < rg.pair_begin + rg.pair_count; ++p) {
      out->add(side_address(rg.dst, dst_ids[p]), side_address(rg.src, src_ids[p]), rg.bytes);
    }
  }
}

bool is_legacy_stream(cudaStream_t stream) {
  return stream == nullptr || stream == cudaStreamLegacy;
}

static_assert(kCuErrorInvalidValue == CUDA_ERROR_INVALID_VALUE, "batch_fallback.h is stale");
static_assert(kCuErrorNotSupported == CUDA_ERROR_NOT_SUPPORTED, "batch_fallback.h is stale");

// Driver entry points, resolved once through the runtime (the library does not link libcuda).
struct DriverApi {
  void* batch_v13000 = nullptr;      // cuMemcpyBatchAsync, CUDA 13 signature (no failIdx)
  void* batch_v12080 = nullptr;      // cuMemcpyBatchAsync, CUDA 12.8 signature (with failIdx)
  void* get_error_name = nullptr;    // cuGetErrorName
  void* get_error_string = nullptr;  // cuGetErrorString
  int forced_batch_result = 0;       // VLLM_KV_OFFLOAD_TEST_BATCH_RESULT (see kv_offload.h)
  bool batch_available() const { return batch_v13000 != nullptr || batch_v12080 != nullptr; }
};

#if CUDART_VERSION >= 12080
void* entry_point(const char* symbol, unsigned int version) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult result = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &p, version, cudaEnableDefault, &result);
  if (err != cudaSuccess || result != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}
#endif

DriverApi resolve_driver_api() {
  DriverApi api;
#if CUDART_VERSION >= 12080
#if CUDART_VERSION >= 13000
  api.batch_v13000 = entry_point("cuMemcpyBatchAsync", 13000);
#endif
  if (api.batch_v13000 == nullptr) api.batch_v12080 = entry_point("cuMemcpyBatchAsync", 12080);
  // Only used to name a failed batch call's CUresult, so only needed where the batch API is.
  api.get_error_name = entry_point("cuGetErrorName", 6000);
  api.get_error_string = entry_point("cuGetErrorString", 6000);
  if (const char* forced = std::getenv("VLLM_KV_OFFLOAD_TEST_BATCH_RESULT")) {
    api.forced_batch_result = std::atoi(forced);
  }
#endif
  return api;
}

const DriverApi& driver_api() {
  static const DriverApi api = resolve_driver_api();  // thread-safe one-time initialisation
  return api;
}

// "CUDA_ERROR_NOT_SUPPORTED: operation not supported (CUresult 801)", or "CUresult 801" when the
// driver cannot name it.
void describe_curesult(int result, char* out, size_t size) {
  const DriverApi& api = driver_api();
  const char* name = nullptr;
  const char* text = nullptr;
  using ErrorFn = CUresult(CUDAAPI*)(CUresult, const char**);
  if (api.get_error_name != nullptr) {
    reinterpret_cast<ErrorFn>(api.get_error_name)(static_cast<CUresult>(result), &name);
  }
  if (api.get_error_string != nullptr) {
    reinterpret_cast<ErrorFn>(api.get_error_string)(static_cast<CUresult>(result), &text);
  }
  if (name != nullptr) {
    std::snprintf(out, size, "%s: %s (CUresult %d)", name, text != nullptr ? text : "?", result);
  } else {
    std::snprintf(out, size, "CUresult %d", result);
  }
}

// Batch calls refused and resubmitted as loops (kvo_dma_batch_fallbacks).
std::mutex g_fallback_mu;
uint64_t g_fallbacks = 0;
char g_first_fallback[320] = "";

void note_fallback(size_t count, const char* what) {
  std::lock_guard<std::mutex> lock(g_fallback_mu);
  if (g_fallbacks++ == 0) {
    std::snprintf(g_first_fallback, sizeof(g_first_fallback),
                  "cuMemcpyBatchAsync of %zu copies refused with %s; resubmitted as a "
                  "cudaMemcpyAsync loop",
                  count, what);
  }
}

int submit_loop(const CopyList& copies, cudaStream_t stream) {
  const size_t n = copies.size.size();
  for (size_t i = 0; i < n; ++i) {
    const cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(copies.dst[i]),
                                            reinterpret_cast<const void*>(copies.src[i]),
                                            copies.size[i], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return fail(KVO_ERR_CUDA,
                  "cudaMemcpyAsync failed at copy %zu of %zu (dst=%#llx src=%#llx bytes=%zu): %s "
                  "(%s); copies before it may already be enqueued",
                  i, n, (unsigned long long)copies.dst[i], (unsigned long long)copies.src[i],
                  copies.size[i], cudaGetErrorString(err), cudaGetErrorName(err));
    }
  }
  return KVO_OK;
}

// One cuMemcpyBatchAsync call over every copy (the batch API is available, the stream is not the
// legacy default stream and there is at least one copy); *fail_idx receives the copy the driver
// blamed, or kNoFailIndex.
int call_batch(CopyList& copies, cudaStream_t stream, size_t* fail_idx) {
  *fail_idx = kNoFailIndex;
  const DriverApi& api = driver_api();
  if (api.forced_batch_result != 0) return api.forced_batch_result;
  CUresult res = CUDA_ERROR_NOT_SUPPORTED;
#if CUDART_VERSION >= 12080
  CUmemcpyAttributes attr{};
  attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;  // sources are written by prior work
#if CUDA_VERSION >= 12090
  attr.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;  // keep the SMs to the model
#endif
  size_t attr_idx = 0;
  static_assert(sizeof(CUdeviceptr) == sizeof(uint64_t), "CUdeviceptr must be 64-bit");
  auto* dsts = reinterpret_cast<CUdeviceptr*>(copies.dst.data());
  auto* srcs = reinterpret_cast<CUdeviceptr*>(copies.src.data());
  const size_t count = copies.size.size();
  if (api.batch_v13000 != nullptr) {
#if CUDART_VERSION >= 13000
    res = reinterpret_cast<PFN_cuMemcpyBatchAsync_v13000>(api.batch_v13000)(
        dsts, srcs, copies.size.data(), count, &attr, &attr_idx, 1,
        reinterpret_cast<CUstream>(stream));
#endif
  } else {
    res = reinterpret_cast<PFN_cuMemcpyBatchAsync_v12080>(api.batch_v12080)(
        dsts, srcs, copies.size.data(), count, &attr, &attr_idx, 1, fail_idx,
        reinterpret_cast<CUstream>(stream));
  }
#else
  (void)copies;
  (void)stream;
#endif
  return static_cast<int>(res);
}

// Submits the copies: one batch call when possible (falling back to the loop when the batch API
// refuses it, see batch_fallback.h), else the cudaMemcpyAsync loop.
int submit_dma(CopyList& copies, cudaStream_t stream, bool allow_batch) {
  const size_t count = copies.size.size();
  if (!allow_batch || count == 0 || is_legacy_stream(stream) ||
      !driver_api().batch_available()) {
    return submit_loop(copies, stream);
  }
  size_t fail_idx = kNoFailIndex;
  const int result = call_batch(copies, stream, &fail_idx);
  if (result == 0) return KVO_OK;
  char what[200];
  describe_curesult(result, what, sizeof(what));
  if (!batch_failure_falls_back(result, fail_idx)) {
    if (fail_idx < count) {
      return fail(KVO_ERR_CUDA,
                  "cuMemcpyBatchAsync of %zu copies failed with %s at copy %zu (dst=%#llx "
                  "src=%#llx bytes=%zu)",
                  count, what, fail_idx, (unsigned long long)copies.dst[fail_idx],
                  (unsigned long long)copies.src[fail_idx], copies.size[fail_idx]);
    }
    return fail(KVO_ERR_CUDA, "cuMemcpyBatchAsync of %zu copies failed with %s", count, what);
  }
  note_fallback(count, what);
  const int rc = submit_loop(copies, stream);
  if (rc != KVO_OK) {
    char loop_error[384];
    std::snprintf(loop_error, sizeof(loop_error), "%s", kvo_last_error());
    return fail(rc, "cuMemcpyBatchAsync of %zu copies failed with %s, and the cudaMemcpyAsync loop "
                "it fell back to failed too: %s",
                count, what, loop_error);
  }
  return KVO_OK;
}

}  // namespace

uint64_t side_extent(const KvoBlockSide& s, uint64_t bytes) {
  const uint64_t span =
      s.sub_blocks > 1 ? static_cast<uint64_t>(s.sub_blocks - 1) * s.sub_stride + bytes : bytes;
  return static_cast<uint64_t>(s.num_blocks - 1) * s.block_stride + span;
}

int check_copy_blocks(const KvoCopyRegion* regions, int64_t num_regions, const int64_t* src_ids,
                      const int64_t* dst_ids, int64_t num_pairs) {
  if (num_regions < 0) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "num_regions=%lld must be >= 0", (long long)num_regions);
  }
  if (num_pairs < 0) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "num_pairs=%lld must be >= 0", (long long)num_pairs);
  }
  if (num_regions > 0 && regions == nullptr) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "regions is NULL but num_regions=%lld",
                (long long)num_regions);
  }
  if (num_pairs > 0 && (src_ids == nullptr || dst_ids == nullptr)) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "src_ids and dst_ids must be non-NULL when num_pairs=%lld",
                (long long)num_pairs);
  }
  int64_t checked_begin = -1, checked_count = -1;  // the pair range last checked for duplicates
  for (int64_t r = 0; r < num_regions; ++r) {
    const KvoCopyRegion& rg = regions[r];
    if (rg.bytes == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "regions[%lld].bytes is 0", (long long)r);
    if (rg.pair_begin < 0 || rg.pair_count < 0 || rg.pair_begin > num_pairs ||
        rg.pair_count > num_pairs - rg.pair_begin) {
      return fail(KVO_ERR_INVALID_ARGUMENT,
                  "regions[%lld]: pairs [%lld, %lld + %lld) are not within [0, num_pairs=%lld)",
                  (long long)r, (long long)rg.pair_begin, (long long)rg.pair_begin,
                  (long long)rg.pair_count, (long long)num_pairs);
    }
    int64_t src_limit = 0, dst_limit = 0;
    uint64_t src_end = 0, dst_end = 0;
    if (int rc = check_side(rg.src, rg.bytes, r, "src", &src_limit, &src_end); rc != KVO_OK) return rc;
    if (int rc = check_side(rg.dst, rg.bytes, r, "dst", &dst_limit, &dst_end); rc != KVO_OK) return rc;
    if (rg.src.base < dst_end && rg.dst.base < src_end) {
      return fail(KVO_ERR_INVALID_ARGUMENT,
                  "regions[%lld]: source extent [%#llx, %#llx) and destination extent "
                  "[%#llx, %#llx) overlap",
                  (long long)r, (unsigned long long)rg.src.base, (unsigned long long)src_end,
                  (unsigned long long)rg.dst.base, (unsigned long long)dst_end);
    }
    const int64_t end = rg.pair_begin + rg.pair_count;
    for (int64_t p = rg.pair_begin; p < end; ++p) {
      if (src_ids[p] < 0 || src_ids[p] >= src_limit) {
        return fail(KVO_ERR_INVALID_ARGUMENT,
                    "regions[%lld]: src_ids[%lld]=%lld is outside [0, %lld)", (long long)r,
                    (long long)p, (long long)src_ids[p], (long long)src_limit);
      }
      if (dst_ids[p] < 0 || dst_ids[p] >= dst_limit) {
        return fail(KVO_ERR_INVALID_ARGUMENT,
                    "regions[%lld]: dst_ids[%lld]=%lld is outside [0, %lld)", (long long)r,
                    (long long)p, (long long)dst_ids[p], (long long)dst_limit);
      }
    }
    // Regions of one group share a pair range: check its destination ids for duplicates once.
    if (rg.pair_count > 1 && (rg.pair_begin != checked_begin || rg.pair_count != checked_count)) {
      t_sorted_ids.assign(dst_ids + rg.pair_begin, dst_ids + end);
      std::sort(t_sorted_ids.begin(), t_sorted_ids.end());
      const auto dup = std::adjacent_find(t_sorted_ids.begin(), t_sorted_ids.end());
      if (dup != t_sorted_ids.end()) {
        return fail(KVO_ERR_INVALID_ARGUMENT,
                    "regions[%lld]: destination id %lld appears more than once in pairs "
                    "[%lld, %lld) (two copies would write the same bytes)",
                    (long long)r, (long long)*dup, (long long)rg.pair_begin, (long long)end);
      }
      checked_begin = rg.pair_begin;
      checked_count = rg.pair_count;
    }
  }
  return KVO_OK;
}

}  // namespace kvo

using kvo::clear_error;
using kvo::fail;

extern "C" {

int kvo_dma_batch_available(int* available) {
  clear_error();
  if (available == nullptr) return fail(KVO_ERR_INVALID_ARGUMENT, "available must be non-NULL");
  *available = kvo::driver_api().batch_available() ? 1 : 0;
  return KVO_OK;
}

int kvo_dma_batch_fallbacks(uint64_t* count, char* reason, uint64_t reason_size) {
  clear_error();
  if (count == nullptr || (reason == nullptr && reason_size > 0)) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "count must be non-NULL, and reason when reason_size > 0");
  }
  std::lock_guard<std::mutex> lock(kvo::g_fallback_mu);
  *count = kvo::g_fallbacks;
  if (reason_size > 0) std::snprintf(reason, reason_size, "%s", kvo::g_first_fallback);
  return KVO_OK;
}

int kvo_check_copy_blocks(const KvoCopyRegion* regions, int64_t num_regions,
                          const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs) {
  clear_error();
  return kvo::check_copy_blocks(regions, num_regions, src_ids, dst_ids, num_pairs);
}

int kvo_copy_blocks(int device, const KvoCopyRegion* regions, int64_t num_regions,
                    const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs, int method,
                    int max_ctas, void* stream) {
  clear_error();
  if (device < 0) return fail(KVO_ERR_INVALID_ARGUMENT, "device=%d must be >= 0", device);
  if (method != KVO_COPY_DMA && method != KVO_COPY_DMA_LOOP && method != KVO_COPY_KERNEL) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "method=%d is not a KvoCopyMethod", method);
  }
  if (max_ctas < 0 || max_ctas > kvo::kMaxCtas) {
    return fail(KVO_ERR_INVALID_ARGUMENT, "max_ctas=%d must be in [0, %d]", max_ctas,
                kvo::kMaxCtas);
  }
  if (int rc = kvo::check_copy_blocks(regions, num_regions, src_ids, dst_ids, num_pairs);
      rc != KVO_OK) {
    return rc;
  }
  if (int rc = kvo::bind_device(device); rc != KVO_OK) return rc;
  auto s = static_cast<cudaStream_t>(stream);
  if (method == KVO_COPY_KERNEL) {
    return kvo::copy_blocks_kernel(device, regions, num_regions, src_ids, dst_ids, num_pairs,
                                   max_ctas == 0 ? kvo::kDefaultMaxCtas : max_ctas, s);
  }
  kvo::expand(regions, num_regions, src_ids, dst_ids, &kvo::t_copies);
  return kvo::submit_dma(kvo::t_copies, s, method == KVO_COPY_DMA);
}

}  // extern "C"
