// AdamWStep (adamw_kernels.h): a grid-stride loop, 4 elements a thread
// (16-byte loads and stores) where the span's pointers allow it.
#include <algorithm>

#include "engine/train/cuda/adamw_kernels.h"

namespace loom::engine::cuda {
namespace {

// Each step rounded where the ATen op sequence rounds (no contraction into
// fused multiply-adds, which that sequence does not make across its ops).
__device__ __forceinline__ void Update(float& p, float g, float& m, float& v, const AdamWFactors& f) {
  const float gs = __fmul_rn(g, f.f[0]);
  p = __fmul_rn(p, f.f[1]);
  m = __fadd_rn(__fmul_rn(m, f.f[2]), __fmul_rn(gs, f.f[3]));
  v = __fadd_rn(__fmul_rn(v, f.f[4]), __fmul_rn(__fmul_rn(f.f[5], gs), gs));
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), f.f[6]), f.f[7]);
  p = __fadd_rn(p, __fmul_rn(f.f[8], __fdiv_rn(m, denom)));
}

__global__ void AdamWVecKernel(float4* p, const float4* g, float4* m, float4* v, int64_t n4, AdamWFactors f) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float4 pp = p[i], mm = m[i], vv = v[i];
    const float4 gg = g[i];
    Update(pp.x, gg.x, mm.x, vv.x, f);
    Update(pp.y, gg.y, mm.y, vv.y, f);
    Update(pp.z, gg.z, mm.z, vv.z, f);
    Update(pp.w, gg.w, mm.w, vv.w, f);
    p[i] = pp;
    m[i] = mm;
    v[i] = vv;
  }
}

__global__ void AdamWKernel(float* p, const float* g, float* m, float* v, int64_t n, AdamWFactors f) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    Update(p[i], g[i], m[i], v[i], f);
}

bool Aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; }

unsigned GridFor(int64_t items) {
  return static_cast<unsigned>(std::clamp<int64_t>((items + 255) / 256, 1, 4096));
}

constexpr int kSumThreads = 256;

// Block b of span blockIdx.y: a grid-stride share of the span, squared and
// summed in fp64, then reduced over the block in a fixed order.
template <bool kVector>
__global__ void SquaredSumKernel(const float* x, int64_t ld, const int64_t* slots, int64_t len, double* partial) {
  const float* row = x + slots[blockIdx.y] * ld;
  double acc = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if constexpr (kVector) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int64_t i = first; i < len / 4; i += stride) {
      const float4 v = r4[i];
      acc += static_cast<double>(v.x) * v.x + static_cast<double>(v.y) * v.y + static_cast<double>(v.z) * v.z +
             static_cast<double>(v.w) * v.w;
    }
    for (int64_t i = len / 4 * 4 + first; i < len; i += stride) acc += static_cast<double>(row[i]) * row[i];
  } else {
    for (int64_t i = first; i < len; i += stride) acc += static_cast<double>(row[i]) * row[i];
  }
  __shared__ double part[kSumThreads];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kSumThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x] = part[0];
}

}  // namespace

int64_t SquaredSumBlocks(int64_t len) {
  return std::clamp<int64_t>((len / 4 + kSumThreads - 1) / kSumThreads, 1, 512);
}

void SquaredSums(const float* x, int64_t ld, const int64_t* slots, int64_t U, int64_t len, double* partial,
                 cudaStream_t stream) {
  if (U <= 0) return;
  const dim3 grid(static_cast<unsigned>(SquaredSumBlocks(len)), static_cast<unsigned>(U));
  if (Aligned16(x) && ld % 4 == 0)
    SquaredSumKernel<true><<<grid, kSumThreads, 0, stream>>>(x, ld, slots, len, partial);
  else
    SquaredSumKernel<false><<<grid, kSumThreads, 0, stream>>>(x, ld, slots, len, partial);
}

void AdamWStep(float* p, const float* g, float* m, float* v, int64_t n, const AdamWFactors& f, cudaStream_t stream) {
  if (n <= 0) return;
  if (Aligned16(p) && Aligned16(g) && Aligned16(m) && Aligned16(v)) {
    const int64_t n4 = n / 4;
    if (n4 > 0)
      AdamWVecKernel<<<GridFor(n4), 256, 0, stream>>>(reinterpret_cast<float4*>(p), reinterpret_cast<const float4*>(g),
                                                       reinterpret_cast<float4*>(m), reinterpret_cast<float4*>(v), n4, f);
    const int64_t done = n4 * 4;
    if (done < n) AdamWKernel<<<1, 256, 0, stream>>>(p + done, g + done, m + done, v + done, n - done, f);
    return;
  }
  AdamWKernel<<<GridFor(n), 256, 0, stream>>>(p, g, m, v, n, f);
}

}  // namespace loom::engine::cuda
