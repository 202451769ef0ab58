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

// The LoRA delta of a projection's output (LoraExpand), from t, the
// LoraShrink of the projection's input: for row r with slot s = slot[r]
// >= 0 and output column c of segment seg (targets stacked on the output
// axis, as the fused base projection lays them out: segment k ends at
// seg_end[k]), delta = dot(B[s, c, :rank], t[r, seg * rank :+ rank]).
// As on the eager path, y + delta is y + T(delta), rounded to T. B null:
// no LoRA; rows with slot < 0 are left as they are.
constexpr int kMaxSegments = 4;
struct LoraArgs {
  const void* B = nullptr;       // [slots, d_total, rank], T
  const float* t = nullptr;      // [rows, r_total] fp32
  const int32_t* slot = nullptr;  // [rows]
  int64_t rank = 0, r_total = 0, d_total = 0;
  int64_t seg_end[kMaxSegments] = {};  // cumulative output widths; unused entries 0
};

// The widest row RmsNorm takes (the hidden size; the row is held in
// registers, 12 elements per thread of 1024).
constexpr int64_t kMaxNormWidth = 12288;

// out[r] = w * T(norm(x[r] + add'[r])) for r < rows, n <= kMaxNormWidth
// columns, with norm(v) = v * rsqrt(mean(v^2) + eps) in fp32, and add' =
// T(add + add_delta) (add_delta: add's LoRA delta from LoraExpand, or
// null). When add is given, the sum x + add' (rounded to T) is also
// written to sum_out (which may alias x); add may be null (no sum).
void RmsNorm(bool bf16, const void* x, const void* add, const void* add_delta, void* sum_out, const void* w,
             void* out, int64_t rows, int64_t n, float eps, cudaStream_t stream);

// For each row s: the fused projection qkv[s] = [q (H heads) | k (KVH) | v (KVH)],
// each head hd wide, plus its LoRA delta qkv_delta (from LoraExpand, or
// null), rounded to T. q and k get the per-head RMSNorm (when
// q_norm/k_norm are given, qwen3) then rotary embedding at positions[s]; q
// goes to q_out [rows, H, hd], k and v to row write_rows[s] of the pools
// [pool_rows, KVH, hd].
void QkNormRopeWrite(bool bf16, const void* qkv, const void* qkv_delta, const void* q_norm, const void* k_norm,
                     const int64_t* positions, const float* inv_freq, const int64_t* write_rows, void* q_out,
                     void* k_pool, void* v_pool, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     float eps, cudaStream_t stream);

// One query token per row over its cached context: row s attends to
// positions [0, ctx_len[s]) whose K/V rows are
// block_table[s][p / block_size] * block_size + p % block_size.
// q [rows, H, hd]; pools [pool_rows, KVH, hd]; out [rows, H * hd].
// Softmax in fp32 with scale 1/sqrt(hd); grouped-query heads share K/V.
void DecodeAttention(bool bf16, const void* q, const void* k_pool, const void* v_pool, const int32_t* block_table,
                     int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream);

// out [rows, inter] = T(silu(gate)) * up with gate_up [rows, 2 * inter]
// plus its LoRA delta (from LoraExpand, or null), rounded to T.
void SiluMul(bool bf16, const void* gate_up, const void* delta, void* out, int64_t rows, int64_t inter,
             cudaStream_t stream);

// y [rows, n] = x [rows, k] @ W[n, k]^T (+ bias[n]) for a few rows (the
// decode step's matrix-vector products), fp32 accumulation rounded to T;
// y_f32 stores those T-rounded values as fp32 (the logits). Returns false,
// launching nothing, when rows > kGemvMaxRows or the operands are not
// 16-byte aligned rows (the caller then uses cuBLAS).
constexpr int64_t kGemvMaxRows = 4;
bool Gemv(bool bf16, const void* x, int64_t ldx, const void* W, const void* bias, void* y, bool y_f32, int64_t rows,
          int64_t n, int64_t k, cudaStream_t stream);

// Scratch that lets LoraShrink split a long d_in over several blocks per
// output tile: part_floats floats for their partial sums, and tickets_size
// ints, all 0 when first handed over (each launch leaves them 0 again).
struct ShrinkScratch {
  float* part = nullptr;
  int64_t part_floats = 0;
  int* tickets = nullptr;
  int64_t tickets_size = 0;
};

// LoRA "shrink" for rows with their own adapter slot (BGMV):
// t[s, j] = scale[slot[s]] * dot(x[s, :d_in], A[slot[s], j, :]) in fp32,
// j < r_total; rows with slot[s] < 0 get 0. x [rows, d_in] (row stride
// ldx), A [slots, r_total, d_in], both T; t [rows, r_total]. bf16 with
// d_in a multiple of 32 runs on tensor cores (bf16 products, fp32 sums);
// there, given `split`, d_in is split over one block per output tile for
// every 64 of its 32-wide steps (to the nearest; at most as many as the
// scratch holds partial sums for). Returns the number of blocks per tile
// (1: no split).
int LoraShrink(bool bf16, const void* x, int64_t ldx, const void* A, const int32_t* slot, const float* scale,
               float* t, int64_t rows, int64_t d_in, int64_t r_total, cudaStream_t stream,
               const ShrinkScratch* split = nullptr);

// LoRA "expand": out[s, c] = y[s, c] + delta for every column of every
// segment (y: the projection's output, T; both with row stride ld). In
// place (out == y): rows with an adapter are updated; into another buffer:
// every row is written (base rows get y). y null: out gets T(delta), 0 for
// rows without an adapter (for a consumer that adds it to y itself, so
// the expand need not wait for y). out_f32: out is fp32 and gets y + delta
// unrounded (the logits), else T, rounded as the eager path does
// (y + T(delta), rounded). Rows of one slot in a tile of 8 share each B
// row load. bf16 with rank 16, 32 or 64 and segments of whole 16 columns
// runs on tensor cores, with t split into two bf16 terms (hi + lo: ~16
// significant bits, fp32 sums).
void LoraExpand(bool bf16, const LoraArgs& lora, const void* y, void* out, bool out_f32, int64_t ld, int64_t rows,
                cudaStream_t stream);

}  // namespace loom::engine::cuda
