// DecodeAttention and ChunkAttention (attention.h).
#include "engine/sample/cuda/attention.h"

#include <cmath>
#include <type_traits>

#include "engine/sample/chunk_tiles.h"
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
  if (ctx_len[s] <= 0) return;  // a row ChunkAttention serves
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
__global__ void __launch_bounds__(32 * kTokWarps, 4)
    DecodeAttentionTokensKernel(const bf16_t* q, const bf16_t* k_pool, const bf16_t* v_pool, const int32_t* table,
                                int64_t table_stride, const int32_t* ctx_len, int block_size, bf16_t* out, int heads,
                                int kv_heads, float scale) {
  constexpr int hd = kTokLanes * kTokDims;
  constexpr int kParts = 2 * kTokWarps;
  __shared__ float part_m[kParts][G], part_l[kParts][G], part_acc[kParts][G][hd];
  const int64_t s = blockIdx.x;
  if (ctx_len[s] <= 0) return;  // a row ChunkAttention serves
  const int h0 = blockIdx.y * G, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int half = lane >> 4, j = lane & (kTokLanes - 1);
  const int kvh = h0 / (heads / kv_heads);  // G divides heads / kv_heads: the block's heads share it
  // q as loaded (bf16: half the registers of fp32), the scale on each dot
  // product: with __launch_bounds__' four blocks an SM, G = 4 fits 128
  // registers a thread (151 and three blocks an SM before).
  uint4 qr[G];
  float acc[G][kTokDims], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    qr[g] = *reinterpret_cast<const uint4*>(q + (s * heads + h0 + g) * hd + j * kTokDims);
#pragma unroll
    for (int e = 0; e < kTokDims; ++e) acc[g][e] = 0.0f;
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
        float qf[kTokDims];
        Unpack8(qr[g], qf);
        float a = 0.0f;
#pragma unroll
        for (int e = 0; e < kTokDims; ++e) a += qf[e] * kf[e];
        d[g][b] = a * scale;
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

// ---- ChunkAttention (bf16, tensor cores) ----

constexpr int kChunkWarps = 4;    // warps per block: each its own (tile, K/V head, split)
constexpr int kChunkTokens = 16;  // context tokens per warp step
static_assert(kChunkTokens == kChunkSplitAlign, "a split is whole warp steps");
constexpr int kChunkPad = 8;      // bf16 padding of each staged row: lanes' 32-bit reads on distinct banks

// One warp: queries m = i * G + j (tile row i, head j of the K/V head), 16
// of them; lane (g, tq) owns queries g and g + 8. Scores S = Q K^T over 16
// tokens are two 16x8 mma tiles (k over head_dim); P = softmax weights in
// bf16 become the A operand of O += P V as they lie in the S registers (the
// accumulator layout of two n-tiles is the operand layout of one k16
// chunk), V staged transposed so that each B register is one 32-bit read.
template <int HD>
__global__ void __launch_bounds__(32 * kChunkWarps)
    ChunkAttentionKernel(const bf16_t* q, const bf16_t* k_pool, const bf16_t* v_pool, const int32_t* table,
                         int64_t table_stride, const int32_t* ctx_len, const int32_t* plan, int max_tiles,
                         int block_size, bf16_t* out, float* scratch, int heads, int kv_heads, float scale_log2) {
  constexpr int KS = HD / 16;  // k chunks of Q K^T
  constexpr int NT = HD / 8;   // n-tiles of P V
  constexpr int kParts = HD / 8;  // 16-byte parts of a K/V row
  __shared__ __align__(16) bf16_t k_s[kChunkWarps][kChunkTokens][HD + kChunkPad];
  __shared__ __align__(16) bf16_t v_s[kChunkWarps][HD][kChunkTokens + kChunkPad];
  const int tiles = plan[0], splits = plan[1], split_len = plan[2];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int item = blockIdx.x * kChunkWarps + warp;
  if (item >= tiles * kv_heads * splits) return;  // whole warps: no block-wide barrier below
  const int split = item % splits, kvh = (item / splits) % kv_heads, tile = item / splits / kv_heads;
  const int G = heads / kv_heads;
  const int first = plan[3 + tile], n = plan[3 + max_tiles + tile];
  const int g = lane >> 2, tq = lane & 3;
  int row[2], head[2], ctx[2];
  bool live[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = g + 8 * h, i = m / G;
    live[h] = i < n;
    row[h] = first + (live[h] ? i : 0);
    head[h] = kvh * G + m % G;
    ctx[h] = live[h] ? ctx_len[row[h]] : 0;
  }
  const int last = ctx_len[first + n - 1];
  const int lo = split * split_len, hi = min(last, lo + split_len);
  const int32_t* tab = table + static_cast<int64_t>(first) * table_stride;

  uint32_t qa[KS][4];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int h = r & 1, col = 16 * kk + 2 * tq + (r >= 2 ? 8 : 0);
      qa[kk][r] = live[h] ? *reinterpret_cast<const uint32_t*>(
                                q + (static_cast<int64_t>(row[h]) * heads + head[h]) * HD + col)
                          : 0u;
    }
  float o[NT][4], m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] = 0.0f;

  for (int t0 = lo; t0 < hi; t0 += kChunkTokens) {
    __syncwarp();  // the previous step's reads of the staged rows are done
    for (int c = lane; c < kChunkTokens * kParts; c += 32) {
      const int tok = c / kParts, part = c % kParts, t = t0 + tok;
      uint4 kr = make_uint4(0, 0, 0, 0), vr = kr;
      if (t < hi) {
        const int64_t prow = static_cast<int64_t>(tab[t / block_size]) * block_size + t % block_size;
        const int64_t off = (prow * kv_heads + kvh) * HD + part * 8;
        kr = __ldg(reinterpret_cast<const uint4*>(k_pool + off));
        vr = __ldg(reinterpret_cast<const uint4*>(v_pool + off));
      }
      *reinterpret_cast<uint4*>(&k_s[warp][tok][part * 8]) = kr;
      const bf16_t* ve = reinterpret_cast<const bf16_t*>(&vr);
#pragma unroll
      for (int e = 0; e < 8; ++e) v_s[warp][part * 8 + e][tok] = ve[e];
    }
    __syncwarp();
    float s[2][4];  // [n-tile: tokens 8j..8j+7][accumulator]
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
      const bf16_t* krow = &k_s[warp][8 * j + g][0];
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(krow + 16 * kk + 2 * tq);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(krow + 16 * kk + 8 + 2 * tq);
        Mma(s[j], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
      }
    }
    // Mask, scale (log2 domain), and the online softmax of queries g, g + 8.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const int t = t0 + 8 * j + 2 * tq + (e & 1);
          s[j][e] = t < hi && t < ctx[h] ? s[j][e] * scale_log2 : -INFINITY;
          mx = fmaxf(mx, s[j][e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[h], mx);
      const bool none = m_new == -INFINITY;  // no token of this query yet
      const float corr = none ? 1.0f : exp2f(m_run[h] - m_new);
      m_run[h] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[j][e] = none ? 0.0f : exp2f(s[j][e] - m_new);
          sum += s[j][e];
        }
      l_run[h] = l_run[h] * corr + sum;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        o[nt][2 * h] *= corr;
        o[nt][2 * h + 1] *= corr;
      }
    }
    const uint32_t pa0 = PackBf16(s[0][0], s[0][1]), pa1 = PackBf16(s[0][2], s[0][3]);
    const uint32_t pa2 = PackBf16(s[1][0], s[1][1]), pa3 = PackBf16(s[1][2], s[1][3]);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const bf16_t* vrow = &v_s[warp][8 * nt + g][0];
      const uint32_t b0 = *reinterpret_cast<const uint32_t*>(vrow + 2 * tq);
      const uint32_t b1 = *reinterpret_cast<const uint32_t*>(vrow + 8 + 2 * tq);
      Mma(o[nt], pa0, pa1, pa2, pa3, b0, b1);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  if (splits == 1) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!live[h]) continue;
      const float inv = 1.0f / l_run[h];
      bf16_t* dst = out + (static_cast<int64_t>(row[h]) * heads + head[h]) * HD + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        *reinterpret_cast<uint32_t*>(dst + 8 * nt) = PackBf16(o[nt][2 * h] * inv, o[nt][2 * h + 1] * inv);
    }
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float* dst = scratch + (static_cast<int64_t>(item) * kChunkQueries + g + 8 * h) * (HD + 2);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      dst[8 * nt + 2 * tq] = o[nt][2 * h];
      dst[8 * nt + 2 * tq + 1] = o[nt][2 * h + 1];
    }
    if (tq == 0) {
      dst[HD] = m_run[h];
      dst[HD + 1] = l_run[h];
    }
  }
}

// Block r: row r's heads, its splits merged (rows outside every tile, and
// plans of one split, have nothing to merge).
template <int HD>
__global__ void ChunkMergeKernel(const int32_t* plan, int max_tiles, const int32_t* row_tile, const float* scratch,
                                 bf16_t* out, int heads, int kv_heads) {
  const int splits = plan[1];
  const int r = blockIdx.x, tile = row_tile[r];
  if (splits <= 1 || tile < 0) return;
  const int G = heads / kv_heads, i = r - plan[3 + tile];
  for (int e = threadIdx.x; e < heads * HD; e += blockDim.x) {
    const int h = e / HD, d = e % HD, kvh = h / G, m = i * G + h % G;
    const auto part = [&](int s) {
      return scratch + ((((static_cast<int64_t>(tile) * kv_heads + kvh) * splits + s) * kChunkQueries) + m) * (HD + 2);
    };
    float M = -INFINITY;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, part(s)[HD]);
    float L = 0.0f, acc = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float* p = part(s);
      if (p[HD] == -INFINITY) continue;  // a split past this row's context
      const float f = exp2f(p[HD] - M);
      L += p[HD + 1] * f;
      acc += p[d] * f;
    }
    out[(static_cast<int64_t>(r) * heads + h) * HD + d] = FromF<bf16_t>(acc / L);
  }
}

template <int HD>
void LaunchChunk(const void* q, const void* k_pool, const void* v_pool, const int32_t* table, int64_t table_stride,
                 const int32_t* ctx_len, const int32_t* plan, int64_t max_tiles, const int32_t* row_tile,
                 int64_t block_size, void* out, float* scratch, int64_t rows, int64_t heads, int64_t kv_heads,
                 cudaStream_t stream) {
  const float scale_log2 = 1.4426950408889634f / sqrtf(static_cast<float>(HD));
  ChunkAttentionKernel<HD><<<Blocks(kChunkMaxWarps, kChunkWarps), 32 * kChunkWarps, 0, stream>>>(
      static_cast<const bf16_t*>(q), static_cast<const bf16_t*>(k_pool), static_cast<const bf16_t*>(v_pool), table,
      table_stride, ctx_len, plan, static_cast<int>(max_tiles), static_cast<int>(block_size),
      static_cast<bf16_t*>(out), scratch, static_cast<int>(heads), static_cast<int>(kv_heads), scale_log2);
  ChunkMergeKernel<HD><<<static_cast<unsigned>(rows), 128, 0, stream>>>(
      plan, static_cast<int>(max_tiles), row_tile, scratch, static_cast<bf16_t*>(out), static_cast<int>(heads),
      static_cast<int>(kv_heads));
}

}  // namespace

bool ChunkAttentionApplies(bool bf16, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  if (!bf16 || kv_heads <= 0 || heads % kv_heads != 0 || kChunkQueries % (heads / kv_heads) != 0) return false;
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
}

int64_t ChunkTileRows(int64_t heads, int64_t kv_heads) { return kChunkQueries / (heads / kv_heads); }

int64_t ChunkScratchFloats(int64_t head_dim) { return kChunkMaxWarps * kChunkQueries * (head_dim + 2); }

void ChunkAttention(const void* q, const void* k_pool, const void* v_pool, const int32_t* block_table,
                    int64_t table_stride, const int32_t* ctx_len, const int32_t* plan, int64_t max_tiles,
                    const int32_t* row_tile, int64_t block_size, void* out, float* scratch, int64_t rows,
                    int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  if (rows <= 0) return;
  switch (head_dim) {
    case 32:
      return LaunchChunk<32>(q, k_pool, v_pool, block_table, table_stride, ctx_len, plan, max_tiles, row_tile,
                             block_size, out, scratch, rows, heads, kv_heads, stream);
    case 64:
      return LaunchChunk<64>(q, k_pool, v_pool, block_table, table_stride, ctx_len, plan, max_tiles, row_tile,
                             block_size, out, scratch, rows, heads, kv_heads, stream);
    case 128:
      return LaunchChunk<128>(q, k_pool, v_pool, block_table, table_stride, ctx_len, plan, max_tiles, row_tile,
                              block_size, out, scratch, rows, heads, kv_heads, stream);
    default: return;
  }
}

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
