// tensor_io: safetensors views → at::Tensor (copying) and at::Tensor → writer.
#include "engine/io/tensor_io.h"

#include <c10/core/GradMode.h>

#include <cstring>

namespace loom::engine {
namespace {

bool IsFloat(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

}  // namespace

Result<at::ScalarType> ScalarTypeFromSafetensors(const std::string& dtype) {
  if (dtype == "F32") return at::kFloat;
  if (dtype == "F16") return at::kHalf;
  if (dtype == "BF16") return at::kBFloat16;
  if (dtype == "F64") return at::kDouble;
  if (dtype == "I64") return at::kLong;
  if (dtype == "I32") return at::kInt;
  if (dtype == "I16") return at::kShort;
  if (dtype == "I8") return at::kChar;
  if (dtype == "U8") return at::kByte;
  if (dtype == "BOOL") return at::kBool;
  return Status::Invalid("safetensors dtype '" + dtype + "' has no tensor type in loom");
}

Result<std::string> SafetensorsDTypeName(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return std::string("F32");
    case at::kHalf: return std::string("F16");
    case at::kBFloat16: return std::string("BF16");
    case at::kDouble: return std::string("F64");
    case at::kLong: return std::string("I64");
    case at::kInt: return std::string("I32");
    case at::kShort: return std::string("I16");
    case at::kChar: return std::string("I8");
    case at::kByte: return std::string("U8");
    case at::kBool: return std::string("BOOL");
    default: return Status::Invalid(std::string("tensor type ") + c10::toString(type) + " cannot be stored in safetensors");
  }
}

Result<at::Tensor> LoadTensor(const TensorView& view, at::Device device) {
  auto src = ScalarTypeFromSafetensors(view.dtype);
  if (!src.ok()) return Status::Invalid("tensor '" + view.name + "': " + src.status().message());
  return LoadTensor(view, src.value(), device);
}

Result<at::Tensor> LoadTensor(const TensorView& view, at::ScalarType dtype, at::Device device) {
  auto src = ScalarTypeFromSafetensors(view.dtype);
  if (!src.ok()) return Status::Invalid("tensor '" + view.name + "': " + src.status().message());
  if (IsFloat(src.value()) != IsFloat(dtype)) {
    return Status::Invalid("tensor '" + view.name + "' is " + view.dtype + " and cannot load as " +
                           c10::toString(dtype));
  }
  c10::NoGradGuard no_grad;
  // Copy out of the mapping (whose bytes may be unaligned for the element type).
  at::Tensor host = at::empty(view.shape, at::TensorOptions().dtype(src.value()).device(at::kCPU));
  if (static_cast<size_t>(host.nbytes()) != view.nbytes) {
    return Status::Internal("tensor '" + view.name + "': view holds " + std::to_string(view.nbytes) +
                            " bytes, shape needs " + std::to_string(host.nbytes()));
  }
  if (view.nbytes > 0) std::memcpy(host.data_ptr(), view.data, view.nbytes);
  if (host.scalar_type() == dtype && device.is_cpu()) return host;
  return host.to(device, dtype);
}

Status AddTensor(SafetensorsWriter& writer, const std::string& name, const at::Tensor& tensor) {
  return AddTensor(writer, name, tensor, tensor.scalar_type());
}

Status AddTensor(SafetensorsWriter& writer, const std::string& name, const at::Tensor& tensor,
                 at::ScalarType dtype) {
  auto dname = SafetensorsDTypeName(dtype);
  if (!dname.ok()) return Status::Invalid("tensor '" + name + "': " + dname.status().message());
  if (!tensor.defined()) return Status::Invalid("tensor '" + name + "' is undefined");
  c10::NoGradGuard no_grad;
  at::Tensor host = tensor.detach().to(at::kCPU, dtype).contiguous();
  std::vector<int64_t> shape(host.sizes().begin(), host.sizes().end());
  return writer.Add(name, dname.value(), shape, host.data_ptr(), host.nbytes());
}

}  // namespace loom::engine
