#include "engine/model/device.h"

#if LOOM_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <fstream>
#include <limits>

#include <unistd.h>

namespace loom::engine {

Status ResolveDevice(const std::string& device, at::Device* out) {
  if (device.rfind("cuda:", 0) == 0) {  // one GPU of several: a trainer rank's, a sampler replica's
    if (!at::hasCUDA()) return Status::Invalid("device: " + device + " was asked for but this build or machine has no CUDA");
    const std::string n = device.substr(5);
    if (n.empty() || n.size() > 3 || n.find_first_not_of("0123456789") != std::string::npos)
      return Status::Invalid("device: '" + device + "' is not cuda:N");
    const int index = std::stoi(n);
    if (index >= static_cast<int>(at::getNumGPUs()))
      return Status::Invalid("device: " + device + ", but this machine has " + std::to_string(at::getNumGPUs()) +
                             " GPUs");
    *out = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
    return Status::Ok();
  }
  if (device == "cuda" || (device == "auto" && at::hasCUDA())) {
    if (!at::hasCUDA()) return Status::Invalid("device: cuda was asked for but this build or machine has no CUDA");
    *out = at::Device(at::kCUDA, 0);
    return Status::Ok();
  }
  if (device != "cpu" && device != "auto")
    return Status::Invalid("device: '" + device + "' is not auto, cpu, cuda or cuda:N");
  *out = at::Device(at::kCPU);
  return Status::Ok();
}

Result<at::ScalarType> ResolveDtype(const std::string& dtype, at::Device device) {
  if (dtype == "auto") return device.is_cuda() ? at::kBFloat16 : at::kFloat;
  if (dtype == "bf16" || dtype == "bfloat16") return at::kBFloat16;
  if (dtype == "fp32" || dtype == "float32") return at::kFloat;
  return Status::Invalid("dtype: '" + dtype + "' is not auto, bf16 or fp32");
}

double HostAvailableBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024.0;
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return static_cast<double>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

double DeviceFreeBytes(at::Device device) {
#if LOOM_CUDA_KERNELS
  if (device.is_cuda()) {
    const auto* props = at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index());
    return static_cast<double>(props->totalGlobalMem) - static_cast<double>(ReadAllocator(device).allocated);
  }
#endif
  (void)device;
  return HostAvailableBytes();
}

AllocatorCounters ReadAllocator(at::Device device) {
  AllocatorCounters c;
#if LOOM_CUDA_KERNELS
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    constexpr size_t all = 0;  // StatType::AGGREGATE (its namespace moved between 1.13 and 2.x)
    c.allocated = stats.allocated_bytes[all].current;
    c.peak_allocated = stats.allocated_bytes[all].peak;
    c.reserved = stats.reserved_bytes[all].current;
    c.mallocs = stats.segment[all].allocated;
    c.retries = stats.num_alloc_retries;
  }
#endif
  (void)device;
  return c;
}

void ResetAllocatorPeak(at::Device device) {
#if LOOM_CUDA_KERNELS
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
#endif
  (void)device;
}

void ReleaseAllocatorCache(at::Device device) {
#if LOOM_CUDA_KERNELS
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  (void)device;
}

void SynchronizeDevice(at::Device device) {
#if LOOM_CUDA_KERNELS
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device.index() < 0 ? 0 : device.index());
    c10::cuda::device_synchronize();
  }
#endif
  (void)device;
}

std::string PciBusId(at::Device device) {
#if LOOM_CUDA_KERNELS
  if (device.is_cuda()) {
    char id[32] = {};
    if (cudaDeviceGetPCIBusId(id, sizeof(id), device.index() < 0 ? 0 : device.index()) == cudaSuccess) return id;
  }
#endif
  (void)device;
  return {};
}

}  // namespace loom::engine
