// Gemv (gemv.h).
#include "engine/model/cuda/gemv.h"

#include "engine/sample/cuda/device.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

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
// With experts (M == 1): blockIdx.y is pair p, which reads x row p / x_div,
// expert experts[p]'s matrix and bias, and writes y row p.
template <typename T, int M>
__global__ void GemvKernel(const T* x, int64_t ldx, const T* W, const T* bias, void* y, bool y_f32, int64_t n,
                           int64_t k, const int64_t* experts, int64_t x_div) {
  constexpr int V = 16 / sizeof(T);
  constexpr int64_t kStep = 32 * V;
  const int lane = threadIdx.x & 31;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (c >= n) return;
  if (experts != nullptr) {
    const int64_t p = blockIdx.y, e = experts[p];
    x += p / x_div * ldx;
    W += e * n * k;
    if (bias) bias += e * n;
    y = y_f32 ? static_cast<void*>(static_cast<float*>(y) + p * n) : static_cast<void*>(static_cast<T*>(y) + p * n);
  }
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

template <typename T, int M>
void LaunchGemv(const void* x, int64_t ldx, const void* W, const void* bias, void* y, bool y_f32, int64_t n, int64_t k,
                cudaStream_t stream, const int64_t* experts = nullptr, int64_t x_div = 1, int64_t pairs = 1) {
  const dim3 grid(static_cast<unsigned>(Blocks(n, kGemvWarps)), static_cast<unsigned>(pairs));
  GemvKernel<T, M><<<grid, 32 * kGemvWarps, 0, stream>>>(static_cast<const T*>(x), ldx, static_cast<const T*>(W),
                                                         static_cast<const T*>(bias), y, y_f32, n, k, experts, x_div);
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

}  // namespace

bool ExpertGemv(bool bf16, const void* x, int64_t ldx, int64_t x_div, const void* W, const void* bias,
                const int64_t* experts, void* y, int64_t pairs, int64_t n, int64_t k, cudaStream_t stream) {
  if (pairs <= 0 || pairs > kExpertGemvMaxPairs || n <= 0 || k <= 0 || x_div < 1 || experts == nullptr) return false;
  const int64_t V = bf16 ? 8 : 4;
  if (k % V != 0 || ldx % V != 0 || !Aligned16(x) || !Aligned16(W)) return false;
  if (bf16) {
    LaunchGemv<bf16_t, 1>(x, ldx, W, bias, y, false, n, k, stream, experts, x_div, pairs);
  } else {
    LaunchGemv<float, 1>(x, ldx, W, bias, y, false, n, k, stream, experts, x_div, pairs);
  }
  return true;
}

bool Gemv(bool bf16, const void* x, int64_t ldx, const void* W, const void* bias, void* y, bool y_f32, int64_t rows,
          int64_t n, int64_t k, cudaStream_t stream) {
  if (rows <= 0 || rows > kGemvMaxRows || n <= 0 || k <= 0) return false;
  return bf16 ? GemvFor<bf16_t>(x, ldx, W, bias, y, y_f32, rows, n, k, stream)
              : GemvFor<float>(x, ldx, W, bias, y, y_f32, rows, n, k, stream);
}

}  // namespace loom::engine::cuda
