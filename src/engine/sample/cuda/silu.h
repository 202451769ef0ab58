// SiluMul: the MLP's SiLU(gate) * up over the fused gate_up projection.
//
// Conventions of every decode kernel (the model dtype T, where results
// round, streams and buffer ownership): engine/sample/cuda/device.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// out [rows, inter] = T(silu(gate)) * up with gate_up [rows, 2 * inter]
// plus its LoRA delta (from LoraExpand, or null), rounded to T.
void SiluMul(bool bf16, const void* gate_up, const void* delta, void* out, int64_t rows, int64_t inter,
             cudaStream_t stream);

}  // namespace loom::engine::cuda
