// Device helpers shared by the CUDA kernels (*.cu here, and the trainer's model/cuda/; nvcc only).
//
// Conventions of every kernel in this folder: raw pointers and a stream,
// no libtorch (the .cu files build in their own library, untouched by
// libtorch's flags), row-major buffers. T is the model dtype:
// __nv_bfloat16 or float, chosen at run time by the launcher's `bf16`.
// Each kernel rounds where the eager libtorch ops it replaces round (to T
// after every op the eager path runs in T), so the fast decode stays
// within float rounding of Transformer::ForwardCached. Launches are
// asynchronous on `stream`; the caller owns the buffers until the stream
// has run them.
//
// Decode steps are small (a few rows): the base projections' consumers are
// bound by memory and launch count; the LoRA kernels were bound by issuing
// CUDA-core instructions (ncu), hence tensor cores for them in bf16.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda::dev {

using bf16_t = __nv_bfloat16;

__device__ __forceinline__ float ToF(float v) { return v; }
__device__ __forceinline__ float ToF(bf16_t v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T FromF(float v);
template <>
__device__ __forceinline__ float FromF<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16_t FromF<bf16_t>(float v) { return __float2bfloat16_rn(v); }
// v rounded through T (the eager op's output dtype), back in fp32.
template <typename T>
__device__ __forceinline__ float Round(float v) { return ToF(FromF<T>(v)); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets it.
__device__ inline float BlockSum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float r = lane < warps ? partial[lane] : 0.0f;
    r = WarpSum(r);
    if (lane == 0) partial[0] = r;
  }
  __syncthreads();
  return partial[0];
}

// Loads V consecutive T into fp32: 16-byte loads when V * sizeof(T) is a
// multiple of 16 (the caller guarantees alignment then), else one by one.
template <typename T, int V>
__device__ __forceinline__ void LoadV(const T* p, float* out) {
  constexpr int kPer = 16 / sizeof(T);
  if constexpr (V % kPer == 0) {
#pragma unroll
    for (int c = 0; c < V; c += kPer) {
      const uint4 u = *reinterpret_cast<const uint4*>(p + c);
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int k = 0; k < kPer; ++k) out[c + k] = ToF(e[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = ToF(p[k]);
  }
}

// Stores V fp32 values as V consecutive T, each rounded once: 16-byte
// stores when V * sizeof(T) is a multiple of 16 (aligned, as for LoadV).
template <typename T, int V>
__device__ __forceinline__ void StoreV(T* p, const float* in) {
  constexpr int kPer = 16 / sizeof(T);
  if constexpr (V % kPer == 0) {
#pragma unroll
    for (int c = 0; c < V; c += kPer) {
      union {
        uint4 u;
        T e[kPer];
      } w;
#pragma unroll
      for (int k = 0; k < kPer; ++k) w.e[k] = FromF<T>(in[c + k]);
      *reinterpret_cast<uint4*>(p + c) = w.u;
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = FromF<T>(in[k]);
  }
}

// V consecutive T kept as loaded (one 16-byte load when V * sizeof(T) is
// 16), converted to fp32 one element at a time where used.
template <typename T, int V>
struct Raw {
  static constexpr bool kVector = V * sizeof(T) == 16;
  union {
    uint4 u;
    T e[V];
  };
  __device__ __forceinline__ void Load(const T* p) {
    if constexpr (kVector) {
      u = *reinterpret_cast<const uint4*>(p);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) e[k] = p[k];
    }
  }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int k = 0; k < V; ++k) e[k] = FromF<T>(0.0f);
  }
  __device__ __forceinline__ float At(int k) const { return ToF(e[k]); }
};

// ---- tensor cores (bf16 operands, fp32 accumulators) ----
//
// mma.sync m16n8k16: C[16 x 8] += A[16 x 16] B[16 x 8]. Lane l is in quad
// g = l / 4 at position tq = l % 4. Its A registers hold (row g, k 2tq and
// 2tq+1), (row g+8, the same k), (row g, k 2tq+8 and 2tq+9), (row g+8,
// those); its B registers (k 2tq and 2tq+1, column g), (k 2tq+8 and 2tq+9,
// column g); it holds C[g][2tq], C[g][2tq+1], C[g+8][2tq], C[g+8][2tq+1].
// A pair's lower k is the register's low half, as loaded from memory.
__device__ __forceinline__ void Mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair (lo in the low half, as loaded from memory).
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline unsigned Blocks(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

// y + delta as the eager path computes it in T: y + T(delta), rounded.
template <typename T>
__device__ __forceinline__ float AddDelta(float y, float delta) { return Round<T>(y + Round<T>(delta)); }

}  // namespace loom::engine::cuda::dev

// bf16 ? f<bf16_t>(args...) : f<float>(args...), for the launchers below.
#define LOOM_DISPATCH(bf16, f, ...) ((bf16) ? f<bf16_t>(__VA_ARGS__) : f<float>(__VA_ARGS__))
