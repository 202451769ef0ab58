// QkNormRopeWrite (rope.h).
#include "engine/sample/cuda/rope.h"

#include <type_traits>

#include "engine/sample/cuda/device.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

// Grid (rows, H + 2 KVH heads), hd threads; qkv's delta is added first.
template <typename T>
__global__ void QkNormRopeKernel(const T* qkv, const T* delta, const T* q_norm, const T* k_norm, const int64_t* positions,
                                 const float* inv_freq, float rope_scale, const int64_t* write_rows, T* q_out,
                                 T* k_pool, T* v_pool, int heads, int kv_heads, int hd, float eps) {
  extern __shared__ float head[];  // hd
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y, i = threadIdx.x;
  const int64_t width = static_cast<int64_t>(heads + 2 * kv_heads) * hd;
  const bool is_q = h < heads, is_k = !is_q && h < heads + kv_heads;
  const int64_t at = s * width + static_cast<int64_t>(h) * hd + i;
  float v = ToF(qkv[at]);
  if (delta) v = AddDelta<T>(v, ToF(delta[at]));
  if (!is_q && !is_k) {  // a value head: straight into the cache
    v_pool[(write_rows[s] * kv_heads + (h - heads - kv_heads)) * hd + i] = FromF<T>(v);
    return;
  }
  const T* norm_w = is_q ? q_norm : k_norm;
  if (norm_w) {
    const float inv = rsqrtf(BlockSum(v * v) / static_cast<float>(hd) + eps);
    v = Round<T>(ToF(norm_w[i]) * Round<T>(v * inv));
  }
  head[i] = v;
  __syncthreads();
  const int half = hd / 2;
  const float rot = i < half ? -head[i + half] : head[i - half];
  const float angle = static_cast<float>(positions[s]) * inv_freq[i % half];
  // YaRN scales cos and sin in fp32 before they round, as the eager tables (Rope::Make).
  const float cs = Round<T>(cosf(angle) * rope_scale), sn = Round<T>(sinf(angle) * rope_scale);
  const T out = FromF<T>(Round<T>(v * cs) + Round<T>(rot * sn));
  if (is_q) {
    q_out[(s * heads + h) * hd + i] = out;
  } else {
    k_pool[(write_rows[s] * kv_heads + (h - heads)) * hd + i] = out;
  }
}

// The same per head on one warp: lane l holds dims l + 32 j, j < E (hd =
// 32 E). With E even, dim i's rotation partner i +- hd / 2 is the same
// lane's element j +- E / 2, so a head needs no shared memory and no block
// barrier (the block form's hd threads a head and three barriers made a
// 256-row step's launch 12,288 blocks). kRopeHeads warps a block, each its
// own head of the block's row.
constexpr int kRopeHeads = 4;

template <typename T, int E>
__global__ void __launch_bounds__(32 * kRopeHeads)
    QkNormRopeWarpKernel(const T* qkv, const T* delta, const T* q_norm, const T* k_norm, const int64_t* positions,
                         const float* inv_freq, float rope_scale, const int64_t* write_rows, T* q_out, T* k_pool,
                         T* v_pool, int heads, int kv_heads, float eps) {
  static_assert(E % 2 == 0, "a head's halves on the same lanes");
  constexpr int hd = 32 * E, half = hd / 2;
  const int lane = threadIdx.x & 31;
  const int h = static_cast<int>(blockIdx.y) * kRopeHeads + static_cast<int>(threadIdx.x >> 5);
  if (h >= heads + 2 * kv_heads) return;  // the whole warp
  const int64_t s = blockIdx.x;
  const int64_t width = static_cast<int64_t>(heads + 2 * kv_heads) * hd;
  const bool is_q = h < heads, is_k = !is_q && h < heads + kv_heads;
  const int64_t at = s * width + static_cast<int64_t>(h) * hd + lane;
  float v[E];
#pragma unroll
  for (int j = 0; j < E; ++j) {
    v[j] = ToF(qkv[at + 32 * j]);
    if (delta) v[j] = AddDelta<T>(v[j], ToF(delta[at + 32 * j]));
  }
  if (!is_q && !is_k) {  // a value head: straight into the cache
    T* dst = v_pool + (write_rows[s] * kv_heads + (h - heads - kv_heads)) * hd + lane;
#pragma unroll
    for (int j = 0; j < E; ++j) dst[32 * j] = FromF<T>(v[j]);
    return;
  }
  const T* norm_w = is_q ? q_norm : k_norm;
  if (norm_w) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < E; ++j) ss += v[j] * v[j];
    const float inv = rsqrtf(WarpSum(ss) / static_cast<float>(hd) + eps);
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] = Round<T>(ToF(norm_w[lane + 32 * j]) * Round<T>(v[j] * inv));
  }
  const float pos = static_cast<float>(positions[s]);
  T* dst = is_q ? q_out + (s * heads + h) * hd + lane : k_pool + (write_rows[s] * kv_heads + (h - heads)) * hd + lane;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int i = lane + 32 * j;
    const float rot = j < E / 2 ? -v[j + E / 2] : v[j - E / 2];
    const float angle = pos * inv_freq[i % half];
    const float cs = Round<T>(cosf(angle) * rope_scale), sn = Round<T>(sinf(angle) * rope_scale);
    dst[32 * j] = FromF<T>(Round<T>(v[j] * cs) + Round<T>(rot * sn));
  }
}

template <typename T>
void LaunchQkNormRope(const void* qkv, const void* delta, const void* q_norm, const void* k_norm,
                      const int64_t* positions, const float* inv_freq, float rope_scale, const int64_t* write_rows,
                      void* q_out, void* k_pool, void* v_pool, int64_t rows, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, float eps, cudaStream_t stream) {
  const int64_t all = heads + 2 * kv_heads;
  auto warp_form = [&](auto e) {
    constexpr int E = decltype(e)::value;
    const dim3 grid(static_cast<unsigned>(rows), Blocks(all, kRopeHeads));
    QkNormRopeWarpKernel<T, E><<<grid, 32 * kRopeHeads, 0, stream>>>(
        static_cast<const T*>(qkv), static_cast<const T*>(delta), static_cast<const T*>(q_norm),
        static_cast<const T*>(k_norm), positions, inv_freq, rope_scale, write_rows, static_cast<T*>(q_out),
        static_cast<T*>(k_pool), static_cast<T*>(v_pool), static_cast<int>(heads), static_cast<int>(kv_heads), eps);
  };
  switch (head_dim) {
    case 64: return warp_form(std::integral_constant<int, 2>{});
    case 128: return warp_form(std::integral_constant<int, 4>{});
    case 256: return warp_form(std::integral_constant<int, 8>{});
    default: break;  // any other width: a block of hd threads a head
  }
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(all));
  QkNormRopeKernel<T><<<grid, static_cast<unsigned>(head_dim), static_cast<size_t>(head_dim) * sizeof(float), stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(delta), static_cast<const T*>(q_norm),
      static_cast<const T*>(k_norm), positions, inv_freq, rope_scale, write_rows, static_cast<T*>(q_out),
      static_cast<T*>(k_pool), static_cast<T*>(v_pool), static_cast<int>(heads), static_cast<int>(kv_heads),
      static_cast<int>(head_dim), eps);
}

}  // namespace

void QkNormRopeWrite(bool bf16, const void* qkv, const void* qkv_delta, const void* q_norm, const void* k_norm,
                     const int64_t* positions, const float* inv_freq, float rope_scale, const int64_t* write_rows,
                     void* q_out, void* k_pool, void* v_pool, int64_t rows, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  LOOM_DISPATCH(bf16, LaunchQkNormRope, qkv, qkv_delta, q_norm, k_norm, positions, inv_freq, rope_scale, write_rows,
                q_out, k_pool, v_pool, rows, heads, kv_heads, head_dim, eps, stream);
}

}  // namespace loom::engine::cuda
