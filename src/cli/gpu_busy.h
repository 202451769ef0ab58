// GpuBusyMeter: the share of wall time a GPU ran kernels (training or
// sampling, any process), as `nvidia-smi`'s utilization.gpu reports it:
// NVML's utilization rate, the share of its last sample period in which one
// or more kernels ran, polled every 50 ms and averaged over a window. NVML
// comes from the driver (libnvidia-ml.so.1, opened at run time), so a build
// or a machine without it has no meter. Used by `loom bench rl` for issue
// 18's "busy" column.
//
// Threading: Start/Stop from one thread; polls on a thread of its own.
#pragma once
#include <memory>
#include <string>

namespace loom::cli {

class GpuBusyMeter {
 public:
  // The meter of the GPU at pci_bus_id (engine::PciBusId); null where there
  // is none (no id, no NVML, the device unknown to it).
  static std::unique_ptr<GpuBusyMeter> Open(const std::string& pci_bus_id);
  ~GpuBusyMeter();
  GpuBusyMeter(const GpuBusyMeter&) = delete;
  GpuBusyMeter& operator=(const GpuBusyMeter&) = delete;

  void Start();
  // The mean utilization in [0, 1] of the polls since Start; -1 when no poll
  // succeeded.
  double Stop();

 private:
  struct Impl;
  explicit GpuBusyMeter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::cli
