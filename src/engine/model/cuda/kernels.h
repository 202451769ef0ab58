// Fused CUDA kernels of the sampler's graph-captured decode step
// (fast_decode.cpp). Raw pointers and a stream, no libtorch: this header is
// shared by kernels.cu (nvcc) and the C++ that launches them.
//
// T is the model dtype: __nv_bfloat16 or float, chosen at run time by
// `bf16`. Each kernel rounds where the eager libtorch ops it replaces round
// (to T after every op the eager path runs in T), so the fast decode stays
// within float rounding of Transformer::ForwardCached. Row-major throughout.
//
// Thread-safety: launches are asynchronous on `stream`; the caller owns the
// buffers until the stream has run them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// out[r] = w * T(norm(x[r] (+ add[r])))) for r < rows, n columns, with
// norm(v) = v * rsqrt(mean(v^2) + eps) in fp32. When add is given, the sum
// x + add (rounded to T) is also written to sum_out (which may alias x).
void RmsNorm(bool bf16, const void* x, const void* add, void* sum_out, const void* w, void* out, int64_t rows,
             int64_t n, float eps, cudaStream_t stream);

// For each row s: the fused projection qkv[s] = [q (H heads) | k (KVH) | v (KVH)],
// each head hd wide. q and k get the per-head RMSNorm (when q_norm/k_norm
// are given, qwen3) then rotary embedding at positions[s]; q goes to
// q_out [rows, H, hd], k and v to row write_rows[s] of the pools
// [pool_rows, KVH, hd].
void QkNormRopeWrite(bool bf16, const void* qkv, const void* q_norm, const void* k_norm, const int64_t* positions,
                     const float* inv_freq, const int64_t* write_rows, void* q_out, void* k_pool, void* v_pool,
                     int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps,
                     cudaStream_t stream);

// One query token per row over its cached context: row s attends to
// positions [0, ctx_len[s]) whose K/V rows are
// block_table[s][p / block_size] * block_size + p % block_size.
// q [rows, H, hd]; pools [pool_rows, KVH, hd]; out [rows, H * hd].
// Softmax in fp32 with scale 1/sqrt(hd); grouped-query heads share K/V.
void DecodeAttention(bool bf16, const void* q, const void* k_pool, const void* v_pool, const int32_t* block_table,
                     int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream);

// out [rows, inter] = T(silu(gate)) * up with gate_up [rows, 2 * inter].
void SiluMul(bool bf16, const void* gate_up, void* out, int64_t rows, int64_t inter, cudaStream_t stream);

// LoRA "shrink" for rows with their own adapter slot (BGMV):
// t[s, j] = scale[slot[s]] * dot(x[s, :d_in], A[slot[s], j, :]) in fp32,
// j < r_total; rows with slot[s] < 0 get 0. x [rows, d_in] (row stride
// ldx), A [slots, r_total, d_in], both T. The dot products are split over
// LoraSplits(bf16, d_in) parts of d_in (parallelism for a few rows): t is
// [splits, rows, r_total] partial sums, added up by LoraExpand.
int LoraSplits(bool bf16, int64_t d_in);
void LoraShrink(bool bf16, const void* x, int64_t ldx, const void* A, const int32_t* slot, const float* scale,
                float* t, int64_t rows, int64_t d_in, int64_t r_total, cudaStream_t stream);

// LoRA "expand", added in place: y[s, c] += dot(B[slot[s], c, :rank], t[s, seg(c) * rank + :rank])
// with t the sum of the shrink's `splits` partials
// for c < d_total, where output column c belongs to segment seg(c) (the
// targets stacked on the output axis, boundaries seg_end[0..segs)). The
// delta is rounded to T before the add when y is T (as the eager path casts
// it); y_f32 selects an fp32 y (the logits). Rows with slot < 0 are left.
void LoraExpand(bool bf16, const float* t, int splits, int64_t r_total, const void* B, int64_t rank, const int32_t* slot,
                void* y, bool y_f32, int64_t ldy, int64_t rows, int64_t d_total, const int64_t* seg_end, int segs,
                cudaStream_t stream);

}  // namespace loom::engine::cuda
