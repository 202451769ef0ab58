// Where and in what precision a base model is loaded: the --device and
// dtype words of `loom serve` (auto | cpu | cuda | cuda:N; auto | bf16 | fp32), read
// the same way by the trainer (Engine::Open) and by a standalone sampler
// (Sampler::OpenStandalone).
#pragma once
#include <ATen/ATen.h>

#include <string>

#include "common/status.h"

namespace loom::engine {

// auto = the first GPU when this build and machine have one, else the CPU.
Status ResolveDevice(const std::string& device, at::Device* out);
// auto = bf16 on a GPU, fp32 on the CPU.
Result<at::ScalarType> ResolveDtype(const std::string& dtype, at::Device device);

// Bytes the host can give now: /proc/meminfo's MemAvailable (free pages plus
// the page cache the kernel can drop, e.g. base weights just read), else the
// free pages.
double HostAvailableBytes();
// Bytes a new allocation can take on `device` now: on CUDA the device's
// memory less the caching allocator's live tensors (the base weights, the
// slots); on the CPU HostAvailableBytes().
double DeviceFreeBytes(at::Device device);

// The CUDA caching allocator's counters on `device` (all 0 elsewhere).
struct AllocatorCounters {
  int64_t allocated = 0;       // held by live tensors now (private graph pools' included)
  int64_t peak_allocated = 0;  // the most since the last ResetAllocatorPeak
  int64_t reserved = 0;        // taken from the driver (live tensors and the cache)
  int64_t mallocs = 0;         // segments taken from the driver (cudaMalloc calls)
  int64_t retries = 0;         // cudaMallocs retried after freeing the cache
};
AllocatorCounters ReadAllocator(at::Device device);
void ResetAllocatorPeak(at::Device device);
// Gives the cached blocks no live tensor holds back to the driver (a graph
// pool's blocks stay with it).
void ReleaseAllocatorCache(at::Device device);
// Waits for all work queued on a CUDA device (nothing elsewhere).
void SynchronizeDevice(at::Device device);
// The PCI bus id of a CUDA device ("0000:1B:00.0", as NVML names it); ""
// for the CPU or a build without CUDA.
std::string PciBusId(at::Device device);

}  // namespace loom::engine
