// The fused decode kernels declared in kernels.h. Decode steps are small
// (a few rows): the base projections' consumers are bound by memory and
// launch count; the LoRA kernels were bound by issuing CUDA-core
// instructions (ncu), hence tensor cores for them in bf16.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "engine/sample/cuda/kernels.h"

namespace loom::engine::cuda {
namespace {

using bf16_t = __nv_bfloat16;

__device__ __forceinline__ float ToF(float v) { return v; }
__device__ __forceinline__ float ToF(bf16_t v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T FromF(float v);
template <>
__device__ __forceinline__ float FromF<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16_t FromF<bf16_t>(float v) { return __float2bfloat16_rn(v); }
// v rounded through T (the eager op's output dtype), back in fp32.
template <typename T>
__device__ __forceinline__ float Round(float v) { return ToF(FromF<T>(v)); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets it.
__device__ float BlockSum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float r = lane < warps ? partial[lane] : 0.0f;
    r = WarpSum(r);
    if (lane == 0) partial[0] = r;
  }
  __syncthreads();
  return partial[0];
}

// Loads V consecutive T into fp32: 16-byte loads when V * sizeof(T) is a
// multiple of 16 (the caller guarantees alignment then), else one by one.
template <typename T, int V>
__device__ __forceinline__ void LoadV(const T* p, float* out) {
  constexpr int kPer = 16 / sizeof(T);
  if constexpr (V % kPer == 0) {
#pragma unroll
    for (int c = 0; c < V; c += kPer) {
      const uint4 u = *reinterpret_cast<const uint4*>(p + c);
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int k = 0; k < kPer; ++k) out[c + k] = ToF(e[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = ToF(p[k]);
  }
}

// V consecutive T kept as loaded (one 16-byte load when V * sizeof(T) is
// 16), converted to fp32 one element at a time where used.
template <typename T, int V>
struct Raw {
  static constexpr bool kVector = V * sizeof(T) == 16;
  union {
    uint4 u;
    T e[V];
  };
  __device__ __forceinline__ void Load(const T* p) {
    if constexpr (kVector) {
      u = *reinterpret_cast<const uint4*>(p);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) e[k] = p[k];
    }
  }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int k = 0; k < V; ++k) e[k] = FromF<T>(0.0f);
  }
  __device__ __forceinline__ float At(int k) const { return ToF(e[k]); }
};

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

unsigned Blocks(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

// ---- LoRA, BGMV-style: every row reads its own slot's factors ----
//
// A decode step is a few rows, so these kernels are bound by latency, not
// bytes or arithmetic: each thread issues all the loads it needs before it
// uses any (one memory round trip, not one per loop step), and the work is
// spread over enough blocks to reach every SM.

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

// Calls f(std::integral_constant<int, R>) with R = a's rank when it is one
// of the common ranks and B and t rows allow 16-byte loads (kernels then
// hold a B row in registers and unroll the rank loop), else R = 0 (any
// rank, element by element). No LoRA: R = 0.
template <typename T, typename F>
void WithRank(const LoraArgs& a, F&& f) {
  constexpr int V = 16 / sizeof(T);
  if (a.B && a.rank % V == 0 && a.r_total % 4 == 0 && Aligned16(a.B) && Aligned16(a.t)) {
    switch (a.rank) {
      case 8: return f(std::integral_constant<int, 8>{});
      case 16: return f(std::integral_constant<int, 16>{});
      case 32: return f(std::integral_constant<int, 32>{});
      case 64: return f(std::integral_constant<int, 64>{});
      default: break;
    }
  }
  f(std::integral_constant<int, 0>{});
}

// delta[q] = the unrounded LoRA delta of output column c (segment seg) for
// each tile row q < n with an adapter (others: delta 0). One thread, one
// column: for each slot run the column's B row is loaded once (R > 0: into
// registers, 16 bytes at a time) and dotted with every member row's t.
template <typename T, int R>
__device__ __forceinline__ void ColumnDelta(const Lora<T>& a, const int (&s)[kRowTile], int64_t r0, int64_t c, int seg,
                                            float (&delta)[kRowTile]) {
#pragma unroll
  for (int q = 0; q < kRowTile; ++q) delta[q] = 0.0f;
  ForEachSlotRun(s, [&](int sl, unsigned members) {
    if (sl < 0) return;
    const T* b = a.B + (static_cast<int64_t>(sl) * a.d_total + c) * a.rank;
    if constexpr (R > 0) {
      constexpr int V = 16 / sizeof(T);
      float bv[R];
#pragma unroll
      for (int i = 0; i < R; i += V) LoadV<T, V>(b + i, bv + i);
#pragma unroll
      for (int q = 0; q < kRowTile; ++q) {
        if (!Member(members, q)) continue;
        const float4* t = reinterpret_cast<const float4*>(a.t + (r0 + q) * a.r_total + seg * R);
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < R / 4; ++i) {
          const float4 f = t[i];
          acc += bv[4 * i] * f.x + bv[4 * i + 1] * f.y + bv[4 * i + 2] * f.z + bv[4 * i + 3] * f.w;
        }
        delta[q] = acc;
      }
    } else {
      for (int q = 0; q < kRowTile; ++q) {
        if (!Member(members, q)) continue;
        const float* t = a.t + (r0 + q) * a.r_total + seg * a.rank;
        float acc = 0.0f;
        for (int64_t r = 0; r < a.rank; ++r) acc += ToF(b[r]) * t[r];
        delta[q] = acc;
      }
    }
  });
}

// y + delta as the eager path computes it in T: y + T(delta), rounded.
template <typename T>
__device__ __forceinline__ float AddDelta(float y, float delta) { return Round<T>(y + Round<T>(delta)); }

// v[N] per lane in (N a power of two <= 32); out: lane l holds the sum over
// the warp of v[l >> (5 - log2 N)], in N - 1 + 5 - log2 N shuffles (a
// butterfly that halves the values kept at each step; N warp sums would
// take 5 N). O: the lane distance of this step.
template <int N, int O = 16>
__device__ __forceinline__ float ReduceScatter(float* v) {
  static_assert(N >= 1 && (N <= 2 * O || N == 1) && (N & (N - 1)) == 0, "N: a power of two <= 32");
  if constexpr (O == 0) {
    return v[0];
  } else if constexpr (N > 1) {
    const bool upper = (threadIdx.x & 31) & O;
    constexpr int h = N / 2;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const float send = upper ? v[i] : v[i + h];
      const float keep = upper ? v[i + h] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    return ReduceScatter<h, O / 2>(v);
  } else {
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
    return ReduceScatter<1, O / 2>(v);
  }
}

// The shrink. Grid (ceil(rows / kRowTile), ceil(r_total / (kShrinkJ *
// kShrinkWarps / split))), kShrinkWarps warps: warp w computes kShrinkJ
// outputs j for the tile's rows over part w % split of d_in, issuing all
// of a step's A loads (kShrinkUnroll 16-byte vectors per output) before
// reading x. The split parts meet in shared memory, summed in a fixed
// order (results do not depend on scheduling). split in {1, 2, 4, 8} keeps
// each warp's part short, so a step is one or two memory round trips.
constexpr int kShrinkWarps = 8;
constexpr int kShrinkJ = 2;
constexpr int kShrinkUnroll = 4;

template <typename T, int V>
__global__ void __launch_bounds__(32 * kShrinkWarps, 2)
    LoraShrinkKernel(const T* x, int64_t ldx, const T* A, const int32_t* slot, const float* scale, float* t,
                     int64_t rows, int64_t d_in, int64_t r_total, int split) {
  __shared__ float part[kShrinkWarps][kRowTile * kShrinkJ];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per_block = kShrinkJ * kShrinkWarps / split;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowTile;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * per_block + (warp / split) * kShrinkJ;
  const int p = warp % split;
  const int n = static_cast<int>(min(static_cast<int64_t>(kRowTile), rows - r0));
  // This warp's part of d_in, in V-element vectors.
  const int64_t nv = d_in / V, chunk = (nv + split - 1) / split;
  const int64_t v_begin = p * chunk, v_end = min(nv, v_begin + chunk);
  int s[kRowTile];
  TileSlots(slot, r0, n, s);
  ForEachSlotRun(s, [&](int sl, unsigned members) {
    float acc[kRowTile * kShrinkJ];
#pragma unroll
    for (int i = 0; i < kRowTile * kShrinkJ; ++i) acc[i] = 0.0f;
    if (sl >= 0) {
      const T* a = A + (static_cast<int64_t>(sl) * r_total + j0) * d_in;
      for (int64_t v0 = v_begin + lane; v0 < v_end; v0 += 32 * kShrinkUnroll) {
        // A as loaded (T, not fp32: half the registers for bf16).
        Raw<T, V> av[kShrinkJ][kShrinkUnroll];
#pragma unroll
        for (int j = 0; j < kShrinkJ; ++j)
#pragma unroll
          for (int u = 0; u < kShrinkUnroll; ++u) {
            const int64_t v = v0 + u * 32;
            if (v < v_end && j0 + j < r_total) {
              av[j][u].Load(a + j * d_in + v * V);
            } else {
              av[j][u].Zero();
            }
          }
#pragma unroll
        for (int q = 0; q < kRowTile; ++q) {
          if (!Member(members, q)) continue;
#pragma unroll
          for (int u = 0; u < kShrinkUnroll; ++u) {
            const int64_t v = v0 + u * 32;
            if (v >= v_end) continue;
            float xv[V];
            LoadV<T, V>(x + (r0 + q) * ldx + v * V, xv);
#pragma unroll
            for (int j = 0; j < kShrinkJ; ++j)
#pragma unroll
              for (int e = 0; e < V; ++e) acc[q * kShrinkJ + j] += av[j][u].At(e) * xv[e];
          }
        }
      }
    }
    // Lane l ends with the warp's sum of acc[l >> 1]: (row, output) = (l / 4, l / 2 % 2).
    constexpr int kOut = kRowTile * kShrinkJ;
    static_assert(kOut == 16, "the lane-to-output mapping below assumes 16 outputs per warp");
    const float sum = ReduceScatter<kOut>(acc);
    if ((lane & 1) == 0) part[warp][lane >> 1] = sum;
    __syncthreads();
    const int per_tile = kRowTile * per_block;
    if (threadIdx.x < per_tile) {
      const int q = threadIdx.x % kRowTile, jj = threadIdx.x / kRowTile;  // output j0' + jj of the block
      const int w0 = (jj / kShrinkJ) * split;  // the first warp of that output's parts
      const int64_t j = static_cast<int64_t>(blockIdx.y) * per_block + jj;
      if (Member(members, q) && j < r_total) {
        float total = 0.0f;
        for (int w = w0; w < w0 + split; ++w) total += part[w][q * kShrinkJ + jj % kShrinkJ];
        t[(r0 + q) * r_total + j] = sl >= 0 ? total * scale[sl] : 0.0f;
      }
    }
    __syncthreads();
  });
}

constexpr int kExpandThreads = 128;  // output columns per block of LoraExpand

// y + delta into out at `at`: fp32 unrounded (the logits), or rounded to T
// as the eager path does.
template <typename T>
__device__ __forceinline__ void StoreSum(void* out, bool out_f32, int64_t at, float y, float delta) {
  if (out_f32) {
    static_cast<float*>(out)[at] = y + delta;
  } else {
    static_cast<T*>(out)[at] = FromF<T>(AddDelta<T>(y, delta));
  }
}

// Grid (ceil(d_total / kExpandThreads), ceil(rows / kRowTile)), one thread
// per column and tile: out[r, c] = y[r, c] + delta (y null: 0 + delta),
// for rows with an adapter when out is y, for every row otherwise.
template <typename T, int R>
__global__ void LoraExpandKernel(Lora<T> a, const T* y, void* out, bool out_f32, int64_t ld, int64_t rows) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kExpandThreads + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowTile;
  const int n = static_cast<int>(min(static_cast<int64_t>(kRowTile), rows - r0));
  if (c >= a.d_total) return;
  const bool every_row = out != static_cast<const void*>(y);
  int s[kRowTile];
  TileSlots(a.slot, r0, n, s);
  const unsigned written = every_row ? (1u << n) - 1 : AdapterRows(s);
  float old[kRowTile];  // y loaded with the factors, before any store
#pragma unroll
  for (int q = 0; q < kRowTile; ++q) old[q] = y && Member(written, q) ? ToF(y[(r0 + q) * ld + c]) : 0.0f;
  float delta[kRowTile];
  ColumnDelta<T, R>(a, s, r0, c, a.Segment(c), delta);
#pragma unroll
  for (int q = 0; q < kRowTile; ++q)
    if (Member(written, q)) StoreSum<T>(out, out_f32, (r0 + q) * ld + c, old[q], delta[q]);
}

// ---- the same on tensor cores, for bf16 models ----
//
// mma.sync m16n8k16 (bf16 operands, fp32 accumulators): a tile of 8 decode
// rows is the instruction's N side, 16 rank outputs (shrink) or 16 output
// columns (expand) its M side. Lane l is in quad g = l / 4 at position
// tq = l % 4; the instruction wants from it, for each 16-wide k chunk, the
// logical k 2tq, 2tq+1, 2tq+8, 2tq+9 of M rows g and g + 8 and of N column
// g, and leaves it C[g][2tq], C[g][2tq+1], C[g+8][2tq], C[g+8][2tq+1]. A dot
// product does not depend on the order of its terms, so both operands take
// logical k (2tq, 2tq+1, 2tq+8, 2tq+9) from physical k 4tq..4tq+3 of the
// chunk: each lane loads contiguous elements.

__device__ __forceinline__ void Mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair (lo in the low half, as loaded from memory).
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The row r and M index m of accumulator element e of lane (g, tq).
__device__ __forceinline__ int AccRow(int tq, int e) { return 2 * tq + (e & 1); }
__device__ __forceinline__ int AccM(int g, int e) { return g + (e >= 2 ? 8 : 0); }

constexpr int kMmaShrinkWarps = 16;
constexpr int kMmaShrinkUnroll = 4;  // 32-wide k steps whose loads a lane issues together

// Grid (ceil(rows / kRowTile), ceil(r_total / 16), parts): the
// parts * kMmaShrinkWarps warps of a (row tile, 16 outputs) take turns over
// d_in in 32-wide steps (each step: one 16-byte load of A rows g and g + 8
// and of x row g per lane, two mma). A block's warps' sums meet in shared
// memory, added in a fixed order. With parts > 1, block z writes its sums
// to part[z]; the tile's last block to finish (tickets, which it resets
// for the next launch) adds part[0], part[1], ... in that order into t.
// Either way the results do not depend on scheduling.
__global__ void __launch_bounds__(32 * kMmaShrinkWarps) LoraShrinkMmaKernel(const bf16_t* x, int64_t ldx,
                                                                          const bf16_t* A, const int32_t* slot,
                                                                          const float* scale, float* t, float* part,
                                                                          int* tickets, int64_t rows, int64_t d_in,
                                                                          int64_t r_total) {
  __shared__ float red[kMmaShrinkWarps][32][4];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowTile, j0 = static_cast<int64_t>(blockIdx.y) * 16;
  const int n = static_cast<int>(min(static_cast<int64_t>(kRowTile), rows - r0));
  const int64_t steps = d_in / 32, walkers = static_cast<int64_t>(gridDim.z) * kMmaShrinkWarps;
  const bool split = gridDim.z > 1;
  float* const out = split ? part + blockIdx.z * rows * r_total : t;
  int s[kRowTile];
  TileSlots(slot, r0, n, s);
  ForEachSlotRun(s, [&](int sl, unsigned members) {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (sl >= 0) {
      const bool lo_ok = j0 + g < r_total, hi_ok = j0 + g + 8 < r_total, x_ok = Member(members, g);
      const bf16_t* a_lo = A + (static_cast<int64_t>(sl) * r_total + j0 + g) * d_in + tq * 8;
      const bf16_t* a_hi = a_lo + 8 * d_in;
      const bf16_t* xr = x + (r0 + g) * ldx + tq * 8;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      for (int64_t s0 = blockIdx.z * kMmaShrinkWarps + warp; s0 < steps; s0 += walkers * kMmaShrinkUnroll) {
        uint4 va[kMmaShrinkUnroll], vb[kMmaShrinkUnroll], vx[kMmaShrinkUnroll];
#pragma unroll
        for (int u = 0; u < kMmaShrinkUnroll; ++u) {
          const int64_t st = s0 + u * walkers, k = st * 32;
          const bool ok = st < steps;
          va[u] = ok && lo_ok ? *reinterpret_cast<const uint4*>(a_lo + k) : zero;
          vb[u] = ok && hi_ok ? *reinterpret_cast<const uint4*>(a_hi + k) : zero;
          vx[u] = ok && x_ok ? *reinterpret_cast<const uint4*>(xr + k) : zero;
        }
#pragma unroll
        for (int u = 0; u < kMmaShrinkUnroll; ++u) {
          Mma(c, va[u].x, vb[u].x, va[u].y, vb[u].y, vx[u].x, vx[u].y);  // physical k 8tq .. 8tq+3
          Mma(c, va[u].z, vb[u].z, va[u].w, vb[u].w, vx[u].z, vx[u].w);  // and 8tq+4 .. 8tq+7
        }
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) red[warp][lane][e] = c[e];
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float sum = 0.0f;
        for (int w = 0; w < kMmaShrinkWarps; ++w) sum += red[w][lane][e];
        const int q = AccRow(tq, e);
        const int64_t j = j0 + AccM(g, e);
        if (Member(members, q) && j < r_total)
          out[(r0 + q) * r_total + j] = sl < 0 ? 0.0f : split ? sum : sum * scale[sl];
      }
    }
    __syncthreads();
  });
  if (!split) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* ticket = tickets + blockIdx.y * gridDim.x + blockIdx.x;
    last = atomicAdd(ticket, 1) == static_cast<int>(gridDim.z) - 1;
    if (last) *ticket = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < n * 16; i += blockDim.x) {
    const int q = i / 16;
    const int64_t j = j0 + i % 16, at = (r0 + q) * r_total + j;
    if (j >= r_total) continue;
    float sum = 0.0f;
    for (unsigned z = 0; z < gridDim.z; ++z) sum += __ldcg(part + z * rows * r_total + at);
    const int sl = slot[r0 + q];
    t[at] = sl >= 0 ? sum * scale[sl] : 0.0f;
  }
}

constexpr int kMmaExpandWarps = 4;
constexpr int kMmaExpandTiles = 2;  // 16-column M tiles per warp
constexpr int kMmaExpandCols = kMmaExpandWarps * kMmaExpandTiles * 16;  // columns per block

// c += the delta of output columns [cm, cm + 16) for the tile's rows (each
// slot run: B rows g and g + 8, R / 16 8-byte loads each, against t of the
// run's rows; t split into hi + lo bf16 operands, two mma per k chunk, so
// the delta keeps ~16 bits of t). Columns past d_total get 0. Segments
// (and so t's offset) change only at multiples of 16 columns.
template <int R>
__device__ __forceinline__ void MmaColumnsDelta(const Lora<bf16_t>& a, const int (&s)[kRowTile], int64_t r0,
                                                int64_t cm, float (&c)[4]) {
  static_assert(R % 16 == 0, "rank: a multiple of 16");
  constexpr int K = R / 16;
  if (cm >= a.d_total) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int seg = a.Segment(cm);
  ForEachSlotRun(s, [&](int sl, unsigned members) {
    if (sl < 0) return;
    const bool t_ok = Member(members, g);
    const bf16_t* b_lo = a.B + (static_cast<int64_t>(sl) * a.d_total + cm + g) * R + tq * 4;
    const bf16_t* b_hi = b_lo + 8 * R;
    const bool lo_ok = cm + g < a.d_total, hi_ok = cm + g + 8 < a.d_total;
    const float* tr = a.t + (r0 + g) * a.r_total + seg * R + tq * 4;
    uint2 bl[K], bh[K];
    float4 tv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      bl[k] = lo_ok ? *reinterpret_cast<const uint2*>(b_lo + 16 * k) : make_uint2(0, 0);
      bh[k] = hi_ok ? *reinterpret_cast<const uint2*>(b_hi + 16 * k) : make_uint2(0, 0);
      tv[k] = t_ok ? *reinterpret_cast<const float4*>(tr + 16 * k) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint32_t h0 = PackBf16(tv[k].x, tv[k].y), h1 = PackBf16(tv[k].z, tv[k].w);
      const __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(&h0);
      const __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(&h1);
      const uint32_t l0 = PackBf16(tv[k].x - __low2float(p0), tv[k].y - __high2float(p0));
      const uint32_t l1 = PackBf16(tv[k].z - __low2float(p1), tv[k].w - __high2float(p1));
      Mma(c, bl[k].x, bh[k].x, bl[k].y, bh[k].y, h0, h1);
      Mma(c, bl[k].x, bh[k].x, bl[k].y, bh[k].y, l0, l1);
    }
  });
}

// Grid (ceil(d_total / kMmaExpandCols), ceil(rows / kRowTile)): each warp
// adds the delta of kMmaExpandTiles 16-column tiles (MmaColumnsDelta) to
// the tile's rows, as LoraExpandKernel does one column per thread.
template <int R>
__global__ void LoraExpandMmaKernel(Lora<bf16_t> a, const bf16_t* y, void* out, bool out_f32, int64_t ld,
                                    int64_t rows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowTile;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kMmaExpandWarps + warp) * kMmaExpandTiles * 16;
  if (c0 >= a.d_total) return;
  const int n = static_cast<int>(min(static_cast<int64_t>(kRowTile), rows - r0));
  const bool every_row = out != static_cast<const void*>(y);
  int s[kRowTile];
  TileSlots(a.slot, r0, n, s);
  const unsigned written = every_row ? (1u << n) - 1 : AdapterRows(s);
  // This lane's cells: columns c0 + 16 m + AccM(g, e), rows r0 + AccRow(tq, e).
  auto cell = [&](int m, int e, int64_t* at) {
    const int q = AccRow(tq, e);
    const int64_t col = c0 + 16 * m + AccM(g, e);
    *at = (r0 + q) * ld + col;
    return Member(written, q) && col < a.d_total;
  };
  float old[kMmaExpandTiles][4];
#pragma unroll
  for (int m = 0; m < kMmaExpandTiles; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int64_t at;
      old[m][e] = 0.0f;
      if (y && cell(m, e, &at)) old[m][e] = ToF(y[at]);
    }
  float c[kMmaExpandTiles][4] = {};
#pragma unroll
  for (int m = 0; m < kMmaExpandTiles; ++m) MmaColumnsDelta<R>(a, s, r0, c0 + 16 * m, c[m]);
#pragma unroll
  for (int m = 0; m < kMmaExpandTiles; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int64_t at;
      if (cell(m, e, &at)) StoreSum<bf16_t>(out, out_f32, at, old[m][e], c[m][e]);
    }
}

// ---- the consumers of the projections ----

constexpr int kNormPer = kMaxNormWidth / 1024;  // elements per thread, held in registers

// One block per row: out = w * T(norm(x + add')), add' = T(add + add_delta),
// the sum written to sum_out.
template <typename T>
__global__ void RmsNormKernel(const T* x, const T* add, const T* add_delta, T* sum_out, const T* w, T* out, int64_t n,
                              float eps) {
  const int64_t row = blockIdx.x, base = row * n;
  float v[kNormPer];
  float ss = 0.0f;
#pragma unroll
  for (int e = 0; e < kNormPer; ++e) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
    v[e] = 0.0f;
    if (i >= n) continue;
    float xv = ToF(x[base + i]);
    if (add) {
      float a = ToF(add[base + i]);
      if (add_delta) a = AddDelta<T>(a, ToF(add_delta[base + i]));
      xv = Round<T>(xv + a);
      sum_out[base + i] = FromF<T>(xv);
    }
    v[e] = xv;
    ss += xv * xv;
  }
  const float inv = rsqrtf(BlockSum(ss) / static_cast<float>(n) + eps);
#pragma unroll
  for (int e = 0; e < kNormPer; ++e) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
    if (i < n) out[base + i] = FromF<T>(ToF(w[i]) * Round<T>(v[e] * inv));
  }
}

// Grid (rows, H + 2 KVH heads), hd threads; qkv's delta is added first.
template <typename T>
__global__ void QkNormRopeKernel(const T* qkv, const T* delta, const T* q_norm, const T* k_norm, const int64_t* positions,
                                 const float* inv_freq, const int64_t* write_rows, T* q_out, T* k_pool, T* v_pool,
                                 int heads, int kv_heads, int hd, float eps) {
  extern __shared__ float head[];  // hd
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y, i = threadIdx.x;
  const int64_t width = static_cast<int64_t>(heads + 2 * kv_heads) * hd;
  const bool is_q = h < heads, is_k = !is_q && h < heads + kv_heads;
  const int64_t at = s * width + static_cast<int64_t>(h) * hd + i;
  float v = ToF(qkv[at]);
  if (delta) v = AddDelta<T>(v, ToF(delta[at]));
  if (!is_q && !is_k) {  // a value head: straight into the cache
    v_pool[(write_rows[s] * kv_heads + (h - heads - kv_heads)) * hd + i] = FromF<T>(v);
    return;
  }
  const T* norm_w = is_q ? q_norm : k_norm;
  if (norm_w) {
    const float inv = rsqrtf(BlockSum(v * v) / static_cast<float>(hd) + eps);
    v = Round<T>(ToF(norm_w[i]) * Round<T>(v * inv));
  }
  head[i] = v;
  __syncthreads();
  const int half = hd / 2;
  const float rot = i < half ? -head[i + half] : head[i - half];
  const float angle = static_cast<float>(positions[s]) * inv_freq[i % half];
  const float cs = Round<T>(cosf(angle)), sn = Round<T>(sinf(angle));
  const T out = FromF<T>(Round<T>(v * cs) + Round<T>(rot * sn));
  if (is_q) {
    q_out[(s * heads + h) * hd + i] = out;
  } else {
    k_pool[(write_rows[s] * kv_heads + (h - heads)) * hd + i] = out;
  }
}

constexpr int kSiluThreads = 256;

// Grid (ceil(inter / kSiluThreads), rows): out = T(silu(gate')) * up',
// gate' and up' with their deltas added (rounded to T) when given.
template <typename T>
__global__ void SiluMulKernel(const T* gate_up, const T* delta, T* out, int64_t inter) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSiluThreads + threadIdx.x, r = blockIdx.y;
  if (c >= inter) return;
  const int64_t gi = r * 2 * inter + c, ui = gi + inter;
  float g = ToF(gate_up[gi]), u = ToF(gate_up[ui]);
  if (delta) {
    g = AddDelta<T>(g, ToF(delta[gi]));
    u = AddDelta<T>(u, ToF(delta[ui]));
  }
  const float silu = Round<T>(g / (1.0f + expf(-g)));
  out[r * inter + c] = FromF<T>(silu * u);
}

constexpr int kAttnWarps = 8;
constexpr int kAttnBatch = 4;

// Grid (rows, heads), kAttnWarps warps. Each warp walks every kAttnWarps-th
// context token with an online softmax; the warps are merged at the end.
// Lane l holds elements [l * E, l * E + E) of the head (hd = 32 * E).
template <typename T, int E>
__global__ void DecodeAttentionKernel(const T* q, const T* k_pool, const T* v_pool, const int32_t* table,
                                      int64_t table_stride, const int32_t* ctx_len, int block_size, T* out,
                                      int heads, int kv_heads, float scale) {
  constexpr int hd = 32 * E;
  __shared__ float part_m[kAttnWarps], part_l[kAttnWarps], part_acc[kAttnWarps][hd];
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kvh = h / (heads / kv_heads);
  float qv[E], acc[E];
  for (int e = 0; e < E; ++e) {
    qv[e] = ToF(q[(s * heads + h) * hd + lane * E + e]);
    acc[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int n = ctx_len[s];
  // kAttnBatch tokens per warp step, their loads issued together (a decode
  // step is latency-bound: few rows, short contexts).
  for (int t0 = warp * kAttnBatch; t0 < n; t0 += kAttnWarps * kAttnBatch) {
    int64_t off[kAttnBatch];
    float d[kAttnBatch];
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      const int t = min(t0 + b, n - 1);  // past the end: a valid row, masked below
      const int64_t row = static_cast<int64_t>(table[s * table_stride + t / block_size]) * block_size + t % block_size;
      off[b] = (row * kv_heads + kvh) * hd + lane * E;
      d[b] = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) d[b] += qv[e] * ToF(k_pool[off[b] + e]);
    }
    float m_new = m;
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      d[b] = t0 + b < n ? WarpSum(d[b]) * scale : -INFINITY;
      m_new = fmaxf(m_new, d[b]);
    }
    const float corr = expf(m - m_new);
    l *= corr;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= corr;
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      const float p = expf(d[b] - m_new);  // 0 for masked tokens
      l += p;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] += p * ToF(v_pool[off[b] + e]);
    }
    m = m_new;
  }
  if (lane == 0) {
    part_m[warp] = m;
    part_l[warp] = l;
  }
  for (int e = 0; e < E; ++e) part_acc[warp][lane * E + e] = acc[e];
  __syncthreads();
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    float M = -INFINITY;
    for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, part_m[w]);
    float L = 0.0f, o = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) {
      if (part_m[w] == -INFINITY) continue;  // a warp that saw no token
      const float f = expf(part_m[w] - M);
      L += part_l[w] * f;
      o += part_acc[w][i] * f;
    }
    out[(s * heads + h) * hd + i] = FromF<T>(o / L);
  }
}

// LoadV for data read once (the weights of a matrix-vector product): a
// streaming load that does not displace x from L1.
template <typename T, int V>
__device__ __forceinline__ void LoadStreamV(const T* p, float* out) {
  static_assert(V * sizeof(T) == 16, "16-byte loads only");
  const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int k = 0; k < V; ++k) out[k] = ToF(e[k]);
}

constexpr int kGemvWarps = 8;
constexpr int kGemvUnroll = 4;  // 16-byte weight loads in flight per lane

// One warp per output column c (a row of W), all M rows of x against it.
// Lane l reads elements [l * V, l * V + V) of every 32 * V.
template <typename T, int M>
__global__ void GemvKernel(const T* x, int64_t ldx, const T* W, const T* bias, void* y, bool y_f32, int64_t n,
                           int64_t k) {
  constexpr int V = 16 / sizeof(T);
  constexpr int64_t kStep = 32 * V;
  const int lane = threadIdx.x & 31;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (c >= n) return;
  const T* w = W + c * k;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;
  auto fma_at = [&](const float* wv, int64_t i) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xv[V];
      LoadV<T, V>(x + m * ldx + i, xv);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[m] += wv[v] * xv[v];
    }
  };
  int64_t i = static_cast<int64_t>(lane) * V;
  for (; i + (kGemvUnroll - 1) * kStep < k; i += kGemvUnroll * kStep) {
    float wv[kGemvUnroll][V];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) LoadStreamV<T, V>(w + i + u * kStep, wv[u]);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) fma_at(wv[u], i + u * kStep);
  }
  for (; i < k; i += kStep) {
    float wv[V];
    LoadStreamV<T, V>(w + i, wv);
    fma_at(wv, i);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float sum = WarpSum(acc[m]);
    if (lane != 0) continue;
    const T out = FromF<T>(sum + (bias ? ToF(bias[c]) : 0.0f));
    if (y_f32) {
      static_cast<float*>(y)[m * n + c] = ToF(out);
    } else {
      static_cast<T*>(y)[m * n + c] = out;
    }
  }
}

}  // namespace

// bf16 ? f<bf16_t>(args...) : f<float>(args...), for the launchers below.
#define LOOM_DISPATCH(bf16, f, ...) ((bf16) ? f<bf16_t>(__VA_ARGS__) : f<float>(__VA_ARGS__))

template <typename T>
void LaunchRmsNorm(const void* x, const void* add, const void* add_delta, void* sum_out, const void* w, void* out,
                   int64_t rows, int64_t n, float eps, cudaStream_t stream) {
  // Enough threads for kNormPer elements each; 4 each up to n = 4096.
  const int64_t threads = std::min<int64_t>(1024, std::max<int64_t>(128, (n / 4 + 31) / 32 * 32));
  RmsNormKernel<T><<<static_cast<unsigned>(rows), static_cast<unsigned>(threads), 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(add), static_cast<const T*>(add_delta), static_cast<T*>(sum_out),
      static_cast<const T*>(w), static_cast<T*>(out), n, eps);
}

void RmsNorm(bool bf16, const void* x, const void* add, const void* add_delta, void* sum_out, const void* w,
             void* out, int64_t rows, int64_t n, float eps, cudaStream_t stream) {
  if (rows <= 0 || n > kMaxNormWidth) return;
  LOOM_DISPATCH(bf16, LaunchRmsNorm, x, add, add_delta, sum_out, w, out, rows, n, eps, stream);
}

template <typename T>
void LaunchQkNormRope(const void* qkv, const void* delta, const void* q_norm, const void* k_norm,
                      const int64_t* positions, const float* inv_freq, const int64_t* write_rows, void* q_out,
                      void* k_pool, void* v_pool, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      float eps, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads + 2 * kv_heads));
  QkNormRopeKernel<T><<<grid, static_cast<unsigned>(head_dim), static_cast<size_t>(head_dim) * sizeof(float), stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(delta), static_cast<const T*>(q_norm),
      static_cast<const T*>(k_norm), positions, inv_freq, write_rows, static_cast<T*>(q_out), static_cast<T*>(k_pool),
      static_cast<T*>(v_pool), static_cast<int>(heads), static_cast<int>(kv_heads), static_cast<int>(head_dim), eps);
}

void QkNormRopeWrite(bool bf16, const void* qkv, const void* qkv_delta, const void* q_norm, const void* k_norm,
                     const int64_t* positions, const float* inv_freq, const int64_t* write_rows, void* q_out,
                     void* k_pool, void* v_pool, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchQkNormRope, qkv, qkv_delta, q_norm, k_norm, positions, inv_freq, write_rows, q_out, k_pool,
                v_pool, rows, heads, kv_heads, head_dim, eps, stream);
}

template <typename T, int E>
void LaunchAttention(const void* q, const void* k_pool, const void* v_pool, const int32_t* table,
                     int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                     int64_t heads, int64_t kv_heads, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads)), block(32 * kAttnWarps);
  const float scale = 1.0f / sqrtf(static_cast<float>(32 * E));
  DecodeAttentionKernel<T, E><<<grid, block, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k_pool), static_cast<const T*>(v_pool), table, table_stride,
      ctx_len, static_cast<int>(block_size), static_cast<T*>(out), static_cast<int>(heads),
      static_cast<int>(kv_heads), scale);
}

void DecodeAttention(bool bf16, const void* q, const void* k_pool, const void* v_pool, const int32_t* block_table,
                     int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  if (rows <= 0) return;
  // head_dim = 32 * E, one kernel per E (the caller checks head_dim first).
  auto launch = [&](auto e) {
    constexpr int E = decltype(e)::value;
    if (bf16) {
      LaunchAttention<bf16_t, E>(q, k_pool, v_pool, block_table, table_stride, ctx_len, block_size, out, rows, heads,
                                 kv_heads, stream);
    } else {
      LaunchAttention<float, E>(q, k_pool, v_pool, block_table, table_stride, ctx_len, block_size, out, rows, heads,
                                kv_heads, stream);
    }
  };
  switch (head_dim) {
    case 32: return launch(std::integral_constant<int, 1>{});
    case 64: return launch(std::integral_constant<int, 2>{});
    case 128: return launch(std::integral_constant<int, 4>{});
    case 256: return launch(std::integral_constant<int, 8>{});
    default: return;
  }
}

template <typename T>
void LaunchSiluMul(const void* gate_up, const void* delta, void* out, int64_t rows, int64_t inter,
                   cudaStream_t stream) {
  const dim3 grid(Blocks(inter, kSiluThreads), static_cast<unsigned>(rows));
  SiluMulKernel<T><<<grid, kSiluThreads, 0, stream>>>(static_cast<const T*>(gate_up), static_cast<const T*>(delta),
                                                      static_cast<T*>(out), inter);
}

void SiluMul(bool bf16, const void* gate_up, const void* delta, void* out, int64_t rows, int64_t inter,
             cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchSiluMul, gate_up, delta, out, rows, inter, stream);
}

// The d_in split of the shrink: the fewest parts (a power of two <= 8)
// of at most kShrinkPart elements each.
namespace {
constexpr int64_t kShrinkPart = 1024;

int ShrinkSplit(int64_t d_in) {
  int split = 1;
  while (split < kShrinkWarps && d_in > kShrinkPart * split) split *= 2;
  return split;
}

// The tensor-core expand takes lora when its rank is 16, 32 or 64 and its
// segments are whole 16-column tiles.
bool MmaExpandFits(const LoraArgs& lora) {
  if (lora.rank != 16 && lora.rank != 32 && lora.rank != 64) return false;
  if (lora.r_total % 4 != 0 || !Aligned16(lora.t) || (reinterpret_cast<uintptr_t>(lora.B) & 7u) != 0) return false;
  for (int k = 0; k < kMaxSegments; ++k)
    if (lora.seg_end[k] % 16 != 0) return false;
  return true;
}
}  // namespace

template <typename T>
int LaunchShrink(const void* x, int64_t ldx, const void* A, const int32_t* slot, const float* scale, float* t,
                 int64_t rows, int64_t d_in, int64_t r_total, cudaStream_t stream, const ShrinkScratch* split) {
  constexpr int V = 16 / sizeof(T);
  const T* xt = static_cast<const T*>(x);
  const T* at = static_cast<const T*>(A);
  const bool vec = d_in % V == 0 && ldx % V == 0 && Aligned16(x) && Aligned16(A);
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (vec && d_in % 32 == 0) {
      // As many parts as d_in has rounds of kMmaShrinkUnroll steps per
      // warp, to the nearest (on the H200 splitting q/k/v's 1.25 rounds did
      // not help, o's 2 and down's 4.75 did), as far as the scratch holds.
      const int64_t tiles = Blocks(rows, kRowTile) * Blocks(r_total, 16);
      const int64_t round = kMmaShrinkWarps * kMmaShrinkUnroll, nearest = (d_in / 32 + round / 2) / round;
      int64_t parts = 1;
      if (split && split->part && split->tickets && tiles <= split->tickets_size)
        parts = std::clamp<int64_t>(nearest, 1, split->part_floats / (rows * r_total));
      const dim3 grid(Blocks(rows, kRowTile), Blocks(r_total, 16), static_cast<unsigned>(parts));
      LoraShrinkMmaKernel<<<grid, 32 * kMmaShrinkWarps, 0, stream>>>(
          xt, ldx, at, slot, scale, t, parts > 1 ? split->part : nullptr, parts > 1 ? split->tickets : nullptr, rows,
          d_in, r_total);
      return static_cast<int>(parts);
    }
  }
  const int per_split = ShrinkSplit(d_in);
  const int per_block = kShrinkJ * kShrinkWarps / per_split;
  const dim3 grid(Blocks(rows, kRowTile), Blocks(r_total, per_block)), block(32 * kShrinkWarps);
  if (vec) {
    LoraShrinkKernel<T, V><<<grid, block, 0, stream>>>(xt, ldx, at, slot, scale, t, rows, d_in, r_total, per_split);
  } else {
    LoraShrinkKernel<T, 1><<<grid, block, 0, stream>>>(xt, ldx, at, slot, scale, t, rows, d_in, r_total, per_split);
  }
  return 1;
}

int LoraShrink(bool bf16, const void* x, int64_t ldx, const void* A, const int32_t* slot, const float* scale,
               float* t, int64_t rows, int64_t d_in, int64_t r_total, cudaStream_t stream, const ShrinkScratch* split) {
  if (rows <= 0) return 1;
  return LOOM_DISPATCH(bf16, LaunchShrink, x, ldx, A, slot, scale, t, rows, d_in, r_total, stream, split);
}

template <typename T>
void LaunchExpand(const LoraArgs& lora, const void* y, void* out, bool out_f32, int64_t ld, int64_t rows,
                  cudaStream_t stream) {
  const T* yt = static_cast<const T*>(y);
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (MmaExpandFits(lora)) {
      const dim3 grid(Blocks(lora.d_total, kMmaExpandCols), Blocks(rows, kRowTile));
      const Lora<T> a = Resolve<T>(lora);
      const unsigned threads = 32 * kMmaExpandWarps;
      switch (lora.rank) {
        case 16: return LoraExpandMmaKernel<16><<<grid, threads, 0, stream>>>(a, yt, out, out_f32, ld, rows);
        case 32: return LoraExpandMmaKernel<32><<<grid, threads, 0, stream>>>(a, yt, out, out_f32, ld, rows);
        default: return LoraExpandMmaKernel<64><<<grid, threads, 0, stream>>>(a, yt, out, out_f32, ld, rows);
      }
    }
  }
  const dim3 grid(Blocks(lora.d_total, kExpandThreads), Blocks(rows, kRowTile));
  WithRank<T>(lora, [&](auto r) {
    LoraExpandKernel<T, decltype(r)::value><<<grid, kExpandThreads, 0, stream>>>(Resolve<T>(lora), yt, out, out_f32,
                                                                                  ld, rows);
  });
}

void LoraExpand(bool bf16, const LoraArgs& lora, const void* y, void* out, bool out_f32, int64_t ld, int64_t rows,
                cudaStream_t stream) {
  if (rows <= 0 || !lora.B) return;
  LOOM_DISPATCH(bf16, LaunchExpand, lora, y, out, out_f32, ld, rows, stream);
}

template <typename T, int M>
void LaunchGemv(const void* x, int64_t ldx, const void* W, const void* bias, void* y, bool y_f32, int64_t n, int64_t k,
                cudaStream_t stream) {
  GemvKernel<T, M><<<Blocks(n, kGemvWarps), 32 * kGemvWarps, 0, stream>>>(
      static_cast<const T*>(x), ldx, static_cast<const T*>(W), static_cast<const T*>(bias), y, y_f32, n, k);
}

template <typename T>
bool GemvFor(const void* x, int64_t ldx, const void* W, const void* bias, void* y, bool y_f32, int64_t rows, int64_t n,
             int64_t k, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  if (k % V != 0 || ldx % V != 0 || !Aligned16(x) || !Aligned16(W)) return false;
  switch (rows) {
    case 1:
      return LaunchGemv<T, 1>(x, ldx, W, bias, y, y_f32, n, k, stream), true;
    case 2:
      return LaunchGemv<T, 2>(x, ldx, W, bias, y, y_f32, n, k, stream), true;
    case 3:
      return LaunchGemv<T, 3>(x, ldx, W, bias, y, y_f32, n, k, stream), true;
    case 4:
      return LaunchGemv<T, 4>(x, ldx, W, bias, y, y_f32, n, k, stream), true;
    default:
      return false;
  }
}

bool Gemv(bool bf16, const void* x, int64_t ldx, const void* W, const void* bias, void* y, bool y_f32, int64_t rows,
          int64_t n, int64_t k, cudaStream_t stream) {
  if (rows <= 0 || rows > kGemvMaxRows || n <= 0 || k <= 0) return false;
  return bf16 ? GemvFor<bf16_t>(x, ldx, W, bias, y, y_f32, rows, n, k, stream)
              : GemvFor<float>(x, ldx, W, bias, y, y_f32, rows, n, k, stream);
}

#undef LOOM_DISPATCH

}  // namespace loom::engine::cuda
