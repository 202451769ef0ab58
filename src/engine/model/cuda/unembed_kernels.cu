// TargetLogprobs and TargetLogprobsGrad (unembed_kernels.h): one block per
// row, each thread striding over the row in 16-byte vectors where the row
// allows them (vocab a multiple of 16 / sizeof(T) and an aligned base), one
// element at a time otherwise. Both are bound by reading (and, backward,
// writing) the logits once.
#include <cmath>

#include "engine/model/cuda/unembed_kernels.h"
#include "engine/sample/cuda/device.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

constexpr int kThreads = 512;

// A running (max, sum of exp(x - max)) pair, merged without NaNs from two
// empty (-inf, 0) halves.
struct MaxSum {
  float m = -INFINITY, s = 0.0f;
  __device__ __forceinline__ void Merge(float m2, float s2) {
    const float top = fmaxf(m, m2);
    if (top == -INFINITY) return;
    s = s * expf(m - top) + s2 * expf(m2 - top);
    m = top;
  }
};

// 16-byte vectors of T, loaded and stored whole.
template <typename T>
union Vec {
  static constexpr int kN = 16 / sizeof(T);
  uint4 u;
  T e[kN];
};

// Over one row of `vocab` elements, strided over the block's threads:
// vec(i) for each whole 16-byte vector i (kVector), then elem(i) for each
// element past them (all of them without kVector).
template <typename T, bool kVector, typename VecF, typename ElemF>
__device__ __forceinline__ void OverRow(int64_t vocab, VecF&& vec, ElemF&& elem) {
  int64_t tail = 0;
  if constexpr (kVector) {
    const int64_t n = vocab / Vec<T>::kN;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) vec(i);
    tail = n * Vec<T>::kN;
  }
  for (int64_t i = tail + threadIdx.x; i < vocab; i += blockDim.x) elem(i);
}

// The block's merged pair, for every thread.
__device__ MaxSum BlockMaxSum(MaxSum p) {
  __shared__ float ms[32], ss[32];
  for (int o = 16; o > 0; o >>= 1) p.Merge(__shfl_xor_sync(0xffffffffu, p.m, o), __shfl_xor_sync(0xffffffffu, p.s, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) {
    ms[warp] = p.m;
    ss[warp] = p.s;
  }
  __syncthreads();
  MaxSum r;
  for (int w = 0; w < warps; ++w) r.Merge(ms[w], ss[w]);
  return r;
}

template <typename T, bool kVector>
__global__ void TargetLogprobsKernel(const T* logits, const int64_t* targets, float* logprob, float* lse_out,
                                     int64_t vocab, int64_t k) {
  const T* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  MaxSum p;
  constexpr int kN = Vec<T>::kN;
  OverRow<T, kVector>(
      vocab,
      [&](int64_t i) {
        Vec<T> v;
        v.u = reinterpret_cast<const uint4*>(row)[i];
        float top = ToF(v.e[0]);
#pragma unroll
        for (int j = 1; j < kN; ++j) top = fmaxf(top, ToF(v.e[j]));
        if (top > p.m) {
          p.s *= expf(p.m - top);
          p.m = top;
        }
#pragma unroll
        for (int j = 0; j < kN; ++j) p.s += expf(ToF(v.e[j]) - p.m);
      },
      [&](int64_t i) { p.Merge(ToF(row[i]), 1.0f); });
  const MaxSum all = BlockMaxSum(p);
  const float lse = all.m + logf(all.s);
  if (threadIdx.x == 0) lse_out[blockIdx.x] = lse;
  const int64_t* t = targets + static_cast<int64_t>(blockIdx.x) * k;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
    logprob[static_cast<int64_t>(blockIdx.x) * k + j] = ToF(row[t[j]]) - lse;
}

template <typename T, bool kVector>
__global__ void TargetLogprobsGradKernel(T* logits, const float* lse, const int64_t* targets, const float* g,
                                         int64_t vocab, int64_t k) {
  __shared__ float target_logit[kMaxLogprobTargets];
  T* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  const int64_t* t = targets + static_cast<int64_t>(blockIdx.x) * k;
  const float* gr = g + static_cast<int64_t>(blockIdx.x) * k;
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) total += gr[j];
  // The targets' logits, read before any thread overwrites them.
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) target_logit[j] = ToF(row[t[j]]);
  __syncthreads();
  const float l = lse[blockIdx.x];
  constexpr int kN = Vec<T>::kN;
  OverRow<T, kVector>(
      vocab,
      [&](int64_t i) {
        Vec<T> v;
        if (total != 0.0f) {
          v.u = reinterpret_cast<const uint4*>(row)[i];
#pragma unroll
          for (int j = 0; j < kN; ++j) v.e[j] = FromF<T>(-total * expf(ToF(v.e[j]) - l));
        } else {
#pragma unroll
          for (int j = 0; j < kN; ++j) v.e[j] = FromF<T>(0.0f);
        }
        reinterpret_cast<uint4*>(row)[i] = v.u;
      },
      [&](int64_t i) { row[i] = FromF<T>(total != 0.0f ? -total * expf(ToF(row[i]) - l) : 0.0f); });
  __syncthreads();
  // Each target's element once more, with its own weights (duplicates write
  // the same value).
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
    float own = 0.0f;
    for (int64_t i = 0; i < k; ++i)
      if (t[i] == t[j]) own += gr[i];
    row[t[j]] = FromF<T>(own - total * expf(target_logit[j] - l));
  }
}

template <typename T>
bool Vectorizable(const void* p, int64_t vocab) {
  return Aligned16(p) && vocab % Vec<T>::kN == 0;
}

template <typename T>
void LaunchForward(const void* logits, const int64_t* targets, float* logprob, float* lse, int64_t rows, int64_t vocab,
                   int64_t k, cudaStream_t stream) {
  const T* l = static_cast<const T*>(logits);
  if (Vectorizable<T>(logits, vocab))
    TargetLogprobsKernel<T, true><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(l, targets, logprob, lse, vocab, k);
  else
    TargetLogprobsKernel<T, false><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(l, targets, logprob, lse, vocab, k);
}

template <typename T>
void LaunchGrad(void* logits, const float* lse, const int64_t* targets, const float* g, int64_t rows, int64_t vocab,
                int64_t k, cudaStream_t stream) {
  T* l = static_cast<T*>(logits);
  if (Vectorizable<T>(logits, vocab))
    TargetLogprobsGradKernel<T, true><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(l, lse, targets, g, vocab, k);
  else
    TargetLogprobsGradKernel<T, false><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(l, lse, targets, g, vocab, k);
}

}  // namespace

void TargetLogprobs(bool bf16, const void* logits, const int64_t* targets, float* logprob, float* lse, int64_t rows,
                    int64_t vocab, int64_t k, cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchForward, logits, targets, logprob, lse, rows, vocab, k, stream);
}

void TargetLogprobsGrad(bool bf16, void* logits, const float* lse, const int64_t* targets, const float* g,
                        int64_t rows, int64_t vocab, int64_t k, cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchGrad, logits, lse, targets, g, rows, vocab, k, stream);
}

}  // namespace loom::engine::cuda
