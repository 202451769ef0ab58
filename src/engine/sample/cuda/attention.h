// DecodeAttention: one query token per row over its paged KV cache.
//
// Conventions of every decode kernel (the model dtype T, where results
// round, streams and buffer ownership): engine/sample/cuda/device.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// One query token per row over its cached context: row s attends to
// positions [0, ctx_len[s]) whose K/V rows are
// block_table[s][p / block_size] * block_size + p % block_size.
// q [rows, H, hd]; pools [pool_rows, KVH, hd]; out [rows, H * hd].
// Softmax in fp32 with scale 1/sqrt(hd); grouped-query heads share K/V.
//
// Two forms. kDims: each warp walks its share of the context a few tokens
// at a time, its lanes splitting a head's dims (a dot product is a 32-lane
// reduction). kTokens: each half warp takes a token, its 16 lanes 8 dims
// each (one 16-byte load of K and one of V per token and lane, a dot
// product a 16-lane reduction), K and V of a warp's next tokens loaded
// together; for many rows over longer contexts, where the step reads K/V
// far more than weights. kTokens runs where TokenLanesApply; elsewhere kDims.
// The fast decode takes kTokens unless told otherwise (DecodeOptions).
enum class AttentionForm { kDims, kTokens };
void DecodeAttention(bool bf16, const void* q, const void* k_pool, const void* v_pool, const int32_t* block_table,
                     int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream,
                     AttentionForm form = AttentionForm::kDims);
// Whether form kTokens runs for these shapes: bf16, head_dim 128, and rows
// enough to fill the device with one block per row and head group.
bool TokenLanesApply(bool bf16, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim);

}  // namespace loom::engine::cuda
