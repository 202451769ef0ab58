// LoraShrink (lora.h): CUDA cores for fp32, tensor cores for bf16.
#include <algorithm>
#include <type_traits>

#include "engine/sample/cuda/lora.h"
#include "engine/sample/cuda/lora_tile.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

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

// The d_in split of the shrink: the fewest parts (a power of two <= 8)
// of at most kShrinkPart elements each.
constexpr int64_t kShrinkPart = 1024;

int ShrinkSplit(int64_t d_in) {
  int split = 1;
  while (split < kShrinkWarps && d_in > kShrinkPart * split) split *= 2;
  return split;
}


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

}  // namespace

int LoraShrink(bool bf16, const void* x, int64_t ldx, const void* A, const int32_t* slot, const float* scale,
               float* t, int64_t rows, int64_t d_in, int64_t r_total, cudaStream_t stream, const ShrinkScratch* split) {
  if (rows <= 0) return 1;
  return LOOM_DISPATCH(bf16, LaunchShrink, x, ldx, A, slot, scale, t, rows, d_in, r_total, stream, split);
}

}  // namespace loom::engine::cuda
