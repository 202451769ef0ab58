// The row tiles shared by the LoRA kernels (lora_shrink.cu,
// lora_expand.cu), and their tensor-core (mma.sync) helpers. nvcc only.
//
// BGMV-style: every row reads its own slot's factors.
//
// A decode step is a few rows, so these kernels are bound by latency, not
// bytes or arithmetic: each thread issues all the loads it needs before it
// uses any (one memory round trip, not one per loop step), and the work is
// spread over enough blocks to reach every SM.
#pragma once
#include "engine/sample/cuda/device.cuh"
#include "engine/sample/cuda/lora.h"

namespace loom::engine::cuda::dev {

constexpr int kRowTile = 8;  // rows of one tile; rows of one slot share its factor loads

// The slots of the tile's rows [r0, r0 + n), -2 past n, loaded together.
__device__ __forceinline__ void TileSlots(const int32_t* slot, int64_t r0, int n, int (&s)[kRowTile]) {
#pragma unroll
  for (int q = 0; q < kRowTile; ++q) s[q] = q < n ? slot[r0 + q] : -2;
}

// Calls f(slot, members) for each run of the tile's rows sharing a slot >=
// -1, members being the bit set of those rows. The sampler sorts a step's
// rows by slot, so a tile is mostly one run.
template <typename F>
__device__ __forceinline__ void ForEachSlotRun(const int (&s)[kRowTile], F&& f) {
  unsigned done = 0;
#pragma unroll
  for (int k = 0; k < kRowTile; ++k) {
    if (((done >> k) & 1u) || s[k] == -2) continue;
    unsigned members = 0;
#pragma unroll
    for (int q = k; q < kRowTile; ++q)
      if (s[q] == s[k]) members |= 1u << q;
    done |= members;
    f(s[k], members);
  }
}

__device__ __forceinline__ bool Member(unsigned members, int q) { return (members >> q) & 1u; }

// The bit set of the tile's rows that have an adapter (slot >= 0): a lane
// whose row index is not known at compile time tests a bit, not s[q]
// (which would put s in local memory).
__device__ __forceinline__ unsigned AdapterRows(const int (&s)[kRowTile]) {
  unsigned bits = 0;
#pragma unroll
  for (int q = 0; q < kRowTile; ++q) bits |= (s[q] >= 0 ? 1u : 0u) << q;
  return bits;
}

// LoraArgs with the element type resolved.
template <typename T>
struct Lora {
  const T* B;
  const float* t;
  const int32_t* slot;
  int64_t rank, r_total, d_total;
  int64_t seg_end[kMaxSegments];
  // The segment (target) output column c belongs to.
  __device__ int Segment(int64_t c) const {
    int k = 0;
#pragma unroll
    for (int i = 0; i + 1 < kMaxSegments; ++i) k += seg_end[i] > 0 && c >= seg_end[i];
    return k;
  }
};

template <typename T>
Lora<T> Resolve(const LoraArgs& a) {
  Lora<T> l{static_cast<const T*>(a.B), a.t, a.slot, a.rank, a.r_total, a.d_total, {}};
  for (int i = 0; i < kMaxSegments; ++i) l.seg_end[i] = a.seg_end[i];
  return l;
}

// ---- tensor cores, for bf16 models ----
//
// mma.sync m16n8k16 (bf16 operands, fp32 accumulators): a tile of 8 decode
// rows is the instruction's N side, 16 rank outputs (shrink) or 16 output
// columns (expand) its M side. Lane l is in quad g = l / 4 at position
// tq = l % 4; the instruction wants from it, for each 16-wide k chunk, the
// logical k 2tq, 2tq+1, 2tq+8, 2tq+9 of M rows g and g + 8 and of N column
// g, and leaves it C[g][2tq], C[g][2tq+1], C[g+8][2tq], C[g+8][2tq+1]. A dot
// product does not depend on the order of its terms, so both operands take
// logical k (2tq, 2tq+1, 2tq+8, 2tq+9) from physical k 4tq..4tq+3 of the
// chunk: each lane loads contiguous elements. (Mma and PackBf16: device.cuh.)

// The row r and M index m of accumulator element e of lane (g, tq).
__device__ __forceinline__ int AccRow(int tq, int e) { return 2 * tq + (e & 1); }
__device__ __forceinline__ int AccM(int g, int e) { return g + (e >= 2 ? 8 : 0); }

}  // namespace loom::engine::cuda::dev
