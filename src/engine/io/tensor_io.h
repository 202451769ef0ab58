// tensor_io: the bridge between safetensors views/writers and at::Tensor.
// Loading copies out of the file mapping (the tensor never aliases it), so
// the file may be closed afterwards. Thread: any (pure functions).
#pragma once
#include <ATen/ATen.h>

#include <string>

#include "common/status.h"
#include "engine/io/safetensors.h"

namespace loom::engine {

// "F32" → kFloat, "F16" → kHalf, "BF16" → kBFloat16, "F64" → kDouble,
// "I64" → kLong, "I32" → kInt, "I16" → kShort, "I8" → kChar, "U8" → kByte,
// "BOOL" → kBool; anything else is Invalid naming the dtype.
Result<at::ScalarType> ScalarTypeFromSafetensors(const std::string& dtype);
// The inverse, for the types above.
Result<std::string> SafetensorsDTypeName(at::ScalarType type);

// A new tensor holding view's values, converted to dtype and placed on
// device. Float sources (F32/F16/BF16/F64) may convert to any float dtype;
// integer sources to any integer dtype; mixing the two is Invalid.
Result<at::Tensor> LoadTensor(const TensorView& view, at::ScalarType dtype, at::Device device);

// Same, keeping the file's dtype.
Result<at::Tensor> LoadTensor(const TensorView& view, at::Device device);

// Adds tensor's values (copied to CPU, contiguous; gradients and device
// ignored) under name. Its dtype must be one of the above; it is stored as is.
Status AddTensor(SafetensorsWriter& writer, const std::string& name, const at::Tensor& tensor);
// Same, converting to dtype first (e.g. store fp32 master weights as bf16).
Status AddTensor(SafetensorsWriter& writer, const std::string& name, const at::Tensor& tensor,
                 at::ScalarType dtype);

}  // namespace loom::engine
