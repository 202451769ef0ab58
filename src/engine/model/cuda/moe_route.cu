// MoeRoute and MoeCombine (moe_route.h).
#include "engine/model/cuda/moe_route.h"

#include <cmath>

#include "engine/sample/cuda/device.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

// The larger of (v, e) and (ov, oe): by value, ties to the lower expert.
__device__ __forceinline__ void Better(float& v, int& e, float ov, int oe) {
  if (ov > v || (ov == v && oe < e)) {
    v = ov;
    e = oe;
  }
}

// One warp per token (blockIdx.x): the E scores in shared memory, then K
// rounds of a warp argmax over the experts not yet taken.
template <typename T>
__global__ void MoeRouteKernel(const T* logits, T* weights, int64_t* experts, int E, int K, bool softmax_first,
                               bool norm_topk) {
  __shared__ float score[kMoeRouteMaxExperts];
  __shared__ bool taken[kMoeRouteMaxExperts];
  __shared__ float top[kMoeRouteMaxK];
  const int lane = threadIdx.x;
  const int64_t t = blockIdx.x;
  const T* row = logits + t * E;
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    score[e] = ToF(row[e]);
    taken[e] = false;
    mx = fmaxf(mx, score[e]);
  }
  if (softmax_first) {  // as at::softmax: exp(x - max) / sum, in fp32
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) {
      score[e] = expf(score[e] - mx);
      sum += score[e];
    }
    sum = WarpSum(sum);
    for (int e = lane; e < E; e += 32) score[e] /= sum;
  }
  __syncwarp();
  for (int k = 0; k < K; ++k) {
    float v = -INFINITY;
    int best = E;  // none: loses every comparison with a real expert
    // A NaN score ranks above every number, as at::topk ranks it, so the
    // step picks a real expert (the NaN reaches the weights) and never
    // index E, which the expert kernels would read past their weights.
    for (int e = lane; e < E; e += 32)
      if (!taken[e]) Better(v, best, isnan(score[e]) ? INFINITY : score[e], e);
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best, o);
      Better(v, best, ov, oe);
    }
    if (lane == 0) {
      top[k] = v;
      experts[t * K + k] = best;
      taken[best] = true;
    }
    __syncwarp();
  }
  if (lane != 0) return;
  if (softmax_first) {
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += top[k];
    for (int k = 0; k < K; ++k) weights[t * K + k] = FromF<T>(norm_topk ? top[k] / sum : top[k]);
  } else {  // softmax over the K logits, top[0] the largest
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += expf(top[k] - top[0]);
    for (int k = 0; k < K; ++k) weights[t * K + k] = FromF<T>(expf(top[k] - top[0]) / sum);
  }
}

constexpr int kCombineThreads = 256;

// Grid (ceil(n / kCombineThreads), tokens).
template <typename T, typename W>
__global__ void MoeCombineKernel(const T* y, const W* weights, T* out, int K, int64_t n) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x, t = blockIdx.y;
  if (c >= n) return;
  float acc = 0.0f;
  for (int k = 0; k < K; ++k) acc += Round<T>(ToF(y[(t * K + k) * n + c]) * ToF(weights[t * K + k]));
  out[t * n + c] = FromF<T>(acc);
}

template <typename T>
void LaunchRoute(const void* logits, void* weights, int64_t* experts, int64_t tokens, int64_t E, int64_t K,
                 bool softmax_first, bool norm_topk, cudaStream_t stream) {
  MoeRouteKernel<T><<<static_cast<unsigned>(tokens), 32, 0, stream>>>(
      static_cast<const T*>(logits), static_cast<T*>(weights), experts, static_cast<int>(E), static_cast<int>(K),
      softmax_first, norm_topk);
}

template <typename T>
void LaunchCombine(const void* y, const void* weights, bool weights_f32, void* out, int64_t tokens, int64_t K,
                   int64_t n, cudaStream_t stream) {
  const dim3 grid(Blocks(n, kCombineThreads), static_cast<unsigned>(tokens));
  if (weights_f32) {
    MoeCombineKernel<T, float><<<grid, kCombineThreads, 0, stream>>>(
        static_cast<const T*>(y), static_cast<const float*>(weights), static_cast<T*>(out), static_cast<int>(K), n);
  } else {
    MoeCombineKernel<T, T><<<grid, kCombineThreads, 0, stream>>>(
        static_cast<const T*>(y), static_cast<const T*>(weights), static_cast<T*>(out), static_cast<int>(K), n);
  }
}

}  // namespace

bool MoeRoute(bool bf16, MoeRouteKind kind, bool norm_topk, const void* logits, void* weights, int64_t* experts,
              int64_t tokens, int64_t E, int64_t K, cudaStream_t stream) {
  if (tokens <= 0 || E <= 0 || K <= 0 || E > kMoeRouteMaxExperts || K > E || K > kMoeRouteMaxK) return false;
  const bool softmax_first = kind == MoeRouteKind::kSoftmaxTopK;
  LOOM_DISPATCH(bf16, LaunchRoute, logits, weights, experts, tokens, E, K, softmax_first, norm_topk, stream);
  return true;
}

void MoeCombine(bool bf16, const void* y, const void* weights, bool weights_f32, void* out, int64_t tokens, int64_t K,
                int64_t n, cudaStream_t stream) {
  if (tokens <= 0 || K <= 0 || n <= 0) return;
  LOOM_DISPATCH(bf16, LaunchCombine, y, weights, weights_f32, out, tokens, K, n, stream);
}

}  // namespace loom::engine::cuda
