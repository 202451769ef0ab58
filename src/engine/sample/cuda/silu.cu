// SiluMul (silu.h).
#include "engine/sample/cuda/silu.h"

#include <algorithm>

#include "engine/sample/cuda/device.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

constexpr int kSiluThreads = 256;

// Grid (ceil(inter / kSiluThreads), rows): out = T(silu(gate')) * up',
// gate' and up' with their deltas added (rounded to T) when given.
template <typename T>
__global__ void SiluMulKernel(const T* gate_up, const T* delta, T* out, int64_t inter) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSiluThreads + threadIdx.x, r = blockIdx.y;
  if (c >= inter) return;
  const int64_t gi = r * 2 * inter + c, ui = gi + inter;
  float g = ToF(gate_up[gi]), u = ToF(gate_up[ui]);
  if (delta) {
    g = AddDelta<T>(g, ToF(delta[gi]));
    u = AddDelta<T>(u, ToF(delta[ui]));
  }
  const float silu = Round<T>(g / (1.0f + expf(-g)));
  out[r * inter + c] = FromF<T>(silu * u);
}

// The same, 8 consecutive columns a thread (16-byte loads and stores for bf16), for
// inter a multiple of 8 and aligned buffers (the trainer's [T, 2I] rows).
constexpr int kSiluVec = 8;

template <typename T>
__global__ void SiluMulVecKernel(const T* gate_up, const T* delta, T* out, int64_t inter) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kSiluThreads + threadIdx.x) * kSiluVec, r = blockIdx.y;
  if (c >= inter) return;
  const int64_t gi = r * 2 * inter + c, ui = gi + inter;
  float g[kSiluVec], u[kSiluVec];
  LoadV<T, kSiluVec>(gate_up + gi, g);
  LoadV<T, kSiluVec>(gate_up + ui, u);
  if (delta) {
    float dg[kSiluVec], du[kSiluVec];
    LoadV<T, kSiluVec>(delta + gi, dg);
    LoadV<T, kSiluVec>(delta + ui, du);
#pragma unroll
    for (int k = 0; k < kSiluVec; ++k) {
      g[k] = AddDelta<T>(g[k], dg[k]);
      u[k] = AddDelta<T>(u[k], du[k]);
    }
  }
  float y[kSiluVec];
#pragma unroll
  for (int k = 0; k < kSiluVec; ++k) y[k] = Round<T>(g[k] / (1.0f + expf(-g[k]))) * u[k];
  StoreV<T, kSiluVec>(out + r * inter + c, y);
}

template <typename T>
void LaunchSiluMul(const void* gate_up, const void* delta, void* out, int64_t rows, int64_t inter,
                   cudaStream_t stream) {
  // Rows are the grid's y (at most 65,535 a launch; a trainer pass has more).
  constexpr int64_t kMaxRows = 65535;
  const T* gu = static_cast<const T*>(gate_up);
  const T* d = static_cast<const T*>(delta);
  T* o = static_cast<T*>(out);
  const bool vec = inter % kSiluVec == 0 && Aligned16(gate_up) && Aligned16(out) && (!delta || Aligned16(delta));
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    if (vec) {
      const dim3 grid(Blocks(inter / kSiluVec, kSiluThreads), static_cast<unsigned>(std::min(kMaxRows, rows - r)));
      const int64_t in_at = r * 2 * inter;
      SiluMulVecKernel<T><<<grid, kSiluThreads, 0, stream>>>(gu + in_at, d ? d + in_at : nullptr, o + r * inter, inter);
      continue;
    }
    const dim3 grid(Blocks(inter, kSiluThreads), static_cast<unsigned>(std::min(kMaxRows, rows - r)));
    const int64_t in_at = r * 2 * inter;
    SiluMulKernel<T><<<grid, kSiluThreads, 0, stream>>>(gu + in_at, d ? d + in_at : nullptr, o + r * inter, inter);
  }
}

}  // namespace

void SiluMul(bool bf16, const void* gate_up, const void* delta, void* out, int64_t rows, int64_t inter,
             cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchSiluMul, gate_up, delta, out, rows, inter, stream);
}

}  // namespace loom::engine::cuda
