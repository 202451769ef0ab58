#include "engine/model/device.h"

namespace loom::engine {

Status ResolveDevice(const std::string& device, at::Device* out) {
  if (device == "cuda" || (device == "auto" && at::hasCUDA())) {
    if (!at::hasCUDA()) return Status::Invalid("device: cuda was asked for but this build or machine has no CUDA");
    *out = at::Device(at::kCUDA, 0);
    return Status::Ok();
  }
  if (device != "cpu" && device != "auto") return Status::Invalid("device: '" + device + "' is not auto, cpu or cuda");
  *out = at::Device(at::kCPU);
  return Status::Ok();
}

Result<at::ScalarType> ResolveDtype(const std::string& dtype, at::Device device) {
  if (dtype == "auto") return device.is_cuda() ? at::kBFloat16 : at::kFloat;
  if (dtype == "bf16" || dtype == "bfloat16") return at::kBFloat16;
  if (dtype == "fp32" || dtype == "float32") return at::kFloat;
  return Status::Invalid("dtype: '" + dtype + "' is not auto, bf16 or fp32");
}

}  // namespace loom::engine
