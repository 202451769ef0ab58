#include "cli/gpu_busy.h"

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace loom::cli {
namespace {

// The few NVML entry points used, as the driver's C library exports them
// (nvml.h is not installed here; these are its documented signatures).
using NvmlDevice = void*;
struct NvmlUtilization {
  unsigned int gpu;     // percent of the sample period in which a kernel ran
  unsigned int memory;  // percent in which device memory was read or written
};
using InitFn = int (*)();
using ShutdownFn = int (*)();
using HandleByPciFn = int (*)(const char*, NvmlDevice*);
using UtilizationFn = int (*)(NvmlDevice, NvmlUtilization*);
constexpr int kNvmlSuccess = 0;
constexpr auto kPollPeriod = std::chrono::milliseconds(50);

}  // namespace

struct GpuBusyMeter::Impl {
  void* lib = nullptr;
  ShutdownFn shutdown = nullptr;
  UtilizationFn utilization = nullptr;
  NvmlDevice device = nullptr;

  std::mutex mu;
  std::condition_variable cv;
  bool polling = false;
  double sum = 0;
  long polls = 0;
  std::thread poller;

  ~Impl() {
    StopPolling();
    if (shutdown) shutdown();
    if (lib) dlclose(lib);
  }
  void StopPolling() {
    {
      std::lock_guard<std::mutex> l(mu);
      polling = false;
    }
    cv.notify_all();
    if (poller.joinable()) poller.join();
  }
  void Poll() {
    std::unique_lock<std::mutex> l(mu);
    while (polling) {
      NvmlUtilization u{};
      l.unlock();
      const bool ok = utilization(device, &u) == kNvmlSuccess;
      l.lock();
      if (ok) {
        sum += u.gpu / 100.0;
        ++polls;
      }
      cv.wait_for(l, kPollPeriod, [&] { return !polling; });
    }
  }
};

std::unique_ptr<GpuBusyMeter> GpuBusyMeter::Open(const std::string& pci_bus_id) {
  if (pci_bus_id.empty()) return nullptr;
  auto impl = std::make_unique<Impl>();
  impl->lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!impl->lib) return nullptr;
  auto init = reinterpret_cast<InitFn>(dlsym(impl->lib, "nvmlInit_v2"));
  auto by_pci = reinterpret_cast<HandleByPciFn>(dlsym(impl->lib, "nvmlDeviceGetHandleByPciBusId_v2"));
  impl->utilization = reinterpret_cast<UtilizationFn>(dlsym(impl->lib, "nvmlDeviceGetUtilizationRates"));
  auto shutdown = reinterpret_cast<ShutdownFn>(dlsym(impl->lib, "nvmlShutdown"));
  if (!init || !by_pci || !impl->utilization || !shutdown || init() != kNvmlSuccess) return nullptr;
  impl->shutdown = shutdown;
  NvmlUtilization probe{};
  if (by_pci(pci_bus_id.c_str(), &impl->device) != kNvmlSuccess ||
      impl->utilization(impl->device, &probe) != kNvmlSuccess)
    return nullptr;
  return std::unique_ptr<GpuBusyMeter>(new GpuBusyMeter(std::move(impl)));
}

GpuBusyMeter::GpuBusyMeter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuBusyMeter::~GpuBusyMeter() = default;

void GpuBusyMeter::Start() {
  impl_->StopPolling();
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->sum = 0;
  impl_->polls = 0;
  impl_->polling = true;
  impl_->poller = std::thread([this] { impl_->Poll(); });
}

double GpuBusyMeter::Stop() {
  impl_->StopPolling();
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->polls > 0 ? impl_->sum / static_cast<double>(impl_->polls) : -1.0;
}

}  // namespace loom::cli
