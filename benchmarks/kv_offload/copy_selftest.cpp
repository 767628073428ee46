// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
// Standalone GPU self-test and throughput check of the CUDA copy library, through its C API only.
//
// Needs no Python, torch or CUDA toolkit: build with any C++17 compiler against csrc/kv_offload.h
// and link the built library, e.g.
//
//   g++ -O2 -std=c++17 -pthread -Icsrc benchmarks/kv_offload/copy_selftest.cpp
//       vllm/_kv_offload_cuda*.so -Wl,-rpath,"$PWD/vllm" -o build/copy_selftest   (one line)
//   build/copy_selftest [--no-bench] [--forced-batch-result=N]
//   # exit 0: all passed, 1: a failure, 77: no usable GPU (after the checks that need none)
//
// Checks without a GPU: the decision which failed cuMemcpyBatchAsync calls fall back to the
// cudaMemcpyAsync loop (csrc/batch_fallback.h). With a GPU, for every copy method (DMA, DMA_LOOP,
// KERNEL): bit-exact device <-> pinned host copies of scattered blocks with sub-blocks
// (block_size_factor), padded pages and odd offsets, whole buffers compared with a host reference
// (bytes outside the job must be untouched); a load enqueued right after a store of the same rows,
// on another stream ordered by an event, reads the stored bytes. Also: a job submitted from a
// thread that never used CUDA; device arguments that are out of range; the kernel path refusing
// host memory once it is unregistered. Then prints the throughput of N scattered blocks vs one
// contiguous copy.
//
// --forced-batch-result=N sets VLLM_KV_OFFLOAD_TEST_BATCH_RESULT=N (every cuMemcpyBatchAsync call
// "fails" with CUresult N) and runs the DMA checks only: a result that falls back must still give
// bit-exact copies, counted by kvo_dma_batch_fallbacks and named; any other must fail the copy with
// a message naming the CUresult.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "batch_fallback.h"
#include "kv_offload.h"

namespace {

int g_failures = 0;
constexpr int kDev = 0;  // every GPU check runs on device 0

void must(int rc, const char* what) {
  if (rc != KVO_OK) {
    std::fprintf(stderr, "FATAL: %s -> %d: %s\n", what, rc, kvo_last_error());
    std::exit(1);
  }
}

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) ++g_failures;
}

const char* method_name(int m) {
  return m == KVO_COPY_DMA ? "dma" : m == KVO_COPY_DMA_LOOP ? "dma-loop" : "kernel";
}

uint64_t address(const KvoBlockSide& s, int64_t id) {
  return s.base + static_cast<uint64_t>(id / s.sub_blocks) * s.block_stride +
         static_cast<uint64_t>(id % s.sub_blocks) * s.sub_stride;
}

// Applies a job to mirrors of the memory (byte vectors standing for [base, base + size)).
void reference(const std::vector<KvoCopyRegion>& regions, const std::vector<int64_t>& src_ids,
               const std::vector<int64_t>& dst_ids, const std::vector<uint8_t>& src_mem,
               uint64_t src_base, std::vector<uint8_t>& dst_mem, uint64_t dst_base) {
  for (const KvoCopyRegion& r : regions) {
    for (int64_t p = r.pair_begin; p < r.pair_begin + r.pair_count; ++p) {
      const uint64_t s = address(r.src, src_ids[p]) - src_base;
      const uint64_t d = address(r.dst, dst_ids[p]) - dst_base;
      std::memcpy(dst_mem.data() + d, src_mem.data() + s, r.bytes);
    }
  }
}

struct Mem {
  size_t bytes;
  uint8_t* host;   // pinned + mapped host buffer
  uint64_t dev;    // device buffer of the same size
};

Mem alloc(size_t bytes, std::mt19937_64& rng) {
  Mem m{bytes, static_cast<uint8_t*>(std::aligned_alloc(4096, bytes)), 0};
  for (size_t i = 0; i < bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(m.host + i, &v, std::min<size_t>(8, bytes - i));
  }
  must(kvo_host_register(kDev, m.host, bytes, KVO_HOST_REGISTER_PORTABLE | KVO_HOST_REGISTER_MAPPED,
                         nullptr),
       "kvo_host_register");
  must(kvo_device_malloc(kDev, bytes, &m.dev), "kvo_device_malloc");
  std::vector<uint8_t> init(bytes);
  for (auto& b : init) b = static_cast<uint8_t>(rng());
  must(kvo_memcpy_sync(kDev, m.dev, reinterpret_cast<uint64_t>(init.data()), bytes), "init device");
  return m;
}

void release(Mem& m) {
  must(kvo_device_free(kDev, m.dev), "kvo_device_free");
  must(kvo_host_unregister(kDev, m.host), "kvo_host_unregister");
  std::free(m.host);
}

std::vector<uint8_t> read_device(const Mem& m) {
  std::vector<uint8_t> out(m.bytes);
  must(kvo_memcpy_sync(kDev, reinterpret_cast<uint64_t>(out.data()), m.dev, m.bytes), "read device");
  return out;
}

// A "KV cache" of `tensors` tensors on the device (page `page`, stride `page + pad`) and CPU rows
// holding k sub-blocks of every tensor; store GPU -> CPU, then load CPU -> GPU, both checked.
void round_trip(int method, int64_t page, int64_t pad, int64_t k, int tensors, uint64_t bytes,
                int64_t shift, std::mt19937_64& rng) {
  const int64_t gpu_blocks = 64, cpu_blocks = 24, n_cpu = 5, n_gpu = n_cpu * k;
  const int64_t gpu_stride = page + pad, row = tensors * page * k + 64;
  Mem gpu = alloc(static_cast<size_t>(tensors * gpu_blocks * gpu_stride + 4096), rng);
  Mem cpu = alloc(static_cast<size_t>(cpu_blocks * row + 4096), rng);
  std::vector<KvoCopyRegion> store, load;
  for (int t = 0; t < tensors; ++t) {
    KvoBlockSide g{gpu.dev + shift + t * gpu_blocks * gpu_stride, (uint64_t)gpu_stride,
                   (uint64_t)page, gpu_blocks, 1};
    KvoBlockSide c{reinterpret_cast<uint64_t>(cpu.host) + shift + t * page * k, (uint64_t)row,
                   (uint64_t)page, cpu_blocks, k};
    store.push_back({g, c, bytes, 0, n_gpu});
    load.push_back({c, g, bytes, 0, n_gpu});
  }
  std::vector<int64_t> gpu_perm(gpu_blocks), cpu_perm(cpu_blocks);
  std::iota(gpu_perm.begin(), gpu_perm.end(), 0);
  std::iota(cpu_perm.begin(), cpu_perm.end(), 0);
  std::shuffle(gpu_perm.begin(), gpu_perm.end(), rng);
  std::shuffle(cpu_perm.begin(), cpu_perm.end(), rng);
  std::vector<int64_t> gpu_ids(gpu_perm.begin(), gpu_perm.begin() + n_gpu);
  std::vector<int64_t> load_ids(gpu_perm.begin() + n_gpu, gpu_perm.begin() + 2 * n_gpu);
  std::vector<int64_t> cpu_ids;
  for (int64_t i = 0; i < n_cpu; ++i) {
    for (int64_t j = 0; j < k; ++j) cpu_ids.push_back(cpu_perm[i] * k + j);
  }
  // Host mirrors of the initial contents; the device mirror is read back, the CPU one copied.
  std::vector<uint8_t> gpu_mem = read_device(gpu);
  std::vector<uint8_t> cpu_mem(cpu.host, cpu.host + cpu.bytes);
  const uint64_t cpu_base = reinterpret_cast<uint64_t>(cpu.host);
  reference(store, gpu_ids, cpu_ids, gpu_mem, gpu.dev, cpu_mem, cpu_base);
  reference(load, cpu_ids, load_ids, cpu_mem, cpu_base, gpu_mem, gpu.dev);

  void *s1 = nullptr, *s2 = nullptr, *ev = nullptr;
  must(kvo_stream_create(kDev, &s1, 0), "stream");
  must(kvo_stream_create(kDev, &s2, 0), "stream");
  must(kvo_event_create(kDev, &ev, 0), "event");
  must(kvo_copy_blocks(kDev, store.data(), tensors, gpu_ids.data(), cpu_ids.data(), n_gpu, method, 0, s1),
       "store");
  // The load runs on another stream, ordered after the store only by the event (as handlers do).
  must(kvo_event_record(kDev, ev, s1), "record");
  must(kvo_stream_wait_event(kDev, s2, ev), "wait");
  must(kvo_copy_blocks(kDev, load.data(), tensors, cpu_ids.data(), load_ids.data(), n_gpu, method, 0, s2),
       "load");
  must(kvo_stream_synchronize(kDev, s2), "sync");
  char what[200];
  std::snprintf(what, sizeof(what),
                "%-8s page=%lld pad=%lld k=%lld tensors=%d bytes=%llu shift=%lld", method_name(method),
                (long long)page, (long long)pad, (long long)k, tensors, (unsigned long long)bytes,
                (long long)shift);
  check(std::memcmp(cpu_mem.data(), cpu.host, cpu.bytes) == 0, std::string(what) + " store");
  check(read_device(gpu) == gpu_mem, std::string(what) + " load-after-store");
  kvo_stream_destroy(kDev, s1);
  kvo_stream_destroy(kDev, s2);
  kvo_event_destroy(kDev, ev);
  release(gpu);
  release(cpu);
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// GB/s of `region` copies (pairs given) on `stream`, median of reps.
double throughput(const std::vector<KvoCopyRegion>& regions, const std::vector<int64_t>& src,
                  const std::vector<int64_t>& dst, int method, void* stream, uint64_t total) {
  void *a = nullptr, *b = nullptr;
  must(kvo_event_create(kDev, &a, 1), "event");
  must(kvo_event_create(kDev, &b, 1), "event");
  std::vector<double> times;
  for (int rep = 0; rep < 9; ++rep) {
    must(kvo_event_record(kDev, a, stream), "record");
    must(kvo_copy_blocks(kDev, regions.data(), (int64_t)regions.size(), src.data(), dst.data(),
                         (int64_t)src.size(), method, 0, stream),
         "copy");
    must(kvo_event_record(kDev, b, stream), "record");
    must(kvo_event_synchronize(kDev, b), "sync");
    float ms = 0;
    must(kvo_event_elapsed_ms(kDev, a, b, &ms), "elapsed");
    if (rep >= 2) times.push_back(ms / 1000.0);
  }
  kvo_event_destroy(kDev, a);
  kvo_event_destroy(kDev, b);
  std::sort(times.begin(), times.end());
  return total / times[times.size() / 2] / 1e9;
}

void bench(std::mt19937_64& rng) {
  std::printf("\n| method | direction | block | blocks | job GB/s | contiguous GB/s | ratio |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|\n");
  const uint64_t job = uint64_t{256} << 20;
  void* stream = nullptr;
  must(kvo_stream_create(kDev, &stream, 0), "stream");
  for (uint64_t kib : {16, 64, 256, 1024, 2048}) {
    const uint64_t block = kib << 10;
    const int64_t n = static_cast<int64_t>(job / block);
    Mem m = alloc(static_cast<size_t>(2 * job), rng);
    std::vector<int64_t> a(2 * n), b(2 * n);
    std::iota(a.begin(), a.end(), 0);
    std::iota(b.begin(), b.end(), 0);
    std::shuffle(a.begin(), a.end(), rng);
    std::shuffle(b.begin(), b.end(), rng);
    a.resize(n);
    b.resize(n);
    const uint64_t host = reinterpret_cast<uint64_t>(m.host);
    for (int dir = 0; dir < 2; ++dir) {
      KvoBlockSide g{m.dev, block, block, 2 * n, 1}, c{host, block, block, 2 * n, 1};
      KvoBlockSide gc{m.dev, job, job, 2, 1}, cc{host, job, job, 2, 1};
      std::vector<KvoCopyRegion> r = {dir == 0 ? KvoCopyRegion{g, c, block, 0, n}
                                               : KvoCopyRegion{c, g, block, 0, n}};
      std::vector<KvoCopyRegion> whole = {dir == 0 ? KvoCopyRegion{gc, cc, job, 0, 1}
                                                   : KvoCopyRegion{cc, gc, job, 0, 1}};
      const double base = throughput(whole, {0}, {1}, KVO_COPY_DMA_LOOP, stream, job);
      for (int method : {KVO_COPY_DMA, KVO_COPY_DMA_LOOP, KVO_COPY_KERNEL}) {
        const double gbps = throughput(r, a, b, method, stream, job);
        std::printf("| %s | %s | %llu KiB | %lld | %.2f | %.2f | %.2f |\n", method_name(method),
                    dir == 0 ? "store" : "load", (unsigned long long)kib, (long long)n, gbps,
                    base, gbps / base);
      }
    }
    release(m);
  }
  kvo_stream_destroy(kDev, stream);
}

// The fallback decision of csrc/batch_fallback.h, for every CUresult that matters.
void fallback_decision_checks() {
  struct Case {
    int result;
    size_t fail_idx;
    bool falls_back;
    const char* what;
  };
  const Case cases[] = {
      {801, kvo::kNoFailIndex, true, "NOT_SUPPORTED, no copy blamed"},
      {801, 3, true, "NOT_SUPPORTED at a copy (a memory pair the batch API cannot do)"},
      {1, kvo::kNoFailIndex, true, "INVALID_VALUE, no copy blamed (attributes refused)"},
      {1, 3, false, "INVALID_VALUE at a copy (the memory's fault)"},
      {700, kvo::kNoFailIndex, false, "ILLEGAL_ADDRESS"},
      {201, kvo::kNoFailIndex, false, "INVALID_CONTEXT"},
      {2, kvo::kNoFailIndex, false, "OUT_OF_MEMORY"},
      {999, kvo::kNoFailIndex, false, "UNKNOWN"},
  };
  for (const Case& c : cases) {
    const bool got = kvo::batch_failure_falls_back(c.result, c.fail_idx);
    check(got == c.falls_back, std::string("batch fallback decision: ") + c.what + " -> " +
                                   (c.falls_back ? "loop" : "fail"));
  }
}

bool contains(const char* haystack, const char* needle) {
  return haystack != nullptr && std::strstr(haystack, needle) != nullptr;
}

// Device binding: a job from a thread that never used CUDA (the runtime's and the driver's
// current context are set by the call itself), and device ordinals that do not exist.
void device_checks(int count, std::mt19937_64& rng) {
  const int64_t page = 4096, n = 8;
  Mem gpu = alloc(static_cast<size_t>(2 * n * page), rng);
  Mem cpu = alloc(static_cast<size_t>(2 * n * page), rng);
  std::vector<uint8_t> expected = read_device(gpu);
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(expected.data() + (n + i) * page, cpu.host + i * page, page);
  }
  void* stream = nullptr;
  must(kvo_stream_create(kDev, &stream, 0), "stream");
  KvoBlockSide c{reinterpret_cast<uint64_t>(cpu.host), (uint64_t)page, (uint64_t)page, 2 * n, 1};
  KvoBlockSide g{gpu.dev, (uint64_t)page, (uint64_t)page, 2 * n, 1};
  std::vector<KvoCopyRegion> load = {{c, g, (uint64_t)page, 0, n}};
  std::vector<int64_t> src(n), dst(n);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), n);
  int rc = -1;
  std::string error;
  std::thread fresh([&] {
    rc = kvo_copy_blocks(kDev, load.data(), 1, src.data(), dst.data(), n, KVO_COPY_DMA, 0, stream);
    if (rc == KVO_OK) rc = kvo_stream_synchronize(kDev, stream);
    error = kvo_last_error();
  });
  fresh.join();
  check(rc == KVO_OK, "dma job from a thread that never used CUDA: " + error);
  check(read_device(gpu) == expected, "dma job from a fresh thread is bit-exact");
  void* bad = nullptr;
  rc = kvo_stream_create(count, &bad, 0);
  check(rc == KVO_ERR_CUDA && contains(kvo_last_error(), "cudaSetDevice"),
        std::string("device=count is refused by CUDA, naming cudaSetDevice: ") + kvo_last_error());
  rc = kvo_stream_create(-1, &bad, 0);
  check(rc == KVO_ERR_INVALID_ARGUMENT, "device=-1 is an argument error");

  // The kernel path remembers the mapping of a registered range until it is unregistered.
  rc = kvo_copy_blocks(kDev, load.data(), 1, src.data(), dst.data(), n, KVO_COPY_KERNEL, 0, stream);
  check(rc == KVO_OK, "kernel job over a registered range");
  must(kvo_stream_synchronize(kDev, stream), "sync");
  must(kvo_host_unregister(kDev, cpu.host), "kvo_host_unregister");
  rc = kvo_copy_blocks(kDev, load.data(), 1, src.data(), dst.data(), n, KVO_COPY_KERNEL, 0, stream);
  check(rc == KVO_ERR_INVALID_ARGUMENT && contains(kvo_last_error(), "cannot reach"),
        std::string("kernel job over an unregistered range is refused: ") + kvo_last_error());
  must(kvo_host_register(kDev, cpu.host, cpu.bytes,
                         KVO_HOST_REGISTER_PORTABLE | KVO_HOST_REGISTER_MAPPED, nullptr),
       "kvo_host_register again");
  rc = kvo_copy_blocks(kDev, load.data(), 1, src.data(), dst.data(), n, KVO_COPY_KERNEL, 0, stream);
  check(rc == KVO_OK, "kernel job after registering the range again");
  must(kvo_stream_synchronize(kDev, stream), "sync");
  check(read_device(gpu) == expected, "kernel jobs around an unregistration are bit-exact");
  kvo_stream_destroy(kDev, stream);
  release(gpu);
  release(cpu);
}

// DMA jobs while every batch call "fails" with `forced` (VLLM_KV_OFFLOAD_TEST_BATCH_RESULT).
void forced_batch_checks(int forced, std::mt19937_64& rng) {
  char name[64];
  std::snprintf(name, sizeof(name), "CUresult %d", forced);
  if (kvo::batch_failure_falls_back(forced, kvo::kNoFailIndex)) {
    round_trip(KVO_COPY_DMA, 4096, 0, 1, 4, 4096, 0, rng);
    round_trip(KVO_COPY_DMA, 1000, 24, 2, 3, 777, 3, rng);
    uint64_t fallbacks = 0;
    char reason[512];
    must(kvo_dma_batch_fallbacks(&fallbacks, reason, sizeof(reason)), "kvo_dma_batch_fallbacks");
    // Two round trips, a store and a load each.
    check(fallbacks == 4, "every refused batch call fell back (" + std::to_string(fallbacks) + ")");
    check(contains(reason, name), std::string("the fallback reason names the CUresult: ") + reason);
    check(forced != 801 || contains(reason, "CUDA_ERROR_NOT_SUPPORTED"),
          std::string("the fallback reason has the driver's name for it: ") + reason);
    return;
  }
  Mem gpu = alloc(4 * 4096, rng);
  Mem cpu = alloc(4 * 4096, rng);
  void* stream = nullptr;
  must(kvo_stream_create(kDev, &stream, 0), "stream");
  KvoBlockSide c{reinterpret_cast<uint64_t>(cpu.host), 4096, 4096, 4, 1};
  KvoBlockSide g{gpu.dev, 4096, 4096, 4, 1};
  KvoCopyRegion store{g, c, 4096, 0, 2};
  const int64_t src[2] = {0, 1}, dst[2] = {2, 3};
  const int rc = kvo_copy_blocks(kDev, &store, 1, src, dst, 2, KVO_COPY_DMA, 0, stream);
  const std::string msg = kvo_last_error();
  check(rc == KVO_ERR_CUDA, "a batch failure that does not fall back fails the job: " + msg);
  check(contains(msg.c_str(), "cuMemcpyBatchAsync") && contains(msg.c_str(), name),
        "the failure names the batch call and its CUresult: " + msg);
  check(forced != 700 || contains(msg.c_str(), "CUDA_ERROR_ILLEGAL_ADDRESS"),
        "the failure has the driver's name for it: " + msg);
  must(kvo_stream_synchronize(kDev, stream), "sync");
  kvo_stream_destroy(kDev, stream);
  release(gpu);
  release(cpu);
}

}  // namespace

int main(int argc, char** argv) {
  bool run_bench = true;
  int forced = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-bench") == 0) {
      run_bench = false;
    } else if (std::strncmp(argv[i], "--forced-batch-result=", 22) == 0) {
      forced = std::atoi(argv[i] + 22);
    } else {
      std::fprintf(stderr, "usage: %s [--no-bench] [--forced-batch-result=N]\n", argv[0]);
      return 2;
    }
  }
  fallback_decision_checks();
  if (forced != 0) {
    // Read by the library when it first resolves the batch API (kvo_dma_batch_available below).
    setenv("VLLM_KV_OFFLOAD_TEST_BATCH_RESULT", std::to_string(forced).c_str(), 1);
  }
  const int skip = g_failures == 0 ? 77 : 1;
  int count = 0;
  if (kvo_device_count(&count) != KVO_OK) {
    std::printf("ABI %d; SKIP: CUDA is unusable: %s\n", kvo_abi_version(), kvo_last_error());
    return skip;
  }
  int batch = 0;
  must(kvo_dma_batch_available(&batch), "kvo_dma_batch_available");
  std::printf("ABI %d, %d GPU(s), cuMemcpyBatchAsync %s\n", kvo_abi_version(), count,
              batch ? "available" : "unavailable");
  if (count == 0) {
    std::printf("SKIP: no GPU\n");
    return skip;
  }
  std::mt19937_64 rng(1234);
  const double t0 = now();
  if (forced != 0) {
    if (!batch) {
      std::printf("SKIP: --forced-batch-result needs cuMemcpyBatchAsync\n");
      return skip;
    }
    forced_batch_checks(forced, rng);
    std::printf("checks done in %.1f s, %d failure(s)\n", now() - t0, g_failures);
    return g_failures == 0 ? 0 : 1;
  }
  for (int method : {KVO_COPY_DMA, KVO_COPY_DMA_LOOP, KVO_COPY_KERNEL}) {
    round_trip(method, 4096, 0, 1, 4, 4096, 0, rng);      // per-layer pages, no padding
    round_trip(method, 16384, 512, 4, 2, 16384, 0, rng);  // padded GPU pages, k = 4
    round_trip(method, 1000, 24, 2, 3, 777, 3, rng);      // odd sizes and offsets
    round_trip(method, 2 << 20, 0, 2, 1, 2 << 20, 0, rng);  // cross-layer-sized pages
  }
  device_checks(count, rng);
  uint64_t fallbacks = 0;
  must(kvo_dma_batch_fallbacks(&fallbacks, nullptr, 0), "kvo_dma_batch_fallbacks");
  check(fallbacks == 0, "no batch call fell back (" + std::to_string(fallbacks) + ")");
  std::printf("checks done in %.1f s, %d failure(s)\n", now() - t0, g_failures);
  if (run_bench) bench(rng);
  return g_failures == 0 ? 0 : 1;
}
