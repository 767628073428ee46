// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
// Device views for the kernel path: the device address through which a kernel reaches a region
// side, resolved once and remembered where that is safe (see device_view in kvo_common.cuh).
//
// Without a cache a job costs two cudaPointerGetAttributes calls per region side (four per
// region), although the handlers use the same few region sides in every job. Remembered:
//   * host ranges this library registered: their device mapping, per device, until
//     kvo_host_unregister forgets them (kvo_host_register's ranges are the CPU side of every
//     offload job);
//   * device memory extents found valid (the GPU side), whose view is the address itself, for the
//     life of the process: the library cannot see device memory being freed, but a job must not
//     address freed memory anyway, and a device address never becomes host memory.
// Host memory registered elsewhere (e.g. cudaHostAlloc'd) may be freed behind the library's back,
// so it is probed on every call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "kv_offload.h"
#include "kvo_common.cuh"

namespace kvo {
namespace {

// A host range registered by kvo_host_register.
struct HostRange {
  uint64_t base;
  uint64_t bytes;
  bool mapped;          // registered with KVO_HOST_REGISTER_MAPPED
  uint64_t generation;  // tells a re-registration at the same base from the range it replaced
  std::vector<uint64_t> dev_base;  // [device]: device address of `base`; 0 = not resolved yet
};

struct DeviceExtent {
  int device;
  uint64_t base;
  uint64_t extent;
  bool operator==(const DeviceExtent& o) const {
    return device == o.device && base == o.base && extent == o.extent;
  }
};

struct DeviceExtentHash {
  size_t operator()(const DeviceExtent& k) const {
    const std::hash<uint64_t> h;
    return h(k.base) ^ (h(k.extent) * 31) ^ static_cast<size_t>(k.device);
  }
};

// Bounds the set when callers keep passing new extents (e.g. tests allocating buffers in a loop).
constexpr size_t kMaxDeviceExtents = 4096;

std::mutex g_mu;  // guards everything below; never held across a CUDA call
std::vector<HostRange> g_host;
uint64_t g_generation = 0;
std::unordered_set<DeviceExtent, DeviceExtentHash> g_device_extents;

// Looks [addr, addr + extent) up with cudaPointerGetAttributes at both ends, so that an extent
// leaving its allocation or registration is refused. *device_memory: it is memory of `device`.
int probe(int device, uint64_t addr, uint64_t extent, int64_t r, const char* which,
          uint64_t* out, bool* device_memory) {
  uint64_t resolved[2] = {0, 0};
  const uint64_t probes[2] = {addr, addr + extent - 1};
  *device_memory = false;
  for (int k = 0; k < 2; ++k) {
    cudaPointerAttributes attrs{};
    const cudaError_t err =
        cudaPointerGetAttributes(&attrs, reinterpret_cast<const void*>(probes[k]));
    if (err != cudaSuccess) return fail_cuda(err, "cudaPointerGetAttributes");
    if (attrs.type == cudaMemoryTypeUnregistered || attrs.devicePointer == nullptr) {
      return fail(KVO_ERR_INVALID_ARGUMENT,
                  "regions[%lld].%s: address %#llx (%s byte of its extent) is neither device "
                  "memory nor host memory registered with KVO_HOST_REGISTER_MAPPED; the kernel "
                  "path cannot reach it",
                  (long long)r, which, (unsigned long long)probes[k], k == 0 ? "first" : "last");
    }
    if (attrs.type == cudaMemoryTypeDevice && attrs.device != device) {
      return fail(KVO_ERR_INVALID_ARGUMENT,
                  "regions[%lld].%s: address %#llx is memory of device %d, but the copy runs on "
                  "device %d",
                  (long long)r, which, (unsigned long long)probes[k], attrs.device, device);
    }
    if (k == 0) *device_memory = attrs.type == cudaMemoryTypeDevice;
    resolved[k] = reinterpret_cast<uint64_t>(attrs.devicePointer);
  }
  if (resolved[1] - resolved[0] != extent - 1) {
    return fail(KVO_ERR_INVALID_ARGUMENT,
                "regions[%lld].%s: extent [%#llx, +%llu) is not one contiguous mapped range",
                (long long)r, which, (unsigned long long)addr, (unsigned long long)extent);
  }
  *out = resolved[0];
  return KVO_OK;
}

}  // namespace

void note_host_registration(uint64_t base, uint64_t bytes, unsigned int flags) {
  std::lock_guard<std::mutex> lock(g_mu);
  // A record left at this base can only be stale (CUDA refuses overlapping registrations).
  g_host.erase(std::remove_if(g_host.begin(), g_host.end(),
                              [base](const HostRange& h) { return h.base == base; }),
               g_host.end());
  g_host.push_back(
      HostRange{base, bytes, (flags & KVO_HOST_REGISTER_MAPPED) != 0, ++g_generation, {}});
}

void forget_host_registration(uint64_t base) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_host.erase(std::remove_if(g_host.begin(), g_host.end(),
                              [base](const HostRange& h) { return h.base == base; }),
               g_host.end());
}

int device_view(int device, uint64_t addr, uint64_t extent, int64_t r, const char* which,
                uint64_t* out) {
  const uint64_t last = addr + extent - 1;  // extent >= 1 and does not wrap (checked)
  uint64_t generation = 0;
  uint64_t range_base = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (const HostRange& h : g_host) {
      if (!h.mapped || addr < h.base || last - h.base >= h.bytes) continue;
      const size_t d = static_cast<size_t>(device);
      if (d < h.dev_base.size() && h.dev_base[d] != 0) {
        *out = h.dev_base[d] + (addr - h.base);
        return KVO_OK;
      }
      generation = h.generation;
      range_base = h.base;
      break;
    }
    if (generation == 0 && g_device_extents.count(DeviceExtent{device, addr, extent}) != 0) {
      *out = addr;
      return KVO_OK;
    }
  }
  if (generation != 0) {
    // First use of this registration on `device`: one lookup, remembered unless the range was
    // unregistered (or replaced) meanwhile.
    void* mapped = nullptr;
    const cudaError_t err =
        cudaHostGetDevicePointer(&mapped, reinterpret_cast<void*>(range_base), 0);
    if (err != cudaSuccess) return fail_cuda(err, "cudaHostGetDevicePointer");
    const uint64_t dev_base = reinterpret_cast<uint64_t>(mapped);
    std::lock_guard<std::mutex> lock(g_mu);
    for (HostRange& h : g_host) {
      if (h.generation != generation) continue;
      if (h.dev_base.size() <= static_cast<size_t>(device)) h.dev_base.resize(device + 1, 0);
      h.dev_base[device] = dev_base;
    }
    *out = dev_base + (addr - range_base);
    return KVO_OK;
  }
  bool device_memory = false;
  if (int rc = probe(device, addr, extent, r, which, out, &device_memory); rc != KVO_OK) {
    return rc;
  }
  if (device_memory && *out == addr) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_device_extents.size() >= kMaxDeviceExtents) g_device_extents.clear();
    g_device_extents.insert(DeviceExtent{device, addr, extent});
  }
  return KVO_OK;
}

}  // namespace kvo
