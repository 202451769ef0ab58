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

// The end of a block: each thread stores its part of the online softmax
// (part `part`: its maximum and sum of weights per head, stored by the
// part's `writer` thread, and the weighted values of dims [dim0, dim0 + D)),
// then the block merges the kParts parts (one that saw no token has maximum
// -inf) into the G heads of its row, out pointing at the first of them.
template <typename T, int kParts, int G, int hd, int D>
__device__ __forceinline__ void FinishParts(int part, bool writer, int dim0, const float (&m)[G], const float (&l)[G],
                                            const float (&acc)[G][D], float (&part_m)[kParts][G],
                                            float (&part_l)[kParts][G], float (&part_acc)[kParts][G][hd], T* out) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (writer) {
      part_m[part][g] = m[g];
      part_l[part][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < D; ++e) part_acc[part][g][dim0 + e] = acc[g][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
    const int g = i / hd, c = i % hd;
    float M = -INFINITY;
    for (int p = 0; p < kParts; ++p) M = fmaxf(M, part_m[p][g]);
    float L = 0.0f, o = 0.0f;
    for (int p = 0; p < kParts; ++p) {
      if (part_m[p][g] == -INFINITY) continue;
      const float f = expf(part_m[p][g] - M);
      L += part_l[p][g] * f;
      o += part_acc[p][g][c] * f;
    }
    out[g * hd + c] = FromF<T>(o / L);
  }
}

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
  FinishParts(warp, lane == 0, lane * E, m, l, acc, part_m, part_l, part_acc, out + (s * heads + h0) * hd);
}

// Blocks a launch wants before it trades them for K/V reuse (G > 1): about
// two per SM of an H100/H200.
constexpr int64_t kAttnMinBlocks = 264;

// The most heads per block (4, 2 or 1, dividing the group) that still
// leaves kAttnMinBlocks blocks: few rows keep one head per block.
int HeadsPerBlock(int64_t rows, int64_t heads, int64_t kv_heads) {
  const int64_t group = heads / kv_heads;
  for (int g : {4, 2})
    if (group % g == 0 && rows * (heads / g) >= kAttnMinBlocks) return g;
  return 1;
}

// go(std::integral_constant<int, G>{}): a kernel's launch with G heads a block.
template <typename Go>
void WithHeadsPerBlock(int G, Go&& go) {
  if (G == 4) return go(std::integral_constant<int, 4>{});
  if (G == 2) return go(std::integral_constant<int, 2>{});
  go(std::integral_constant<int, 1>{});
}

// ---- AttentionForm::kTokens (bf16, head_dim 128) ----

constexpr int kTokWarps = 4;   // warps per block
constexpr int kTokLanes = 16;  // lanes per token: a half warp
constexpr int kTokDims = 8;    // dims per lane: one 16-byte load of bf16
constexpr int kTokSub = 4;     // tokens per half warp and step, K and V loaded together

// 8 bf16 (one 16-byte load) as fp32.
__device__ __forceinline__ void Unpack8(const uint4& u, float (&f)[kTokDims]) {
  const bf16_t* e = reinterpret_cast<const bf16_t*>(&u);
#pragma unroll
  for (int k = 0; k < kTokDims; ++k) f[k] = ToF(e[k]);
}

// Grid (rows, heads / G), kTokWarps warps. A block serves G query heads of
// one grouped-query K/V head. Half warp h of warp w takes the tokens
// t0 + 2b + h (b < kTokSub) of each step, t0 advancing by 2 kTokSub
// kTokWarps; lane j of the half holds dims [8j, 8j + 8) of every head, so
// a token's dot product is a sum over the 16 lanes of its half. Each half
// keeps an online softmax per head; the 2 kTokWarps halves are merged at
// the end.
template <int G>
__global__ void __launch_bounds__(32 * kTokWarps)
    DecodeAttentionTokensKernel(const bf16_t* q, const bf16_t* k_pool, const bf16_t* v_pool, const int32_t* table,
                                int64_t table_stride, const int32_t* ctx_len, int block_size, bf16_t* out, int heads,
                                int kv_heads, float scale) {
  constexpr int hd = kTokLanes * kTokDims;
  constexpr int kParts = 2 * kTokWarps;
  __shared__ float part_m[kParts][G], part_l[kParts][G], part_acc[kParts][G][hd];
  const int64_t s = blockIdx.x;
  const int h0 = blockIdx.y * G, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int half = lane >> 4, j = lane & (kTokLanes - 1);
  const int kvh = h0 / (heads / kv_heads);  // G divides heads / kv_heads: the block's heads share it
  float qv[G][kTokDims], acc[G][kTokDims], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    LoadV<bf16_t, kTokDims>(q + (s * heads + h0 + g) * hd + j * kTokDims, qv[g]);
#pragma unroll
    for (int e = 0; e < kTokDims; ++e) {
      qv[g][e] *= scale;
      acc[g][e] = 0.0f;
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  const int n = ctx_len[s];
  for (int t0 = warp * 2 * kTokSub; t0 < n; t0 += kTokWarps * 2 * kTokSub) {
    uint4 kr[kTokSub], vr[kTokSub];
#pragma unroll
    for (int b = 0; b < kTokSub; ++b) {
      const int t = min(t0 + 2 * b + half, n - 1);  // past the end: a valid row, masked below
      const int64_t row = static_cast<int64_t>(table[s * table_stride + t / block_size]) * block_size + t % block_size;
      const int64_t off = (row * kv_heads + kvh) * hd + j * kTokDims;
      kr[b] = __ldg(reinterpret_cast<const uint4*>(k_pool + off));
      vr[b] = __ldg(reinterpret_cast<const uint4*>(v_pool + off));
    }
    float d[G][kTokSub];
#pragma unroll
    for (int b = 0; b < kTokSub; ++b) {
      float kf[kTokDims];
      Unpack8(kr[b], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float a = 0.0f;
#pragma unroll
        for (int e = 0; e < kTokDims; ++e) a += qv[g][e] * kf[e];
        d[g][b] = a;
      }
    }
#pragma unroll
    for (int o = kTokLanes / 2; o > 0; o >>= 1)
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int b = 0; b < kTokSub; ++b) d[g][b] += __shfl_xor_sync(0xffffffffu, d[g][b], o);
    // The softmax's new maximum per head, then d becomes each token's weight.
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float m_new = m[g];
#pragma unroll
      for (int b = 0; b < kTokSub; ++b) {
        d[g][b] = t0 + 2 * b + half < n ? d[g][b] : -INFINITY;
        m_new = fmaxf(m_new, d[g][b]);
      }
      // A half whose tokens so far are all past the end has no maximum yet.
      const bool none = m_new == -INFINITY;
      const float corr = none ? 1.0f : expf(m[g] - m_new);
      l[g] *= corr;
#pragma unroll
      for (int e = 0; e < kTokDims; ++e) acc[g][e] *= corr;
      m[g] = m_new;
#pragma unroll
      for (int b = 0; b < kTokSub; ++b) d[g][b] = none ? 0.0f : expf(d[g][b] - m_new);  // 0 for masked tokens
    }
#pragma unroll
    for (int b = 0; b < kTokSub; ++b) {
      float vf[kTokDims];
      Unpack8(vr[b], vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        l[g] += d[g][b];
#pragma unroll
        for (int e = 0; e < kTokDims; ++e) acc[g][e] += d[g][b] * vf[e];
      }
    }
  }
  FinishParts(warp * 2 + half, j == 0, j * kTokDims, m, l, acc, part_m, part_l, part_acc,
              out + (s * heads + h0) * hd);
}

void LaunchAttentionTokens(const void* q, const void* k_pool, const void* v_pool, const int32_t* table,
                           int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                           int64_t heads, int64_t kv_heads, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(kTokLanes * kTokDims));
  auto go = [&](auto gc) {
    constexpr int kG = decltype(gc)::value;
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads / kG)), block(32 * kTokWarps);
    DecodeAttentionTokensKernel<kG><<<grid, block, 0, stream>>>(
        static_cast<const bf16_t*>(q), static_cast<const bf16_t*>(k_pool), static_cast<const bf16_t*>(v_pool), table,
        table_stride, ctx_len, static_cast<int>(block_size), static_cast<bf16_t*>(out), static_cast<int>(heads),
        static_cast<int>(kv_heads), scale);
  };
  WithHeadsPerBlock(HeadsPerBlock(rows, heads, kv_heads), go);
}

template <typename T, int E>
void LaunchAttention(const void* q, const void* k_pool, const void* v_pool, const int32_t* table,
                     int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                     int64_t heads, int64_t kv_heads, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(32 * E));
  const int G = HeadsPerBlock(rows, heads, kv_heads);
  auto go = [&](auto gc) {
    constexpr int kG = decltype(gc)::value;
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads / kG)), block(32 * kAttnWarps);
    DecodeAttentionKernel<T, E, kG><<<grid, block, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k_pool), static_cast<const T*>(v_pool), table, table_stride,
        ctx_len, static_cast<int>(block_size), static_cast<T*>(out), static_cast<int>(heads),
        static_cast<int>(kv_heads), scale);
  };
  WithHeadsPerBlock(G, go);
}

}  // namespace

bool TokenLanesApply(bool bf16, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  if (!bf16 || head_dim != kTokLanes * kTokDims || rows <= 0 || kv_heads <= 0 || heads % kv_heads != 0) return false;
  return rows * (heads / HeadsPerBlock(rows, heads, kv_heads)) >= kAttnMinBlocks;
}

void DecodeAttention(bool bf16, const void* q, const void* k_pool, const void* v_pool, const int32_t* block_table,
                     int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream, AttentionForm form) {
  if (rows <= 0) return;
  if (form == AttentionForm::kTokens && TokenLanesApply(bf16, rows, heads, kv_heads, head_dim))
    return LaunchAttentionTokens(q, k_pool, v_pool, block_table, table_stride, ctx_len, block_size, out, rows, heads,
                                 kv_heads, stream);
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
