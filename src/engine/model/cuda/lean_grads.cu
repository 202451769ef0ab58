// RmsNormGrad and SwiGluGrad (lean_grads.h).
#include "engine/model/cuda/lean_grads.h"

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

}  // namespace loom::engine::cuda
