// Block copies: argument checks, the DMA paths (cuMemcpyBatchAsync / cudaMemcpyAsync loop) and
// the dispatch of kvo_copy_blocks.
#include <cuda.h>
#include <cuda_runtime.h>
#if CUDART_VERSION >= 12080
#include <cudaTypedefs.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

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

// cuMemcpyBatchAsync, resolved once through the runtime (the library does not link libcuda).
struct BatchFn {
  void* v13000 = nullptr;  // CUDA 13 signature (no failIdx)
  void* v12080 = nullptr;  // CUDA 12.8 signature (with failIdx)
  bool available() const { return v13000 != nullptr || v12080 != nullptr; }
};

BatchFn resolve_batch_fn() {
  BatchFn fn;
#if CUDART_VERSION >= 12080
  auto query = [](unsigned int version) -> void* {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult result = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuMemcpyBatchAsync", &p, version,
                                                             cudaEnableDefault, &result);
#else
    (void)version;
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuMemcpyBatchAsync", &p, cudaEnableDefault, &result);
#endif
    if (err != cudaSuccess || result != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  };
#if CUDART_VERSION >= 13000
  fn.v13000 = query(13000);
#endif
  if (fn.v13000 == nullptr) fn.v12080 = query(12080);
#endif
  return fn;
}

const BatchFn& batch_fn() {
  static const BatchFn fn = resolve_batch_fn();  // thread-safe one-time initialisation
  return fn;
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
                  "cudaMemcpyAsync failed at copy %zu of %zu (dst=%#llx src=%#llx bytes=%zu): %s; "
                  "copies before it may already be enqueued",
                  i, n, (unsigned long long)copies.dst[i], (unsigned long long)copies.src[i],
                  copies.size[i], cudaGetErrorString(err));
    }
  }
  return KVO_OK;
}

// Submits the copies with one cuMemcpyBatchAsync; *used is false when the batch API cannot be
// used here (no driver support, legacy stream), in which case nothing was enqueued.
int submit_batch(CopyList& copies, cudaStream_t stream, bool* used) {
  *used = false;
#if CUDART_VERSION >= 12080
  const BatchFn& fn = batch_fn();
  if (!fn.available() || is_legacy_stream(stream) || copies.size.empty()) return KVO_OK;
  if (int rc = ensure_context(); rc != KVO_OK) return rc;
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
  CUresult res = CUDA_SUCCESS;
  size_t fail_idx = SIZE_MAX;
  if (fn.v13000 != nullptr) {
#if CUDART_VERSION >= 13000
    res = reinterpret_cast<PFN_cuMemcpyBatchAsync_v13000>(fn.v13000)(
        dsts, srcs, copies.size.data(), count, &attr, &attr_idx, 1,
        reinterpret_cast<CUstream>(stream));
#endif
  } else {
    res = reinterpret_cast<PFN_cuMemcpyBatchAsync_v12080>(fn.v12080)(
        dsts, srcs, copies.size.data(), count, &attr, &attr_idx, 1, &fail_idx,
        reinterpret_cast<CUstream>(stream));
  }
  *used = true;
  if (res != CUDA_SUCCESS) {
    if (fail_idx != SIZE_MAX && fail_idx < count) {
      return fail(KVO_ERR_CUDA,
                  "cuMemcpyBatchAsync of %zu copies failed with CUresult %d at copy %zu "
                  "(dst=%#llx src=%#llx bytes=%zu)",
                  count, static_cast<int>(res), fail_idx,
                  (unsigned long long)copies.dst[fail_idx],
                  (unsigned long long)copies.src[fail_idx], copies.size[fail_idx]);
    }
    return fail(KVO_ERR_CUDA, "cuMemcpyBatchAsync of %zu copies failed with CUresult %d", count,
                static_cast<int>(res));
  }
#else
  (void)copies;
  (void)stream;
#endif
  return KVO_OK;
}

int submit_dma(CopyList& copies, cudaStream_t stream, bool allow_batch) {
  if (allow_batch) {
    bool used = false;
    const int rc = submit_batch(copies, stream, &used);
    if (used || rc != KVO_OK) return rc;
  }
  return submit_loop(copies, stream);
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
  *available = kvo::batch_fn().available() ? 1 : 0;
  return KVO_OK;
}

int kvo_check_copy_blocks(const KvoCopyRegion* regions, int64_t num_regions,
                          const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs) {
  clear_error();
  return kvo::check_copy_blocks(regions, num_regions, src_ids, dst_ids, num_pairs);
}

int kvo_copy_blocks(const KvoCopyRegion* regions, int64_t num_regions, const int64_t* src_ids,
                    const int64_t* dst_ids, int64_t num_pairs, int method, int max_ctas,
                    void* stream) {
  clear_error();
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
  auto s = static_cast<cudaStream_t>(stream);
  if (method == KVO_COPY_KERNEL) {
    return kvo::copy_blocks_kernel(regions, num_regions, src_ids, dst_ids, num_pairs,
                                   max_ctas == 0 ? kvo::kDefaultMaxCtas : max_ctas, s);
  }
  kvo::expand(regions, num_regions, src_ids, dst_ids, &kvo::t_copies);
  return kvo::submit_dma(kvo::t_copies, s, method == KVO_COPY_DMA);
}

int kvo_memcpy_batch(const uint64_t* dst_ptrs, const uint64_t* src_ptrs, const uint64_t* sizes,
                     int64_t n, void* stream) {
  clear_error();
  if (n < 0) return fail(KVO_ERR_INVALID_ARGUMENT, "n=%lld must be >= 0", (long long)n);
  if (n > 0 && (dst_ptrs == nullptr || src_ptrs == nullptr || sizes == nullptr)) {
    return fail(KVO_ERR_INVALID_ARGUMENT,
                "dst_ptrs, src_ptrs and sizes must be non-NULL when n=%lld", (long long)n);
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t d = dst_ptrs[i], s = src_ptrs[i], len = sizes[i];
    if (len == 0) return fail(KVO_ERR_INVALID_ARGUMENT, "sizes[%lld] is 0", (long long)i);
    if (d == 0 || s == 0) {
      return fail(KVO_ERR_INVALID_ARGUMENT, "copy %lld has a null pointer", (long long)i);
    }
    if (d > UINT64_MAX - len || s > UINT64_MAX - len) {
      return fail(KVO_ERR_INVALID_ARGUMENT, "copy %lld wraps around the address space",
                  (long long)i);
    }
    if (d < s + len && s < d + len) {
      return fail(KVO_ERR_INVALID_ARGUMENT, "copy %lld: source and destination overlap",
                  (long long)i);
    }
  }
  kvo::CopyList& copies = kvo::t_copies;
  copies.clear();
  for (int64_t i = 0; i < n; ++i) copies.add(dst_ptrs[i], src_ptrs[i], sizes[i]);
  return kvo::submit_dma(copies, static_cast<cudaStream_t>(stream), /*allow_batch=*/true);
}

}  // extern "C"
