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
