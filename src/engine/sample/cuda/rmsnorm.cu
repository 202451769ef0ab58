// RmsNorm (rmsnorm.h).
#include "engine/sample/cuda/rmsnorm.h"

#include <algorithm>

#include "engine/sample/cuda/device.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

constexpr int kNormPer = kMaxNormWidth / 1024;  // elements per thread, held in registers

// One block per row: out = w * T(norm(x + add')), add' = T(add + add_delta),
// the sum written to sum_out.
template <typename T>
__global__ void RmsNormKernel(const T* x, const T* add, const T* add_delta, T* sum_out, const T* w, T* out, int64_t n,
                              float eps, float* inv_out) {
  const int64_t row = blockIdx.x, base = row * n;
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
      if (add_delta) a = AddDelta<T>(a, ToF(add_delta[base + i]));
      xv = Round<T>(xv + a);
      sum_out[base + i] = FromF<T>(xv);
    }
    v[e] = xv;
    ss += xv * xv;
  }
  const float inv = rsqrtf(BlockSum(ss) / static_cast<float>(n) + eps);
  if (inv_out && threadIdx.x == 0) inv_out[row] = inv;
#pragma unroll
  for (int e = 0; e < kNormPer; ++e) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(e) * blockDim.x;
    if (i < n) out[base + i] = FromF<T>(ToF(w[i]) * Round<T>(v[e] * inv));
  }
}


// The same with 8 consecutive elements per thread (16-byte loads for bf16),
// at most kVecChunks chunks of 8 a thread: for rows of a multiple of 8 with
// aligned buffers (the trainer's [T, hidden] rows: fewer, wider loads than
// the one-element-per-thread kernel above).
constexpr int kVec = 8, kVecChunks = 2;

template <typename T>
__global__ void RmsNormVecKernel(const T* x, const T* add, const T* add_delta, T* sum_out, const T* w, T* out,
                                 int64_t n, float eps, float* inv_out) {
  const int64_t row = blockIdx.x, base = row * n;
  float v[kVecChunks][kVec];
  float ss = 0.0f;
#pragma unroll
  for (int c = 0; c < kVecChunks; ++c) {
    const int64_t i = (threadIdx.x + static_cast<int64_t>(c) * blockDim.x) * kVec;
    if (i >= n) continue;
    LoadV<T, kVec>(x + base + i, v[c]);
    if (add) {
      float a[kVec];
      LoadV<T, kVec>(add + base + i, a);
      if (add_delta) {
        float d[kVec];
        LoadV<T, kVec>(add_delta + base + i, d);
#pragma unroll
        for (int k = 0; k < kVec; ++k) a[k] = AddDelta<T>(a[k], d[k]);
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[c][k] = Round<T>(v[c][k] + a[k]);
      StoreV<T, kVec>(sum_out + base + i, v[c]);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) ss += v[c][k] * v[c][k];
  }
  const float inv = rsqrtf(BlockSum(ss) / static_cast<float>(n) + eps);
  if (inv_out && threadIdx.x == 0) inv_out[row] = inv;
#pragma unroll
  for (int c = 0; c < kVecChunks; ++c) {
    const int64_t i = (threadIdx.x + static_cast<int64_t>(c) * blockDim.x) * kVec;
    if (i >= n) continue;
    float wv[kVec];
    LoadV<T, kVec>(w + i, wv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) wv[k] *= Round<T>(v[c][k] * inv);
    StoreV<T, kVec>(out + base + i, wv);
  }
}

template <typename T>
void LaunchRmsNorm(const void* x, const void* add, const void* add_delta, void* sum_out, const void* w, void* out,
                   int64_t rows, int64_t n, float eps, cudaStream_t stream, float* inv_out) {
  const int64_t chunks = n / kVec;
  if (n % kVec == 0 && chunks <= 1024 * kVecChunks && Aligned16(x) && Aligned16(w) && Aligned16(out) &&
      (!add || (Aligned16(add) && Aligned16(sum_out) && (!add_delta || Aligned16(add_delta))))) {
    const int64_t threads = std::min<int64_t>(1024, (chunks + 31) / 32 * 32);  // one chunk each up to n = 8192
    RmsNormVecKernel<T><<<static_cast<unsigned>(rows), static_cast<unsigned>(threads), 0,
                          stream>>>(static_cast<const T*>(x), static_cast<const T*>(add),
                                    static_cast<const T*>(add_delta), static_cast<T*>(sum_out),
                                    static_cast<const T*>(w), static_cast<T*>(out), n, eps, inv_out);
    return;
  }
  // Enough threads for kNormPer elements each; 4 each up to n = 4096.
  const int64_t threads = std::min<int64_t>(1024, std::max<int64_t>(128, (n / 4 + 31) / 32 * 32));
  RmsNormKernel<T><<<static_cast<unsigned>(rows), static_cast<unsigned>(threads), 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(add), static_cast<const T*>(add_delta), static_cast<T*>(sum_out),
      static_cast<const T*>(w), static_cast<T*>(out), n, eps, inv_out);
}

}  // namespace

void RmsNorm(bool bf16, const void* x, const void* add, const void* add_delta, void* sum_out, const void* w,
             void* out, int64_t rows, int64_t n, float eps, cudaStream_t stream, float* inv_out) {
  if (rows <= 0 || n > kMaxNormWidth) return;
  LOOM_DISPATCH(bf16, LaunchRmsNorm, x, add, add_delta, sum_out, w, out, rows, n, eps, stream, inv_out);
}

}  // namespace loom::engine::cuda
