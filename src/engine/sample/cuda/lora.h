// LoRA for rows that each carry their own adapter slot (BGMV): the shrink
// x A^T into t, and the expand t B^T added to a projection's output.
// Both run on tensor cores for bf16 models (lora_shrink.cu, lora_expand.cu).
//
// Conventions of every decode kernel (the model dtype T, where results
// round, streams and buffer ownership): engine/sample/cuda/device.cuh.
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
