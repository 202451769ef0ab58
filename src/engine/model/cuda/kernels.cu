// The fused decode kernels declared in kernels.h. Each is a plain,
// readable kernel: decode steps are small (a few rows), so these are bound
// by memory and launch count, not by arithmetic.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "engine/model/cuda/kernels.h"

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

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

unsigned Blocks(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

// ---- LoRA, BGMV-style: every row reads its own slot's factors ----

constexpr int kRowTile = 8;  // rows of one tile; rows of one slot share its factor loads

// Calls f(slot, members) for each run of the tile's rows [r0, r0 + n) that
// share a slot, members being the bit set of those rows (uniform across the
// block: it depends on slot[] only).
template <typename F>
__device__ __forceinline__ void ForEachSlotRun(const int32_t* slot, int64_t r0, int n, F&& f) {
  unsigned done = 0;
  for (int k = 0; k < n; ++k) {
    if ((done >> k) & 1u) continue;
    const int sl = slot[r0 + k];
    unsigned members = 0;
    for (int q = k; q < n; ++q)
      if (!((done >> q) & 1u) && slot[r0 + q] == sl) members |= 1u << q;
    done |= members;
    f(sl, members);
  }
}

__device__ __forceinline__ bool Member(unsigned members, int q) { return (members >> q) & 1u; }

// LoraArgs with the element type resolved.
template <typename T>
struct Lora {
  const T* B;
  const float* t;
  const int32_t* slot;
  int64_t rank, r_total, d_total;
  __device__ bool on() const { return B != nullptr; }
};

template <typename T>
Lora<T> Resolve(const LoraArgs& a) {
  return {static_cast<const T*>(a.B), a.t, a.slot, a.rank, a.r_total, a.d_total};
}

// Calls f(std::integral_constant<int, R>) with R = a's rank when it is one
// of the common ranks and B and t rows allow 16-byte loads (kernels then
// unroll the rank loop and issue all its loads at once), else R = 0 (any
// rank, element by element). No LoRA: R = 0.
template <typename T, typename F>
void WithRank(const LoraArgs& a, F&& f) {
  constexpr int V = 16 / sizeof(T);
  if (a.B && a.rank % V == 0 && Aligned16(a.B) && Aligned16(a.t)) {
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

// V consecutive fp32 from p (16-byte aligned), as float4 loads.
template <int V>
__device__ __forceinline__ void LoadF(const float* p, float* out) {
#pragma unroll
  for (int k = 0; k < V; k += 4) {
    const float4 f = *reinterpret_cast<const float4*>(p + k);
    out[k] = f.x, out[k + 1] = f.y, out[k + 2] = f.z, out[k + 3] = f.w;
  }
}

// Block-cooperative expand: out[q * nc + k] = the unrounded delta of output
// column c0 + k (k < nc, all in segment seg) for the tile rows r0 + q that
// are members of one slot run of slot sl; other entries are left.
// Layout (R > 0): kLanes = R / V lanes share a column, each holding V of the
// rank for every member row's t in registers, so a warp covers 32 / kLanes
// columns per step with one 16-byte B load per lane and a kLanes-wide
// shuffle sum; B rows are read once per tile, not once per row. R == 0:
// one lane per column, element by element.
template <typename T, int R>
__device__ void BlockExpand(const Lora<T>& a, int sl, unsigned members, int64_t r0, int n, int64_t c0, int nc, int seg,
                            float* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const T* b0 = a.B + (static_cast<int64_t>(sl) * a.d_total + c0) * a.rank;
  if constexpr (R > 0) {
    constexpr int V = 16 / sizeof(T), kLanes = R / V, kCols = 32 / kLanes;
    static_assert(R % V == 0 && 32 % kLanes == 0, "rank: a multiple of the vector width, at most 32 vectors");
    const int part = lane % kLanes, col = lane / kLanes;
    float t[kRowTile][V];
#pragma unroll
    for (int q = 0; q < kRowTile; ++q) {
      if (q < n && Member(members, q)) {
        LoadF<V>(a.t + (r0 + q) * a.r_total + seg * R + part * V, t[q]);
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) t[q][v] = 0.0f;
      }
    }
    for (int k0 = warp * kCols; k0 < nc; k0 += warps * kCols) {
      const int k = k0 + col;
      float bv[V];
      if (k < nc) {
        LoadV<T, V>(b0 + static_cast<int64_t>(k) * R + part * V, bv);
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) bv[v] = 0.0f;
      }
#pragma unroll
      for (int q = 0; q < kRowTile; ++q) {
        float acc = 0.0f;
#pragma unroll
        for (int v = 0; v < V; ++v) acc += bv[v] * t[q][v];
#pragma unroll
        for (int o = kLanes / 2; o >= 1; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (part == 0 && k < nc && q < n && Member(members, q)) out[q * nc + k] = acc;
      }
    }
  } else {
    for (int k = threadIdx.x; k < nc; k += blockDim.x) {
      const T* b = b0 + static_cast<int64_t>(k) * a.rank;
      for (int q = 0; q < n; ++q) {
        if (!Member(members, q)) continue;
        const float* t = a.t + (r0 + q) * a.r_total + seg * a.rank;
        float acc = 0.0f;
        for (int64_t r = 0; r < a.rank; ++r) acc += ToF(b[r]) * t[r];
        out[q * nc + k] = acc;
      }
    }
  }
}

// BlockExpand for every slot run of the tile (rows of base slots get 0),
// then a barrier: out is ready for the whole block.
template <typename T, int R>
__device__ void TileExpand(const Lora<T>& a, int64_t r0, int n, int64_t c0, int nc, int seg, float* out) {
  for (int i = threadIdx.x; i < n * nc; i += blockDim.x) out[i] = 0.0f;
  __syncthreads();
  ForEachSlotRun(a.slot, r0, n, [&](int sl, unsigned members) {
    if (sl >= 0) BlockExpand<T, R>(a, sl, members, r0, n, c0, nc, seg, out);
  });
  __syncthreads();
}

// y + delta as the eager path computes it in T: y + T(delta), rounded.
template <typename T>
__device__ __forceinline__ float AddDelta(float y, float delta) { return Round<T>(y + Round<T>(delta)); }

// Grid (ceil(rows / kRowTile), ceil(r_total / kShrinkCols)), kShrinkWarps
// warps splitting d_in: for each run of the tile's rows with one slot, the
// block's kShrinkCols columns of that slot's A are read once and every
// member row's x against them; warps' partial sums meet in shared memory
// (a fixed order: results do not depend on scheduling).
constexpr int kShrinkWarps = 8;
constexpr int kShrinkCols = 4;
static_assert(kRowTile * kShrinkCols == 32, "one shrink output per lane");

// v[32] per lane in, the sum over the warp's lanes of v[lane] out, in 31
// shuffles (a butterfly that halves the values kept at each step; 32 warp
// sums would take 160).
__device__ __forceinline__ float ReduceScatter32(float* v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) {
    const bool upper = lane & o;
#pragma unroll
    for (int i = 0; i < o; ++i) {
      const float send = upper ? v[i] : v[i + o];
      const float keep = upper ? v[i + o] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
  return v[0];
}

template <typename T, int V>
__global__ void LoraShrinkKernel(const T* x, int64_t ldx, const T* A, const int32_t* slot, const float* scale,
                                 float* t, int64_t rows, int64_t d_in, int64_t r_total) {
  __shared__ float part[kShrinkWarps][kRowTile][kShrinkCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowTile, j0 = static_cast<int64_t>(blockIdx.y) * kShrinkCols;
  const int n = static_cast<int>(min(static_cast<int64_t>(kRowTile), rows - r0));
  const int nj = static_cast<int>(min(static_cast<int64_t>(kShrinkCols), r_total - j0));
  ForEachSlotRun(slot, r0, n, [&](int sl, unsigned members) {
    float acc[kRowTile][kShrinkCols];
#pragma unroll
    for (int q = 0; q < kRowTile; ++q)
#pragma unroll
      for (int c = 0; c < kShrinkCols; ++c) acc[q][c] = 0.0f;
    if (sl >= 0) {
      const T* a = A + (static_cast<int64_t>(sl) * r_total + j0) * d_in;
      for (int64_t i = (static_cast<int64_t>(warp) * 32 + lane) * V; i < d_in; i += kShrinkWarps * 32 * V) {
        float av[kShrinkCols][V];
#pragma unroll
        for (int c = 0; c < kShrinkCols; ++c) {
          if (c < nj) {
            LoadV<T, V>(a + c * d_in + i, av[c]);
          } else {
#pragma unroll
            for (int v = 0; v < V; ++v) av[c][v] = 0.0f;
          }
        }
#pragma unroll
        for (int q = 0; q < kRowTile; ++q) {
          if (q >= n || !Member(members, q)) continue;
          float xv[V];
          LoadV<T, V>(x + (r0 + q) * ldx + i, xv);
#pragma unroll
          for (int c = 0; c < kShrinkCols; ++c)
#pragma unroll
            for (int v = 0; v < V; ++v) acc[q][c] += av[c][v] * xv[v];
        }
      }
    }
    // Lane l ends with the warp's sum of output (l / kShrinkCols, l % kShrinkCols).
    part[warp][lane / kShrinkCols][lane % kShrinkCols] = ReduceScatter32(&acc[0][0]);
    __syncthreads();
    if (threadIdx.x < kRowTile * kShrinkCols) {
      const int q = threadIdx.x / kShrinkCols, c = threadIdx.x % kShrinkCols;
      if (q < n && Member(members, q) && c < nj) {
        float sum = 0.0f;
        for (int w = 0; w < kShrinkWarps; ++w) sum += part[w][q][c];
        t[(r0 + q) * r_total + j0 + c] = sl >= 0 ? sum * scale[sl] : 0.0f;
      }
    }
    __syncthreads();
  });
}

constexpr int kExpandCols = 256;  // output columns per block of the expanding kernels

// Grid (ceil(d_total / kExpandCols), ceil(rows / kRowTile)): y[r, c] += delta
// (segment 0).
template <typename T, int R>
__global__ void LoraExpandKernel(Lora<T> a, void* y, bool y_f32, int64_t ldy, int64_t rows) {
  __shared__ float delta[kRowTile * kExpandCols];
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kExpandCols, r0 = static_cast<int64_t>(blockIdx.y) * kRowTile;
  const int n = static_cast<int>(min(static_cast<int64_t>(kRowTile), rows - r0));
  const int nc = static_cast<int>(min(static_cast<int64_t>(kExpandCols), a.d_total - c0));
  TileExpand<T, R>(a, r0, n, c0, nc, 0, delta);
  for (int i = threadIdx.x; i < n * nc; i += blockDim.x) {
    const int q = i / nc;
    if (a.slot[r0 + q] < 0) continue;  // base rows: y stays
    const int64_t at = (r0 + q) * ldy + c0 + i % nc;
    if (y_f32) {
      static_cast<float*>(y)[at] += delta[i];
    } else {
      T* yy = static_cast<T*>(y) + at;
      *yy = FromF<T>(AddDelta<T>(ToF(*yy), delta[i]));
    }
  }
}

// ---- the consumers of the projections, each adding its LoRA delta ----

constexpr int kNormPer = kMaxNormWidth / 1024;  // elements per thread, held in registers

// One block per row: out = w * T(norm(x + add')), add' = add with its LoRA
// delta (la: the projection that produced add; the delta row in dynamic
// shared memory, n floats), the sum written to sum_out.
template <typename T, int R>
__global__ void RmsNormKernel(const T* x, const T* add, Lora<T> la, T* sum_out, const T* w, T* out, int64_t n,
                              float eps) {
  extern __shared__ float delta[];  // [n] when add has LoRA
  const int64_t row = blockIdx.x, base = row * n;
  const bool lora = add && la.on();
  if (lora) TileExpand<T, R>(la, row, 1, 0, static_cast<int>(n), 0, delta);
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
      if (lora) a = AddDelta<T>(a, delta[i]);
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

// Grid (rows, H + 2 KVH heads), hd threads. qkv's LoRA delta (segments q,
// k, v) is added to each head before its norm and rotation.
template <typename T, int R>
__global__ void QkNormRopeKernel(const T* qkv, Lora<T> la, const T* q_norm, const T* k_norm, const int64_t* positions,
                                 const float* inv_freq, const int64_t* write_rows, T* q_out, T* k_pool, T* v_pool,
                                 int heads, int kv_heads, int hd, float eps) {
  extern __shared__ float head[];  // hd, then hd of LoRA delta
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y, i = threadIdx.x;
  const int64_t width = static_cast<int64_t>(heads + 2 * kv_heads) * hd;
  const T* src = qkv + s * width + static_cast<int64_t>(h) * hd;
  const bool is_q = h < heads, is_k = !is_q && h < heads + kv_heads;
  float v = ToF(src[i]);
  if (la.on()) {
    float* delta = head + hd;
    TileExpand<T, R>(la, s, 1, static_cast<int64_t>(h) * hd, hd, is_q ? 0 : is_k ? 1 : 2, delta);
    v = AddDelta<T>(v, delta[i]);
  }
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
  const float c = Round<T>(cosf(angle)), sn = Round<T>(sinf(angle));
  const T out = FromF<T>(Round<T>(v * c) + Round<T>(rot * sn));
  if (is_q) {
    q_out[(s * heads + h) * hd + i] = out;
  } else {
    k_pool[(write_rows[s] * kv_heads + (h - heads)) * hd + i] = out;
  }
}

// Grid (ceil(inter / kExpandCols), ceil(rows / kRowTile)), kExpandCols
// threads: one per column c and tile. gate and up get their LoRA deltas
// (segments 0 and 1, columns c and inter + c), then out = T(silu(gate)) * up.
template <typename T, int R>
__global__ void SiluMulKernel(const T* gate_up, Lora<T> la, T* out, int64_t rows, int64_t inter) {
  __shared__ float dg[kRowTile * kExpandCols], du[kRowTile * kExpandCols];
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kExpandCols, r0 = static_cast<int64_t>(blockIdx.y) * kRowTile;
  const int n = static_cast<int>(min(static_cast<int64_t>(kRowTile), rows - r0));
  const int nc = static_cast<int>(min(static_cast<int64_t>(kExpandCols), inter - c0));
  if (la.on()) {
    TileExpand<T, R>(la, r0, n, c0, nc, 0, dg);
    TileExpand<T, R>(la, r0, n, inter + c0, nc, 1, du);
  }
  const int k = threadIdx.x;
  if (k >= nc) return;
  for (int q = 0; q < n; ++q) {
    const T* gu = gate_up + (r0 + q) * 2 * inter + c0 + k;
    float g = ToF(gu[0]), u = ToF(gu[inter]);
    if (la.on()) {
      g = AddDelta<T>(g, dg[q * nc + k]);
      u = AddDelta<T>(u, du[q * nc + k]);
    }
    const float silu = Round<T>(g / (1.0f + expf(-g)));
    out[(r0 + q) * inter + c0 + k] = FromF<T>(silu * u);
  }
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
void LaunchRmsNorm(const void* x, const void* add, const LoraArgs& add_lora, void* sum_out, const void* w, void* out,
                   int64_t rows, int64_t n, float eps, cudaStream_t stream) {
  // Enough threads for kNormPer elements each; 4 each up to n = 4096.
  const int64_t threads = std::min<int64_t>(1024, std::max<int64_t>(128, (n / 4 + 31) / 32 * 32));
  const size_t shared = add && add_lora.B ? static_cast<size_t>(n) * sizeof(float) : 0;
  WithRank<T>(add_lora, [&](auto r) {
    RmsNormKernel<T, decltype(r)::value><<<static_cast<unsigned>(rows), static_cast<unsigned>(threads), shared, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(add), Resolve<T>(add_lora), static_cast<T*>(sum_out),
        static_cast<const T*>(w), static_cast<T*>(out), n, eps);
  });
}

void RmsNorm(bool bf16, const void* x, const void* add, const LoraArgs& add_lora, void* sum_out, const void* w,
             void* out, int64_t rows, int64_t n, float eps, cudaStream_t stream) {
  if (rows <= 0 || n > kMaxNormWidth) return;
  LOOM_DISPATCH(bf16, LaunchRmsNorm, x, add, add_lora, sum_out, w, out, rows, n, eps, stream);
}

template <typename T>
void LaunchQkNormRope(const void* qkv, const LoraArgs& lora, const void* q_norm, const void* k_norm,
                      const int64_t* positions, const float* inv_freq, const int64_t* write_rows, void* q_out,
                      void* k_pool, void* v_pool, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      float eps, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads + 2 * kv_heads));
  const size_t shared = static_cast<size_t>(head_dim) * sizeof(float) * (lora.B ? 2 : 1);
  WithRank<T>(lora, [&](auto r) {
    QkNormRopeKernel<T, decltype(r)::value><<<grid, static_cast<unsigned>(head_dim), shared, stream>>>(
        static_cast<const T*>(qkv), Resolve<T>(lora), static_cast<const T*>(q_norm), static_cast<const T*>(k_norm),
        positions, inv_freq, write_rows, static_cast<T*>(q_out), static_cast<T*>(k_pool), static_cast<T*>(v_pool),
        static_cast<int>(heads), static_cast<int>(kv_heads), static_cast<int>(head_dim), eps);
  });
}

void QkNormRopeWrite(bool bf16, const void* qkv, const LoraArgs& qkv_lora, const void* q_norm, const void* k_norm,
                     const int64_t* positions, const float* inv_freq, const int64_t* write_rows, void* q_out,
                     void* k_pool, void* v_pool, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchQkNormRope, qkv, qkv_lora, q_norm, k_norm, positions, inv_freq, write_rows, q_out, k_pool,
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
void LaunchSiluMul(const void* gate_up, const LoraArgs& lora, void* out, int64_t rows, int64_t inter,
                   cudaStream_t stream) {
  const dim3 grid(Blocks(inter, kExpandCols), Blocks(rows, kRowTile));
  WithRank<T>(lora, [&](auto r) {
    SiluMulKernel<T, decltype(r)::value><<<grid, kExpandCols, 0, stream>>>(static_cast<const T*>(gate_up), Resolve<T>(lora),
                                                                   static_cast<T*>(out), rows, inter);
  });
}

void SiluMul(bool bf16, const void* gate_up, const LoraArgs& lora, void* out, int64_t rows, int64_t inter,
             cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchSiluMul, gate_up, lora, out, rows, inter, stream);
}

template <typename T>
void LaunchShrink(const void* x, int64_t ldx, const void* A, const int32_t* slot, const float* scale, float* t,
                  int64_t rows, int64_t d_in, int64_t r_total, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const dim3 grid(Blocks(rows, kRowTile), Blocks(r_total, kShrinkCols)), block(32 * kShrinkWarps);
  const T* xt = static_cast<const T*>(x);
  const T* at = static_cast<const T*>(A);
  if (d_in % V == 0 && ldx % V == 0 && Aligned16(x) && Aligned16(A)) {
    LoraShrinkKernel<T, V><<<grid, block, 0, stream>>>(xt, ldx, at, slot, scale, t, rows, d_in, r_total);
  } else {
    LoraShrinkKernel<T, 1><<<grid, block, 0, stream>>>(xt, ldx, at, slot, scale, t, rows, d_in, r_total);
  }
}

void LoraShrink(bool bf16, const void* x, int64_t ldx, const void* A, const int32_t* slot, const float* scale,
                float* t, int64_t rows, int64_t d_in, int64_t r_total, cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchShrink, x, ldx, A, slot, scale, t, rows, d_in, r_total, stream);
}

template <typename T>
void LaunchExpand(const LoraArgs& lora, void* y, bool y_f32, int64_t ldy, int64_t rows, cudaStream_t stream) {
  const dim3 grid(Blocks(lora.d_total, kExpandCols), Blocks(rows, kRowTile));
  WithRank<T>(lora, [&](auto r) {
    LoraExpandKernel<T, decltype(r)::value><<<grid, kExpandCols, 0, stream>>>(Resolve<T>(lora), y, y_f32, ldy, rows);
  });
}

void LoraExpand(bool bf16, const LoraArgs& lora, void* y, bool y_f32, int64_t ldy, int64_t rows, cudaStream_t stream) {
  if (rows <= 0 || !lora.B) return;
  LOOM_DISPATCH(bf16, LaunchExpand, lora, y, y_f32, ldy, rows, stream);
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
