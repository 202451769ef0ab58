#include "engine/lora/slot_rows.h"

#include <c10/core/GradMode.h>

#if LOOM_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "engine/lora/cuda/slot_rows_kernels.h"
#endif

namespace loom::engine {
namespace {

#if LOOM_CUDA_KERNELS
// Whether the kernels take these: fp32 CUDA columns of unit stride, int64
// slots on the same device, a bf16 or fp32 dense side, a grid's worth of slots.
bool KernelFits(const at::Tensor& cols, const at::Tensor& slots, at::ScalarType dense) {
  return cols.is_cuda() && cols.scalar_type() == at::kFloat && cols.dim() == 2 && cols.stride(1) == 1 &&
         slots.device() == cols.device() && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
         slots.size(0) <= 65535 && (dense == at::kBFloat16 || dense == at::kFloat);
}

cudaStream_t StreamOf(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

}  // namespace

at::Tensor GatherSlotRows(const at::Tensor& cols, const at::Tensor& slots, at::ScalarType ct) {
  c10::NoGradGuard no_grad;
  const int64_t U = slots.size(0), len = cols.size(1);
  at::Tensor out = at::empty({U, len}, cols.options().dtype(ct));
#if LOOM_CUDA_KERNELS
  if (KernelFits(cols, slots, ct)) {
    cuda::GatherSlotRows(ct == at::kBFloat16, cols.data_ptr<float>(), cols.stride(0), slots.data_ptr<int64_t>(), U,
                         len, out.data_ptr(), StreamOf(cols));
    return out;
  }
#endif
  // One slot at a time: the gather's fp32 copy is one row, not U.
  for (int64_t u = 0; u < U; ++u) out.select(0, u).copy_(cols.index_select(0, slots.narrow(0, u, 1)).squeeze(0));
  return out;
}

void AddSlotRows(const at::Tensor& into, const at::Tensor& slots, const at::Tensor& rows) {
  c10::NoGradGuard no_grad;
#if LOOM_CUDA_KERNELS
  if (KernelFits(into, slots, rows.scalar_type()) && rows.is_contiguous() && rows.device() == into.device()) {
    cuda::AddSlotRows(rows.scalar_type() == at::kBFloat16, rows.data_ptr(), slots.data_ptr<int64_t>(), slots.size(0),
                      into.size(1), into.data_ptr<float>(), into.stride(0), StreamOf(into));
    return;
  }
#endif
  at::Tensor target = into;
  target.index_add_(0, slots, rows.to(into.scalar_type()));
}

}  // namespace loom::engine
