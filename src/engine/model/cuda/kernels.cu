// The fused decode kernels declared in kernels.h. Each is a plain,
// readable kernel: decode steps are small (a few rows), so these are bound
// by memory and launch count, not by arithmetic.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

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

template <typename T>
__global__ void RmsNormKernel(const T* x, const T* add, T* sum_out, const T* w, T* out, int64_t n, float eps) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float v = ToF(x[base + i]);
    if (add) {
      v = Round<T>(v + ToF(add[base + i]));
      sum_out[base + i] = FromF<T>(v);
    }
    ss += v * v;
  }
  const float inv = rsqrtf(BlockSum(ss) / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = add ? ToF(sum_out[base + i]) : ToF(x[base + i]);
    out[base + i] = FromF<T>(ToF(w[i]) * Round<T>(v * inv));
  }
}

template <typename T>
__global__ void QkNormRopeKernel(const T* qkv, const T* q_norm, const T* k_norm, const int64_t* positions,
                                 const float* inv_freq, const int64_t* write_rows, T* q_out, T* k_pool, T* v_pool,
                                 int heads, int kv_heads, int hd, float eps) {
  extern __shared__ float head[];  // hd
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y, i = threadIdx.x;
  const int64_t width = static_cast<int64_t>(heads + 2 * kv_heads) * hd;
  const T* src = qkv + s * width + static_cast<int64_t>(h) * hd;
  const bool is_q = h < heads, is_k = !is_q && h < heads + kv_heads;
  if (!is_q && !is_k) {  // a value head: straight into the cache
    v_pool[(write_rows[s] * kv_heads + (h - heads - kv_heads)) * hd + i] = src[i];
    return;
  }
  float v = ToF(src[i]);
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

template <typename T>
__global__ void SiluMulKernel(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  const int64_t total = rows * inter;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / inter, c = k % inter;
    const float g = ToF(gate_up[r * 2 * inter + c]);
    const float silu = Round<T>(g / (1.0f + expf(-g)));
    out[k] = FromF<T>(silu * ToF(gate_up[r * 2 * inter + inter + c]));
  }
}

constexpr int kShrinkWarps = 8;
constexpr int kRowTile = 8;  // rows of one LoRA block; rows of one slot share its factor loads

// Loads V consecutive T into fp32 (one 16-byte load when V * sizeof(T) == 16;
// the caller guarantees alignment then).
template <typename T, int V>
__device__ __forceinline__ void LoadV(const T* p, float* out) {
  if constexpr (V * sizeof(T) == 16) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = ToF(e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = ToF(p[k]);
  }
}

// The tile rows [q] not yet handled whose slot equals that of row k
// (uniform across the block: it depends on slot[] only).
__device__ __forceinline__ unsigned SameSlot(const int32_t* slot, int64_t r0, int n, int k, unsigned done) {
  unsigned members = 0;
  const int sl = slot[r0 + k];
  for (int q = k; q < n; ++q)
    if (!((done >> q) & 1u) && slot[r0 + q] == sl) members |= 1u << q;
  return members;
}

// Grid (ceil(rows / kRowTile), ceil(r_total / kShrinkWarps), splits); one
// warp per output column j and split z of d_in (chunk elements each), for
// the tile's rows: each run of rows with one slot reads that slot's A
// once and every row's x against it. Split z writes its partial sums to
// t[z] ([splits, rows, r_total]); the expand kernel adds the splits (in a
// fixed order: results do not depend on scheduling).
template <typename T, int V>
__global__ void LoraShrinkKernel(const T* x, int64_t ldx, const T* A, const int32_t* slot, const float* scale,
                                 float* t, int64_t rows, int64_t d_in, int64_t r_total, int64_t chunk) {
  const int lane = threadIdx.x & 31;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * kShrinkWarps + (threadIdx.x >> 5);
  if (j >= r_total) return;
  const int64_t k0 = static_cast<int64_t>(blockIdx.z) * chunk, k1 = min(d_in, k0 + chunk);
  t += static_cast<int64_t>(blockIdx.z) * rows * r_total;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowTile;
  const int n = static_cast<int>(min(static_cast<int64_t>(kRowTile), rows - r0));
  unsigned done = 0;
  for (int k = 0; k < n; ++k) {
    if ((done >> k) & 1u) continue;
    const unsigned members = SameSlot(slot, r0, n, k, done);
    done |= members;
    const int sl = slot[r0 + k];
    float acc[kRowTile];
#pragma unroll
    for (int q = 0; q < kRowTile; ++q) acc[q] = 0.0f;
    if (sl >= 0) {
      const T* a = A + (static_cast<int64_t>(sl) * r_total + j) * d_in;
      for (int64_t i = k0 + static_cast<int64_t>(lane) * V; i < k1; i += 32 * V) {
        float av[V];
        LoadV<T, V>(a + i, av);
#pragma unroll
        for (int q = 0; q < kRowTile; ++q) {
          if (q >= n || !((members >> q) & 1u)) continue;
          float xv[V];
          LoadV<T, V>(x + (r0 + q) * ldx + i, xv);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[q] += av[v] * xv[v];
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kRowTile; ++q) {
      if (q >= n || !((members >> q) & 1u)) continue;
      const float d = WarpSum(acc[q]);
      if (lane == 0) t[(r0 + q) * r_total + j] = sl >= 0 ? d * scale[sl] : 0.0f;
    }
  }
}

struct Segments {
  int64_t end[4];
  int n;
};

// Grid (ceil(rows / tile), ceil(d_total / 256)); one thread per output
// column c, for the tile's rows (their t in shared memory): each run of rows
// with one slot reads that slot's B row once.
template <typename T, int V>
__global__ void LoraExpandKernel(const float* t, int splits, int64_t r_total, const T* B, int64_t rank,
                                 const int32_t* slot, void* y, bool y_f32, int64_t ldy, int64_t rows, int tile,
                                 int64_t d_total, Segments segs) {
  extern __shared__ float ts[];  // [tile, r_total]: the shrink's splits summed
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * tile;
  const int n = static_cast<int>(min(static_cast<int64_t>(tile), rows - r0));
  for (int64_t i = threadIdx.x; i < n * r_total; i += blockDim.x) {
    float sum = 0.0f;
    for (int z = 0; z < splits; ++z) sum += t[(z * rows + r0) * r_total + i];
    ts[i] = sum;
  }
  __syncthreads();
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= d_total) return;
  int seg = 0;
  while (seg + 1 < segs.n && c >= segs.end[seg]) ++seg;
  unsigned done = 0;
  for (int k = 0; k < n; ++k) {
    if ((done >> k) & 1u) continue;
    const unsigned members = SameSlot(slot, r0, n, k, done);
    done |= members;
    const int sl = slot[r0 + k];
    if (sl < 0) continue;  // base rows: y stays
    const T* b = B + (static_cast<int64_t>(sl) * d_total + c) * rank;
    float acc[kRowTile];
#pragma unroll
    for (int q = 0; q < kRowTile; ++q) acc[q] = 0.0f;
    for (int64_t r = 0; r < rank; r += V) {
      float bv[V];
      LoadV<T, V>(b + r, bv);
#pragma unroll
      for (int q = 0; q < kRowTile; ++q) {
        if (q >= n || !((members >> q) & 1u)) continue;
        const float* tq = ts + q * r_total + seg * rank + r;
#pragma unroll
        for (int v = 0; v < V; ++v) acc[q] += bv[v] * tq[v];
      }
    }
#pragma unroll
    for (int q = 0; q < kRowTile; ++q) {
      if (q >= n || !((members >> q) & 1u)) continue;
      const int64_t at = (r0 + q) * ldy + c;
      if (y_f32) {
        static_cast<float*>(y)[at] += acc[q];
      } else {
        T* yy = static_cast<T*>(y) + at;
        *yy = FromF<T>(ToF(*yy) + Round<T>(acc[q]));
      }
    }
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

unsigned Blocks(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

}  // namespace

void RmsNorm(bool bf16, const void* x, const void* add, void* sum_out, const void* w, void* out, int64_t rows,
             int64_t n, float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  const dim3 grid(static_cast<unsigned>(rows)), block(256);
  if (bf16) {
    RmsNormKernel<bf16_t><<<grid, block, 0, stream>>>(static_cast<const bf16_t*>(x), static_cast<const bf16_t*>(add),
                                                      static_cast<bf16_t*>(sum_out), static_cast<const bf16_t*>(w),
                                                      static_cast<bf16_t*>(out), n, eps);
  } else {
    RmsNormKernel<float><<<grid, block, 0, stream>>>(static_cast<const float*>(x), static_cast<const float*>(add),
                                                     static_cast<float*>(sum_out), static_cast<const float*>(w),
                                                     static_cast<float*>(out), n, eps);
  }
}

void QkNormRopeWrite(bool bf16, const void* qkv, const void* q_norm, const void* k_norm, const int64_t* positions,
                     const float* inv_freq, const int64_t* write_rows, void* q_out, void* k_pool, void* v_pool,
                     int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads + 2 * kv_heads));
  const dim3 block(static_cast<unsigned>(head_dim));
  const size_t shared = static_cast<size_t>(head_dim) * sizeof(float);
  const int H = static_cast<int>(heads), KVH = static_cast<int>(kv_heads), hd = static_cast<int>(head_dim);
  if (bf16) {
    QkNormRopeKernel<bf16_t><<<grid, block, shared, stream>>>(
        static_cast<const bf16_t*>(qkv), static_cast<const bf16_t*>(q_norm), static_cast<const bf16_t*>(k_norm),
        positions, inv_freq, write_rows, static_cast<bf16_t*>(q_out), static_cast<bf16_t*>(k_pool),
        static_cast<bf16_t*>(v_pool), H, KVH, hd, eps);
  } else {
    QkNormRopeKernel<float><<<grid, block, shared, stream>>>(
        static_cast<const float*>(qkv), static_cast<const float*>(q_norm), static_cast<const float*>(k_norm),
        positions, inv_freq, write_rows, static_cast<float*>(q_out), static_cast<float*>(k_pool),
        static_cast<float*>(v_pool), H, KVH, hd, eps);
  }
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

template <typename T>
void AttentionFor(int64_t head_dim, const void* q, const void* k_pool, const void* v_pool, const int32_t* table,
                  int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                  int64_t heads, int64_t kv_heads, cudaStream_t stream) {
  switch (head_dim) {
    case 32:
      return LaunchAttention<T, 1>(q, k_pool, v_pool, table, table_stride, ctx_len, block_size, out, rows, heads,
                                   kv_heads, stream);
    case 64:
      return LaunchAttention<T, 2>(q, k_pool, v_pool, table, table_stride, ctx_len, block_size, out, rows, heads,
                                   kv_heads, stream);
    case 128:
      return LaunchAttention<T, 4>(q, k_pool, v_pool, table, table_stride, ctx_len, block_size, out, rows, heads,
                                   kv_heads, stream);
    case 256:
      return LaunchAttention<T, 8>(q, k_pool, v_pool, table, table_stride, ctx_len, block_size, out, rows, heads,
                                   kv_heads, stream);
    default:  // the caller checks SupportedHeadDim first
      return;
  }
}

void DecodeAttention(bool bf16, const void* q, const void* k_pool, const void* v_pool, const int32_t* block_table,
                     int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  if (rows <= 0) return;
  if (bf16) {
    AttentionFor<bf16_t>(head_dim, q, k_pool, v_pool, block_table, table_stride, ctx_len, block_size, out, rows,
                         heads, kv_heads, stream);
  } else {
    AttentionFor<float>(head_dim, q, k_pool, v_pool, block_table, table_stride, ctx_len, block_size, out, rows, heads,
                        kv_heads, stream);
  }
}

void SiluMul(bool bf16, const void* gate_up, void* out, int64_t rows, int64_t inter, cudaStream_t stream) {
  if (rows <= 0) return;
  const unsigned blocks = std::min<unsigned>(Blocks(rows * inter, 256), 4096u);
  if (bf16) {
    SiluMulKernel<bf16_t><<<blocks, 256, 0, stream>>>(static_cast<const bf16_t*>(gate_up), static_cast<bf16_t*>(out),
                                                      rows, inter);
  } else {
    SiluMulKernel<float><<<blocks, 256, 0, stream>>>(static_cast<const float*>(gate_up), static_cast<float*>(out),
                                                     rows, inter);
  }
}

// d_in elements per split: two 16-byte loads per lane.
int64_t SplitChunk(bool bf16) { return 32 * 2 * (bf16 ? 8 : 4); }

template <typename T>
void ShrinkFor(const void* x, int64_t ldx, const void* A, const int32_t* slot, const float* scale, float* t,
               int64_t rows, int64_t d_in, int64_t r_total, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const int64_t chunk = SplitChunk(sizeof(T) == 2);
  const dim3 grid(Blocks(rows, kRowTile), Blocks(r_total, kShrinkWarps), Blocks(d_in, static_cast<int>(chunk)));
  const dim3 block(32 * kShrinkWarps);
  const T* xt = static_cast<const T*>(x);
  const T* at = static_cast<const T*>(A);
  if (d_in % V == 0 && ldx % V == 0 && Aligned16(x) && Aligned16(A)) {
    LoraShrinkKernel<T, V><<<grid, block, 0, stream>>>(xt, ldx, at, slot, scale, t, rows, d_in, r_total, chunk);
  } else {
    LoraShrinkKernel<T, 1><<<grid, block, 0, stream>>>(xt, ldx, at, slot, scale, t, rows, d_in, r_total, chunk);
  }
}

int LoraSplits(bool bf16, int64_t d_in) { return static_cast<int>((d_in + SplitChunk(bf16) - 1) / SplitChunk(bf16)); }

void LoraShrink(bool bf16, const void* x, int64_t ldx, const void* A, const int32_t* slot, const float* scale,
                float* t, int64_t rows, int64_t d_in, int64_t r_total, cudaStream_t stream) {
  if (rows <= 0) return;
  if (bf16) {
    ShrinkFor<bf16_t>(x, ldx, A, slot, scale, t, rows, d_in, r_total, stream);
  } else {
    ShrinkFor<float>(x, ldx, A, slot, scale, t, rows, d_in, r_total, stream);
  }
}

template <typename T>
void ExpandFor(const float* t, int splits, int64_t r_total, const void* B, int64_t rank, const int32_t* slot, void* y,
               bool y_f32, int64_t ldy, int64_t rows, int64_t d_total, const Segments& sg, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  // Rows per block: up to kRowTile, with their t at most 32 KiB of shared memory.
  const int tile = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kRowTile, 8192 / r_total)));
  const dim3 grid(Blocks(rows, tile), Blocks(d_total, 256)), block(256);
  const size_t shared = static_cast<size_t>(tile * r_total) * sizeof(float);
  const T* bt = static_cast<const T*>(B);
  if (rank % V == 0 && Aligned16(B)) {
    LoraExpandKernel<T, V><<<grid, block, shared, stream>>>(t, splits, r_total, bt, rank, slot, y, y_f32, ldy, rows, tile,
                                                           d_total, sg);
  } else {
    LoraExpandKernel<T, 1><<<grid, block, shared, stream>>>(t, splits, r_total, bt, rank, slot, y, y_f32, ldy, rows, tile,
                                                           d_total, sg);
  }
}

void LoraExpand(bool bf16, const float* t, int splits, int64_t r_total, const void* B, int64_t rank, const int32_t* slot,
                void* y, bool y_f32, int64_t ldy, int64_t rows, int64_t d_total, const int64_t* seg_end, int segs,
                cudaStream_t stream) {
  if (rows <= 0) return;
  Segments sg{};
  sg.n = segs < 1 ? 1 : (segs > 4 ? 4 : segs);
  for (int i = 0; i < sg.n; ++i) sg.end[i] = seg_end[i];
  if (bf16) {
    ExpandFor<bf16_t>(t, splits, r_total, B, rank, slot, y, y_f32, ldy, rows, d_total, sg, stream);
  } else {
    ExpandFor<float>(t, splits, r_total, B, rank, slot, y, y_f32, ldy, rows, d_total, sg, stream);
  }
}

}  // namespace loom::engine::cuda
