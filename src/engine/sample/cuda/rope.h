// QkNormRopeWrite: q/k per-head norm, rotary embedding and the KV cache
// write of the fused qkv projection, one kernel.
//
// Conventions of every decode kernel (the model dtype T, where results
// round, streams and buffer ownership): engine/sample/cuda/device.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// For each row s: the fused projection qkv[s] = [q (H heads) | k (KVH) | v (KVH)],
// each head hd wide, plus its LoRA delta qkv_delta (from LoraExpand, or
// null), rounded to T. q and k get the per-head RMSNorm (when
// q_norm/k_norm are given, qwen3) then rotary embedding at positions[s]; q
// goes to q_out [rows, H, hd], k and v to row write_rows[s] of the pools
// [pool_rows, KVH, hd]. cos and sin are multiplied by rope_scale (YaRN's
// attention factor; 1 for plain RoPE) before they round to T.
void QkNormRopeWrite(bool bf16, const void* qkv, const void* qkv_delta, const void* q_norm, const void* k_norm,
                     const int64_t* positions, const float* inv_freq, float rope_scale, const int64_t* write_rows,
                     void* q_out, void* k_pool, void* v_pool, int64_t rows, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, float eps, cudaStream_t stream);

}  // namespace loom::engine::cuda
