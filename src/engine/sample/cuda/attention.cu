// DecodeAttention (attention.h).
#include "engine/sample/cuda/attention.h"

#include <cmath>
#include <type_traits>

#include "engine/sample/cuda/device.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

constexpr int kAttnWarps = 8;
constexpr int kAttnBatch = 4;

// Grid (rows, heads / G), kAttnWarps warps. A block serves G query heads of
// one grouped-query K/V head, so each K/V row it loads serves G dot products
// (a prefill step on the decode graphs has many rows over long contexts:
// there the kernel is bound by K/V loads). Each warp walks every
// kAttnWarps-th context token with an online softmax per head; the warps are
// merged at the end. Lane l holds elements [l * E, l * E + E) of a head
// (hd = 32 * E).
template <typename T, int E, int G>
__global__ void DecodeAttentionKernel(const T* q, const T* k_pool, const T* v_pool, const int32_t* table,
                                      int64_t table_stride, const int32_t* ctx_len, int block_size, T* out,
                                      int heads, int kv_heads, float scale) {
  constexpr int hd = 32 * E;
  __shared__ float part_m[kAttnWarps][G], part_l[kAttnWarps][G], part_acc[kAttnWarps][G][hd];
  const int64_t s = blockIdx.x;
  const int h0 = blockIdx.y * G, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kvh = h0 / (heads / kv_heads);  // G divides heads / kv_heads: the block's heads share it
  float qv[G][E], acc[G][E], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qv[g][e] = ToF(q[(s * heads + h0 + g) * hd + lane * E + e]);
      acc[g][e] = 0.0f;
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  const int n = ctx_len[s];
  // kAttnBatch tokens per warp step, their loads issued together (a decode
  // step is latency-bound: few rows, short contexts).
  for (int t0 = warp * kAttnBatch; t0 < n; t0 += kAttnWarps * kAttnBatch) {
    int64_t off[kAttnBatch];
    float d[G][kAttnBatch];
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      const int t = min(t0 + b, n - 1);  // past the end: a valid row, masked below
      const int64_t row = static_cast<int64_t>(table[s * table_stride + t / block_size]) * block_size + t % block_size;
      off[b] = (row * kv_heads + kvh) * hd + lane * E;
      float kf[E];
#pragma unroll
      for (int e = 0; e < E; ++e) kf[e] = ToF(k_pool[off[b] + e]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        d[g][b] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) d[g][b] += qv[g][e] * kf[e];
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float m_new = m[g];
#pragma unroll
      for (int b = 0; b < kAttnBatch; ++b) {
        d[g][b] = t0 + b < n ? WarpSum(d[g][b]) * scale : -INFINITY;
        m_new = fmaxf(m_new, d[g][b]);
      }
      const float corr = expf(m[g] - m_new);  // t0 < n: token t0 is real, so m_new is finite
      l[g] *= corr;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= corr;
      m[g] = m_new;
    }
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      float vf[E];
#pragma unroll
      for (int e = 0; e < E; ++e) vf[e] = ToF(v_pool[off[b] + e]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = expf(d[g][b] - m[g]);  // 0 for masked tokens
        l[g] += p;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] += p * vf[e];
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      part_m[warp][g] = m[g];
      part_l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) part_acc[warp][g][lane * E + e] = acc[g][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
    const int g = i / hd, j = i % hd;
    float M = -INFINITY;
    for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, part_m[w][g]);
    float L = 0.0f, o = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) {
      if (part_m[w][g] == -INFINITY) continue;  // a warp that saw no token
      const float f = expf(part_m[w][g] - M);
      L += part_l[w][g] * f;
      o += part_acc[w][g][j] * f;
    }
    out[(s * heads + h0 + g) * hd + j] = FromF<T>(o / L);
  }
}

// Blocks a launch wants before it trades them for K/V reuse (G > 1): about
// two per SM of an H100/H200.
constexpr int64_t kAttnMinBlocks = 264;

template <typename T, int E>
void LaunchAttention(const void* q, const void* k_pool, const void* v_pool, const int32_t* table,
                     int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                     int64_t heads, int64_t kv_heads, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(32 * E));
  const int64_t group = heads / kv_heads;
  // The most heads per block (4, 2 or 1, dividing the group) that still
  // leaves kAttnMinBlocks blocks: few rows keep one head per block.
  int G = 1;
  for (int g : {4, 2})
    if (group % g == 0 && rows * (heads / g) >= kAttnMinBlocks) {
      G = g;
      break;
    }
  auto go = [&](auto gc) {
    constexpr int kG = decltype(gc)::value;
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads / kG)), block(32 * kAttnWarps);
    DecodeAttentionKernel<T, E, kG><<<grid, block, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k_pool), static_cast<const T*>(v_pool), table, table_stride,
        ctx_len, static_cast<int>(block_size), static_cast<T*>(out), static_cast<int>(heads),
        static_cast<int>(kv_heads), scale);
  };
  if (G == 4) return go(std::integral_constant<int, 4>{});
  if (G == 2) return go(std::integral_constant<int, 2>{});
  go(std::integral_constant<int, 1>{});
}

}  // namespace

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

}  // namespace loom::engine::cuda
