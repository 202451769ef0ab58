// GatherSlotRows and AddSlotRows (slot_rows_kernels.h): grid-stride loops,
// 4 elements a thread where the rows and their pointers allow 16-byte fp32
// accesses; the gather's blockIdx.y is the row.
#include "engine/lora/cuda/slot_rows_kernels.h"

#include <algorithm>

#include "engine/sample/cuda/device.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

constexpr int kThreads = 256;

template <typename T, int V>
__global__ void GatherKernel(const float* flat, int64_t ld, const int64_t* slots, int64_t len, T* out) {
  const float* src = flat + slots[blockIdx.y] * ld;
  T* dst = out + static_cast<int64_t>(blockIdx.y) * len;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * V; i < len;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * V) {
    float v[V];
    if constexpr (V == 4) {
      const float4 f = *reinterpret_cast<const float4*>(src + i);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      v[0] = src[i];
    }
#pragma unroll
    for (int k = 0; k < V; ++k) dst[i + k] = FromF<T>(v[k]);
  }
}

// One thread adds every row's element j (or 4 of them), in row order: rows
// of the same slot (the uniform layout's sequences) add one after another,
// never racing.
template <typename T, int V>
__global__ void AddKernel(const T* rows, const int64_t* slots, int64_t U, int64_t len, float* flat, int64_t ld) {
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * V; i < len;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * V) {
    for (int64_t u = 0; u < U; ++u) {
      float* dst = flat + slots[u] * ld + i;
      const T* src = rows + u * len + i;
      if constexpr (V == 4) {
        float4 f = *reinterpret_cast<float4*>(dst);
        f.x += ToF(src[0]), f.y += ToF(src[1]), f.z += ToF(src[2]), f.w += ToF(src[3]);
        *reinterpret_cast<float4*>(dst) = f;
      } else {
        dst[0] += ToF(src[0]);
      }
    }
  }
}

// 16-byte fp32 accesses need every row start aligned: the base, the row
// stride and the row length a multiple of 4 floats (T's side then is 8 or
// 16 bytes per thread, aligned too).
bool Wide(const void* flat, int64_t ld, const void* dense, int64_t len) {
  return Aligned16(flat) && Aligned16(dense) && ld % 4 == 0 && len % 4 == 0;
}

dim3 Grid(int64_t len, int64_t per, int64_t U) {
  const int64_t blocks = std::clamp<int64_t>((len / per + kThreads - 1) / kThreads, 1, 2048);
  return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(U));
}

template <typename T>
void LaunchGather(const float* flat, int64_t ld, const int64_t* slots, int64_t U, int64_t len, void* out,
                  cudaStream_t stream) {
  T* o = static_cast<T*>(out);
  if (Wide(flat, ld, out, len))
    GatherKernel<T, 4><<<Grid(len, 4, U), kThreads, 0, stream>>>(flat, ld, slots, len, o);
  else
    GatherKernel<T, 1><<<Grid(len, 1, U), kThreads, 0, stream>>>(flat, ld, slots, len, o);
}

template <typename T>
void LaunchAdd(const void* rows, const int64_t* slots, int64_t U, int64_t len, float* flat, int64_t ld,
               cudaStream_t stream) {
  const T* r = static_cast<const T*>(rows);
  if (Wide(flat, ld, rows, len))
    AddKernel<T, 4><<<Grid(len, 4, 1), kThreads, 0, stream>>>(r, slots, U, len, flat, ld);
  else
    AddKernel<T, 1><<<Grid(len, 1, 1), kThreads, 0, stream>>>(r, slots, U, len, flat, ld);
}

}  // namespace

void GatherSlotRows(bool bf16, const float* flat, int64_t ld, const int64_t* slots, int64_t U, int64_t len, void* out,
                    cudaStream_t stream) {
  if (U <= 0 || len <= 0) return;
  LOOM_DISPATCH(bf16, LaunchGather, flat, ld, slots, U, len, out, stream);
}

void AddSlotRows(bool bf16, const void* rows, const int64_t* slots, int64_t U, int64_t len, float* flat, int64_t ld,
                 cudaStream_t stream) {
  if (U <= 0 || len <= 0) return;
  LOOM_DISPATCH(bf16, LaunchAdd, rows, slots, U, len, flat, ld, stream);
}

}  // namespace loom::engine::cuda
