// RmsNormGrad, SwiGluGrad, QkvNormRope and QkvNormRopeGrad (lean_kernels.h).
#include "engine/model/cuda/lean_kernels.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "engine/sample/cuda/device.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

constexpr int kPer = kMaxNormGradWidth / 1024;  // elements per thread, held in registers

// One block per row.
template <typename T>
__global__ void RmsNormGradKernel(const T* g, const T* x, const T* w, const float* inv, const T* add, T* dx,
                                  int64_t n) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  const float r = inv[blockIdx.x];
  float dn[kPer], nv[kPer];
  float dot = 0.0f;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
    dn[e] = nv[e] = 0.0f;
    if (i >= n) continue;
    dn[e] = Round<T>(ToF(g[base + i]) * ToF(w[i]));
    nv[e] = ToF(x[base + i]) * r;
    dot += dn[e] * nv[e];
  }
  const float mean = BlockSum(dot) / static_cast<float>(n);
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
    if (i >= n) continue;
    const float d = r * (dn[e] - nv[e] * mean);
    dx[base + i] = FromF<T>(add ? Round<T>(d) + ToF(add[base + i]) : d);
  }
}


// The same with 8 consecutive elements per thread (16-byte loads for bf16)
// and at most 2 such chunks a thread, for rows of a multiple of 8.
constexpr int kGradVec = 8, kGradChunks = 2;

template <typename T>
__global__ void RmsNormGradVecKernel(const T* g, const T* x, const T* w, const float* inv, const T* add, T* dx,
                                     int64_t n) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  const float r = inv[blockIdx.x];
  float dn[kGradChunks][kGradVec], nv[kGradChunks][kGradVec];
  float dot = 0.0f;
#pragma unroll
  for (int c = 0; c < kGradChunks; ++c) {
    const int64_t i = (threadIdx.x + static_cast<int64_t>(c) * blockDim.x) * kGradVec;
    if (i >= n) continue;
    float gv[kGradVec], wv[kGradVec];
    LoadV<T, kGradVec>(g + base + i, gv);
    LoadV<T, kGradVec>(w + i, wv);
    LoadV<T, kGradVec>(x + base + i, nv[c]);
#pragma unroll
    for (int k = 0; k < kGradVec; ++k) {
      dn[c][k] = Round<T>(gv[k] * wv[k]);
      nv[c][k] *= r;
      dot += dn[c][k] * nv[c][k];
    }
  }
  const float mean = BlockSum(dot) / static_cast<float>(n);
#pragma unroll
  for (int c = 0; c < kGradChunks; ++c) {
    const int64_t i = (threadIdx.x + static_cast<int64_t>(c) * blockDim.x) * kGradVec;
    if (i >= n) continue;
    float av[kGradVec];
    if (add) LoadV<T, kGradVec>(add + base + i, av);
#pragma unroll
    for (int k = 0; k < kGradVec; ++k) {
      const float d = r * (dn[c][k] - nv[c][k] * mean);
      dn[c][k] = add ? Round<T>(d) + av[k] : d;
    }
    StoreV<T, kGradVec>(dx + base + i, dn[c]);
  }
}

template <typename T>
void LaunchRmsNormGrad(const void* g, const void* x, const void* w, const float* inv, const void* add, void* dx,
                       int64_t rows, int64_t n, cudaStream_t stream) {
  const int64_t chunks = n / kGradVec;
  if (n % kGradVec == 0 && chunks <= 1024 * kGradChunks && Aligned16(g) && Aligned16(x) && Aligned16(w) &&
      Aligned16(dx) && (!add || Aligned16(add))) {
    const int64_t threads = std::min<int64_t>(1024, (chunks + 31) / 32 * 32);
    RmsNormGradVecKernel<T><<<static_cast<unsigned>(rows), static_cast<unsigned>(threads), 0, stream>>>(
        static_cast<const T*>(g), static_cast<const T*>(x), static_cast<const T*>(w), inv, static_cast<const T*>(add),
        static_cast<T*>(dx), n);
    return;
  }
  const int64_t threads = std::min<int64_t>(1024, std::max<int64_t>(32, (n / 4 + 31) / 32 * 32));
  RmsNormGradKernel<T><<<static_cast<unsigned>(rows), static_cast<unsigned>(threads), 0, stream>>>(
      static_cast<const T*>(g), static_cast<const T*>(x), static_cast<const T*>(w), inv, static_cast<const T*>(add),
      static_cast<T*>(dx), n);
}

template <typename T>
__global__ void SwiGluGradKernel(const T* gate_up, const T* dy, T* out, int64_t rows, int64_t inter) {
  const int64_t total = rows * inter;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = k / inter, col = k % inter, at = row * 2 * inter + col;
    const float g = ToF(gate_up[at]), u = ToF(gate_up[at + inter]), d = ToF(dy[k]);
    const float s = 1.0f / (1.0f + expf(-g));
    out[at] = FromF<T>(d * u * s * (1.0f + g * (1.0f - s)));
    out[at + inter] = FromF<T>(d * (g * s));
  }
}

// The same, 8 consecutive columns a thread, for inter a multiple of 8 and aligned buffers.
constexpr int kSwiVec = 8;

template <typename T>
__global__ void SwiGluGradVecKernel(const T* gate_up, const T* dy, T* out, int64_t rows, int64_t inter) {
  const int64_t per_row = inter / kSwiVec, total = rows * per_row;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = k / per_row, col = (k % per_row) * kSwiVec, at = row * 2 * inter + col;
    float g[kSwiVec], u[kSwiVec], d[kSwiVec];
    LoadV<T, kSwiVec>(gate_up + at, g);
    LoadV<T, kSwiVec>(gate_up + at + inter, u);
    LoadV<T, kSwiVec>(dy + row * inter + col, d);
    float dg[kSwiVec], du[kSwiVec];
#pragma unroll
    for (int e = 0; e < kSwiVec; ++e) {
      const float s = 1.0f / (1.0f + expf(-g[e]));
      dg[e] = d[e] * u[e] * s * (1.0f + g[e] * (1.0f - s));
      du[e] = d[e] * (g[e] * s);
    }
    StoreV<T, kSwiVec>(out + at, dg);
    StoreV<T, kSwiVec>(out + at + inter, du);
  }
}

template <typename T>
void LaunchSwiGluGrad(const void* gate_up, const void* dy, void* out, int64_t rows, int64_t inter,
                      cudaStream_t stream) {
  if (inter % kSwiVec == 0 && Aligned16(gate_up) && Aligned16(dy) && Aligned16(out)) {
    const int64_t chunks = rows * inter / kSwiVec;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((chunks + 255) / 256, 65535));
    SwiGluGradVecKernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T*>(gate_up), static_cast<const T*>(dy),
                                                        static_cast<T*>(out), rows, inter);
    return;
  }
  const int64_t total = rows * inter;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 65535));
  SwiGluGradKernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T*>(gate_up), static_cast<const T*>(dy),
                                                   static_cast<T*>(out), rows, inter);
}


// The q/k/v tail of a decoder layer over its fused projection (QkvNormRope):
// a warp per (token, head) at a time, V = hd / 32 consecutive elements per
// lane, so that lane l's RoPE partners (i +- hd/2) sit in lane l ^ 16, same
// slot.
constexpr int kHeadWarps = 8;  // warps per block

// A lane's V consecutive elements of a head as one access of V * sizeof(T)
// bytes (4 or 8; 16 and 32 through LoadV and StoreV) where kWide, the
// launcher having checked every buffer's alignment to it; else one by one.
template <int Bytes>
struct LaneWord;
template <>
struct LaneWord<4> {
  using type = uint32_t;
};
template <>
struct LaneWord<8> {
  using type = uint2;
};
// V elements of T seen as one LaneWord (V * sizeof(T) of 4 or 8 bytes).
template <typename T, int V>
union LaneBits {
  using Word = typename LaneWord<V * static_cast<int>(sizeof(T))>::type;
  Word w;
  T e[V];
};

template <typename T, int V, bool kWide>
__device__ __forceinline__ void LaneLoad(const T* p, float* out) {
  constexpr int kBytes = V * static_cast<int>(sizeof(T));
  if constexpr (kWide && kBytes % 16 == 0) {
    LoadV<T, V>(p, out);
  } else if constexpr (kWide) {
    LaneBits<T, V> u;
    u.w = *reinterpret_cast<const typename LaneBits<T, V>::Word*>(p);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = ToF(u.e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = ToF(p[k]);
  }
}

template <typename T, int V, bool kWide>
__device__ __forceinline__ void LaneStore(T* p, const float* v) {
  constexpr int kBytes = V * static_cast<int>(sizeof(T));
  if constexpr (kWide && kBytes % 16 == 0) {
    StoreV<T, V>(p, v);
  } else if constexpr (kWide) {
    LaneBits<T, V> u;
#pragma unroll
    for (int k = 0; k < V; ++k) u.e[k] = FromF<T>(v[k]);
    *reinterpret_cast<typename LaneBits<T, V>::Word*>(p) = u.w;
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = FromF<T>(v[k]);
  }
}

// Whether every non-null buffer is aligned to a lane's V * sizeof(T) bytes
// (at most 16: wider vectors are pairs of 16-byte ones).
template <typename T, int V>
bool LanesAligned(std::initializer_list<const void*> ps) {
  const uintptr_t a = std::min<uintptr_t>(16, V * sizeof(T));
  for (const void* p : ps)
    if (p && (reinterpret_cast<uintptr_t>(p) % a) != 0) return false;
  return true;
}

// The forward: one block per token, its warps taking the token's heads
// kPairHeads at a time (both heads' loads in flight before either is used),
// with the token's cos and sin loaded once per warp (3.6 against 4.0 ms a
// 4 x 2048 step on the H200, against a warp per (token, head)).
constexpr int kPairHeads = 2;

template <typename T, int V, bool kWide>
__global__ void QkvNormRopeKernel(const T* qkv, const T* delta, const T* q_norm, const T* k_norm, const T* cos,
                                  const T* sin, T* sum_out, float* inv_out, T* q_out, T* k_out, T* v_out, int64_t rows,
                                  int heads, int kv_heads, float eps) {
  constexpr int hd = 32 * V;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, all = heads + 2 * kv_heads, at0 = lane * V;
  const int64_t s = blockIdx.x;
  float c[V], sn[V];
  LaneLoad<T, V, kWide>(cos + s * hd + at0, c);
  LaneLoad<T, V, kWide>(sin + s * hd + at0, sn);
  for (int h0 = warp * kPairHeads; h0 < all; h0 += kHeadWarps * kPairHeads) {
    float v[kPairHeads][V];
#pragma unroll
    for (int p = 0; p < kPairHeads; ++p) {
      const int h = h0 + p;
      if (h >= all) break;
      const int64_t at = (s * all + h) * hd + at0;
      LaneLoad<T, V, kWide>(qkv + at, v[p]);
      if (delta) {
        float d[V];
        LaneLoad<T, V, kWide>(delta + at, d);
#pragma unroll
        for (int k = 0; k < V; ++k) v[p][k] = AddDelta<T>(v[p][k], d[k]);
      }
    }
#pragma unroll
    for (int p = 0; p < kPairHeads; ++p) {
      const int h = h0 + p;  // warp-uniform
      if (h >= all) break;
      const int64_t at = (s * all + h) * hd + at0;
      if (h >= heads + kv_heads) {  // a value head
        LaneStore<T, V, kWide>(v_out + (s * kv_heads + (h - heads - kv_heads)) * hd + at0, v[p]);
        continue;
      }
      const bool is_q = h < heads;
      const T* norm_w = is_q ? q_norm : k_norm;
      if (norm_w) {
        if (sum_out) LaneStore<T, V, kWide>(sum_out + at, v[p]);
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < V; ++k) ss += v[p][k] * v[p][k];
        const float inv = rsqrtf(WarpSum(ss) / static_cast<float>(hd) + eps);
        if (lane == 0 && inv_out) inv_out[s * (heads + kv_heads) + h] = inv;
        float w[V];
        LaneLoad<T, V, kWide>(norm_w + at0, w);
#pragma unroll
        for (int k = 0; k < V; ++k) v[p][k] = Round<T>(w[k] * Round<T>(v[p][k] * inv));
      }
      float out[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float partner = __shfl_xor_sync(0xffffffffu, v[p][k], 16);
        const float rot = lane < 16 ? -partner : partner;
        out[k] = Round<T>(v[p][k] * c[k]) + Round<T>(rot * sn[k]);
      }
      LaneStore<T, V, kWide>(is_q ? q_out + (s * heads + h) * hd + at0 : k_out + (s * kv_heads + (h - heads)) * hd + at0,
                             out);
    }
  }
}

// Its backward: RoPE's transpose, then the head's RMSNorm backward, one warp
// per (token, head) (the forward's block per token measured slower here:
// 6.1 against 4.5 ms a 4 x 2048 step on the H200).
template <typename T, int V, bool kWide>
__global__ void QkvNormRopeGradKernel(const T* sum, const T* q_norm, const T* k_norm, const float* inv,
                                      const T* cos, const T* sin, const T* dq, const T* dk, const T* dv, T* d_qkv,
                                      int64_t rows, int heads, int kv_heads) {
  constexpr int hd = 32 * V;
  const int lane = threadIdx.x & 31, all = heads + 2 * kv_heads;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kHeadWarps + (threadIdx.x >> 5);
  if (pair >= rows * all) return;
  const int64_t s = pair / all;
  const int h = static_cast<int>(pair % all), at0 = lane * V;
  const int64_t at = pair * hd + at0;
  float d[V];
  if (h >= heads + kv_heads) {
    if (dv) {
      LaneLoad<T, V, kWide>(dv + (s * kv_heads + (h - heads - kv_heads)) * hd + at0, d);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) d[k] = 0.0f;
    }
    LaneStore<T, V, kWide>(d_qkv + at, d);
    return;
  }
  const bool is_q = h < heads;
  const T* g_in = is_q ? dq : dk;
  float g[V], c[V], sn[V];
  if (g_in) {
    LaneLoad<T, V, kWide>(g_in + (is_q ? (s * heads + h) * hd : (s * kv_heads + (h - heads)) * hd) + at0, g);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] = 0.0f;
  }
  LaneLoad<T, V, kWide>(cos + s * hd + at0, c);
  LaneLoad<T, V, kWide>(sin + s * hd + at0, sn);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const float gs = Round<T>(g[k] * sn[k]);
    const float partner = __shfl_xor_sync(0xffffffffu, gs, 16);
    d[k] = Round<T>(Round<T>(g[k] * c[k]) + (lane < 16 ? partner : -partner));
  }
  const T* norm_w = is_q ? q_norm : k_norm;
  if (norm_w) {
    const float r = inv[s * (heads + kv_heads) + h];
    float w[V], x[V], dn[V], n[V], dot = 0.0f;
    LaneLoad<T, V, kWide>(norm_w + at0, w);
    LaneLoad<T, V, kWide>(sum + at, x);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      dn[k] = Round<T>(d[k] * w[k]);
      n[k] = x[k] * r;
      dot += dn[k] * n[k];
    }
    const float mean = WarpSum(dot) / static_cast<float>(hd);
#pragma unroll
    for (int k = 0; k < V; ++k) d[k] = r * (dn[k] - n[k] * mean);
  }
  LaneStore<T, V, kWide>(d_qkv + at, d);
}

// The head widths the warp kernels take: 64, 128, 256 (V = 2, 4, 8).
template <typename T, template <typename, int> class Launch, typename... Args>
void ByHeadDim(int64_t hd, Args... args) {
  switch (hd) {
    case 64: Launch<T, 2>::Run(args...); break;
    case 128: Launch<T, 4>::Run(args...); break;
    case 256: Launch<T, 8>::Run(args...); break;
    default: break;
  }
}

unsigned HeadBlocks(int64_t rows, int64_t heads, int64_t kv_heads) {
  return Blocks(rows * (heads + 2 * kv_heads), kHeadWarps);
}

template <typename T, int V>
struct QkvNormRopeLaunch {
  static void Run(const void* qkv, const void* delta, const void* q_norm, const void* k_norm, const void* cos,
                  const void* sin, void* sum_out, float* inv_out, void* q, void* k, void* v, int64_t rows,
                  int64_t heads, int64_t kv_heads, float eps, cudaStream_t stream) {
    auto kernel = LanesAligned<T, V>({qkv, delta, q_norm, k_norm, cos, sin, sum_out, q, k, v})
                      ? QkvNormRopeKernel<T, V, true>
                      : QkvNormRopeKernel<T, V, false>;
    kernel<<<static_cast<unsigned>(rows), 32 * kHeadWarps, 0, stream>>>(  // a block per token
        static_cast<const T*>(qkv), static_cast<const T*>(delta), static_cast<const T*>(q_norm),
        static_cast<const T*>(k_norm), static_cast<const T*>(cos), static_cast<const T*>(sin),
        static_cast<T*>(sum_out), inv_out, static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v), rows,
        static_cast<int>(heads), static_cast<int>(kv_heads), eps);
  }
};

template <typename T, int V>
struct QkvNormRopeGradLaunch {
  static void Run(const void* sum, const void* q_norm, const void* k_norm, const float* inv, const void* cos,
                  const void* sin, const void* dq, const void* dk, const void* dv, void* d_qkv, int64_t rows,
                  int64_t heads, int64_t kv_heads, cudaStream_t stream) {
    auto kernel = LanesAligned<T, V>({sum, q_norm, k_norm, cos, sin, dq, dk, dv, d_qkv})
                      ? QkvNormRopeGradKernel<T, V, true>
                      : QkvNormRopeGradKernel<T, V, false>;
    kernel<<<HeadBlocks(rows, heads, kv_heads), 32 * kHeadWarps, 0, stream>>>(
        static_cast<const T*>(sum), static_cast<const T*>(q_norm), static_cast<const T*>(k_norm), inv,
        static_cast<const T*>(cos), static_cast<const T*>(sin), static_cast<const T*>(dq), static_cast<const T*>(dk),
        static_cast<const T*>(dv), static_cast<T*>(d_qkv), rows, static_cast<int>(heads), static_cast<int>(kv_heads));
  }
};

template <typename T>
void LaunchQkvNormRope(int64_t hd, const void* qkv, const void* delta, const void* q_norm, const void* k_norm,
                       const void* cos, const void* sin, void* sum_out, float* inv_out, void* q, void* k, void* v,
                       int64_t rows, int64_t heads, int64_t kv_heads, float eps, cudaStream_t stream) {
  ByHeadDim<T, QkvNormRopeLaunch>(hd, qkv, delta, q_norm, k_norm, cos, sin, sum_out, inv_out, q, k, v, rows, heads,
                                  kv_heads, eps, stream);
}

template <typename T>
void LaunchQkvNormRopeGrad(int64_t hd, const void* sum, const void* q_norm, const void* k_norm, const float* inv,
                           const void* cos, const void* sin, const void* dq, const void* dk, const void* dv,
                           void* d_qkv, int64_t rows, int64_t heads, int64_t kv_heads, cudaStream_t stream) {
  ByHeadDim<T, QkvNormRopeGradLaunch>(hd, sum, q_norm, k_norm, inv, cos, sin, dq, dk, dv, d_qkv, rows, heads,
                                      kv_heads, stream);
}

}  // namespace

void RmsNormGrad(bool bf16, const void* g, const void* x, const void* w, const float* inv, void* dx, int64_t rows,
                 int64_t width, cudaStream_t stream, const void* add) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchRmsNormGrad, g, x, w, inv, add, dx, rows, width, stream);
}

void SwiGluGrad(bool bf16, const void* gate_up, const void* dy, void* d_gate_up, int64_t rows, int64_t inter,
                cudaStream_t stream) {
  if (rows <= 0 || inter <= 0) return;
  LOOM_DISPATCH(bf16, LaunchSwiGluGrad, gate_up, dy, d_gate_up, rows, inter, stream);
}

void QkvNormRope(bool bf16, const void* qkv, const void* delta, const void* q_norm, const void* k_norm,
                 const void* cos, const void* sin, void* sum_out, float* inv_out, void* q, void* k, void* v,
                 int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps, cudaStream_t stream) {
  if (rows <= 0 || !QkvHeadDimSupported(head_dim)) return;
  LOOM_DISPATCH(bf16, LaunchQkvNormRope, head_dim, qkv, delta, q_norm, k_norm, cos, sin, sum_out, inv_out, q, k, v,
                rows, heads, kv_heads, eps, stream);
}

void QkvNormRopeGrad(bool bf16, const void* sum, const void* q_norm, const void* k_norm, const float* inv,
                     const void* cos, const void* sin, const void* dq, const void* dk, const void* dv, void* d_qkv,
                     int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  if (rows <= 0 || !QkvHeadDimSupported(head_dim)) return;
  LOOM_DISPATCH(bf16, LaunchQkvNormRopeGrad, head_dim, sum, q_norm, k_norm, inv, cos, sin, dq, dk, dv, d_qkv, rows,
                heads, kv_heads, stream);
}

}  // namespace loom::engine::cuda
