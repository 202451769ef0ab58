// RmsNormGrad, SwiGluGrad, QkvNormRope and QkvNormRopeGrad (lean_kernels.h).
#include "engine/model/cuda/lean_kernels.h"

#include <algorithm>

#include "engine/sample/cuda/device.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

constexpr int kPer = kMaxNormGradWidth / 1024;  // elements per thread, held in registers

// One block per row.
template <typename T>
__global__ void RmsNormGradKernel(const T* g, const T* x, const T* w, const float* inv, T* dx, int64_t n) {
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
    if (i < n) dx[base + i] = FromF<T>(r * (dn[e] - nv[e] * mean));
  }
}

template <typename T>
void LaunchRmsNormGrad(const void* g, const void* x, const void* w, const float* inv, void* dx, int64_t rows,
                       int64_t n, cudaStream_t stream) {
  const int64_t threads = std::min<int64_t>(1024, std::max<int64_t>(32, (n / 4 + 31) / 32 * 32));
  RmsNormGradKernel<T><<<static_cast<unsigned>(rows), static_cast<unsigned>(threads), 0, stream>>>(
      static_cast<const T*>(g), static_cast<const T*>(x), static_cast<const T*>(w), inv, static_cast<T*>(dx), n);
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

template <typename T>
void LaunchSwiGluGrad(const void* gate_up, const void* dy, void* out, int64_t rows, int64_t inter,
                      cudaStream_t stream) {
  const int64_t total = rows * inter;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 65535));
  SwiGluGradKernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T*>(gate_up), static_cast<const T*>(dy),
                                                   static_cast<T*>(out), rows, inter);
}


// The q/k/v tail of a decoder layer over its fused projection (QkvNormRope).
// Grid (rows, H + 2 KVH heads), hd threads.
template <typename T>
__global__ void QkvNormRopeKernel(const T* qkv, const T* delta, const T* q_norm, const T* k_norm, const T* cos,
                                  const T* sin, T* sum_out, float* inv_out, T* q_out, T* k_out, T* v_out, int heads,
                                  int kv_heads, int hd, float eps) {
  extern __shared__ float head[];  // hd
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y, i = threadIdx.x, all = heads + 2 * kv_heads;
  const int64_t at = (s * all + h) * hd + i;
  float v = ToF(qkv[at]);
  if (delta) v = AddDelta<T>(v, ToF(delta[at]));
  if (h >= heads + kv_heads) {  // a value head
    v_out[(s * kv_heads + (h - heads - kv_heads)) * hd + i] = FromF<T>(v);
    return;
  }
  const bool is_q = h < heads;
  const T* norm_w = is_q ? q_norm : k_norm;
  if (norm_w) {
    if (sum_out) sum_out[at] = FromF<T>(v);
    const float inv = rsqrtf(BlockSum(v * v) / static_cast<float>(hd) + eps);
    if (i == 0 && inv_out) inv_out[s * (heads + kv_heads) + h] = inv;
    v = Round<T>(ToF(norm_w[i]) * Round<T>(v * inv));
  }
  head[i] = v;
  __syncthreads();
  const int half = hd / 2;
  const float rot = i < half ? -head[i + half] : head[i - half];
  const int64_t c = s * hd + i;
  const T out = FromF<T>(Round<T>(v * ToF(cos[c])) + Round<T>(rot * ToF(sin[c])));
  if (is_q) {
    q_out[(s * heads + h) * hd + i] = out;
  } else {
    k_out[(s * kv_heads + (h - heads)) * hd + i] = out;
  }
}

template <typename T>
void LaunchQkvNormRope(const void* qkv, const void* delta, const void* q_norm, const void* k_norm, const void* cos,
                       const void* sin, void* sum_out, float* inv_out, void* q, void* k, void* v, int64_t rows,
                       int64_t heads, int64_t kv_heads, int64_t hd, float eps, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads + 2 * kv_heads));
  QkvNormRopeKernel<T><<<grid, static_cast<unsigned>(hd), static_cast<size_t>(hd) * sizeof(float), stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(delta), static_cast<const T*>(q_norm),
      static_cast<const T*>(k_norm), static_cast<const T*>(cos), static_cast<const T*>(sin), static_cast<T*>(sum_out),
      inv_out, static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v), static_cast<int>(heads),
      static_cast<int>(kv_heads), static_cast<int>(hd), eps);
}

// Its backward, same grid: RoPE's transpose, then the head's RMSNorm backward.
template <typename T>
__global__ void QkvNormRopeGradKernel(const T* sum, const T* q_norm, const T* k_norm, const float* inv,
                                      const T* cos, const T* sin, const T* dq, const T* dk, const T* dv, T* d_qkv,
                                      int heads, int kv_heads, int hd) {
  extern __shared__ float gs[];  // hd: T(g * sin)
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y, i = threadIdx.x, all = heads + 2 * kv_heads;
  const int64_t at = (s * all + h) * hd + i;
  if (h >= heads + kv_heads) {
    d_qkv[at] = dv ? dv[(s * kv_heads + (h - heads - kv_heads)) * hd + i] : FromF<T>(0.0f);
    return;
  }
  const bool is_q = h < heads;
  const T* g_in = is_q ? dq : dk;
  const float g = g_in ? ToF(g_in[is_q ? (s * heads + h) * hd + i : (s * kv_heads + (h - heads)) * hd + i]) : 0.0f;
  const int64_t c = s * hd + i;
  gs[i] = Round<T>(g * ToF(sin[c]));
  __syncthreads();
  const int half = hd / 2;
  const float rot_t = i < half ? gs[i + half] : -gs[i - half];
  float d = Round<T>(Round<T>(g * ToF(cos[c])) + rot_t);
  const T* norm_w = is_q ? q_norm : k_norm;
  if (norm_w) {
    const float r = inv[s * (heads + kv_heads) + h];
    const float dn = Round<T>(d * ToF(norm_w[i])), n = ToF(sum[at]) * r;
    const float mean = BlockSum(dn * n) / static_cast<float>(hd);
    d = r * (dn - n * mean);
  }
  d_qkv[at] = FromF<T>(d);
}

template <typename T>
void LaunchQkvNormRopeGrad(const void* sum, const void* q_norm, const void* k_norm, const float* inv, const void* cos,
                           const void* sin, const void* dq, const void* dk, const void* dv, void* d_qkv, int64_t rows,
                           int64_t heads, int64_t kv_heads, int64_t hd, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads + 2 * kv_heads));
  QkvNormRopeGradKernel<T><<<grid, static_cast<unsigned>(hd), static_cast<size_t>(hd) * sizeof(float), stream>>>(
      static_cast<const T*>(sum), static_cast<const T*>(q_norm), static_cast<const T*>(k_norm), inv,
      static_cast<const T*>(cos), static_cast<const T*>(sin), static_cast<const T*>(dq), static_cast<const T*>(dk),
      static_cast<const T*>(dv), static_cast<T*>(d_qkv), static_cast<int>(heads), static_cast<int>(kv_heads),
      static_cast<int>(hd));
}

}  // namespace

void RmsNormGrad(bool bf16, const void* g, const void* x, const void* w, const float* inv, void* dx, int64_t rows,
                 int64_t width, cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchRmsNormGrad, g, x, w, inv, dx, rows, width, stream);
}

void SwiGluGrad(bool bf16, const void* gate_up, const void* dy, void* d_gate_up, int64_t rows, int64_t inter,
                cudaStream_t stream) {
  if (rows <= 0 || inter <= 0) return;
  LOOM_DISPATCH(bf16, LaunchSwiGluGrad, gate_up, dy, d_gate_up, rows, inter, stream);
}

void QkvNormRope(bool bf16, const void* qkv, const void* delta, const void* q_norm, const void* k_norm,
                 const void* cos, const void* sin, void* sum_out, float* inv_out, void* q, void* k, void* v,
                 int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchQkvNormRope, qkv, delta, q_norm, k_norm, cos, sin, sum_out, inv_out, q, k, v, rows, heads,
                kv_heads, head_dim, eps, stream);
}

void QkvNormRopeGrad(bool bf16, const void* sum, const void* q_norm, const void* k_norm, const float* inv,
                     const void* cos, const void* sin, const void* dq, const void* dk, const void* dv, void* d_qkv,
                     int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchQkvNormRopeGrad, sum, q_norm, k_norm, inv, cos, sin, dq, dk, dv, d_qkv, rows, heads,
                kv_heads, head_dim, stream);
}

}  // namespace loom::engine::cuda
