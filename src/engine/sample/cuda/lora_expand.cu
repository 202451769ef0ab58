// LoraExpand (lora.h): CUDA cores for fp32, tensor cores for bf16.
#include <type_traits>

#include "engine/sample/cuda/lora.h"
#include "engine/sample/cuda/lora_tile.cuh"

namespace loom::engine::cuda {

using namespace dev;

namespace {

// Calls f(std::integral_constant<int, R>) with R = a's rank when it is one
// of the common ranks and B and t rows allow 16-byte loads (kernels then
// hold a B row in registers and unroll the rank loop), else R = 0 (any
// rank, element by element). No LoRA: R = 0.
template <typename T, typename F>
void WithRank(const LoraArgs& a, F&& f) {
  constexpr int V = 16 / sizeof(T);
  if (a.B && a.rank % V == 0 && a.r_total % 4 == 0 && Aligned16(a.B) && Aligned16(a.t)) {
    switch (a.rank) {
      case 8: return f(std::integral_constant<int, 8>{});
      case 16: return f(std::integral_constant<int, 16>{});
      case 32: return f(std::integral_constant<int, 32>{});
      case 64: return f(std::integral_constant<int, 64>{});
      default: break;
    }
  }
  f(std::integral_constant<int, 0>{});
}

// delta[q] = the unrounded LoRA delta of output column c (segment seg) for
// each tile row q < n with an adapter (others: delta 0). One thread, one
// column: for each slot run the column's B row is loaded once (R > 0: into
// registers, 16 bytes at a time) and dotted with every member row's t.
template <typename T, int R>
__device__ __forceinline__ void ColumnDelta(const Lora<T>& a, const int (&s)[kRowTile], int64_t r0, int64_t c, int seg,
                                            float (&delta)[kRowTile]) {
#pragma unroll
  for (int q = 0; q < kRowTile; ++q) delta[q] = 0.0f;
  ForEachSlotRun(s, [&](int sl, unsigned members) {
    if (sl < 0) return;
    const T* b = a.B + (static_cast<int64_t>(sl) * a.d_total + c) * a.rank;
    if constexpr (R > 0) {
      constexpr int V = 16 / sizeof(T);
      float bv[R];
#pragma unroll
      for (int i = 0; i < R; i += V) LoadV<T, V>(b + i, bv + i);
#pragma unroll
      for (int q = 0; q < kRowTile; ++q) {
        if (!Member(members, q)) continue;
        const float4* t = reinterpret_cast<const float4*>(a.t + (r0 + q) * a.r_total + seg * R);
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < R / 4; ++i) {
          const float4 f = t[i];
          acc += bv[4 * i] * f.x + bv[4 * i + 1] * f.y + bv[4 * i + 2] * f.z + bv[4 * i + 3] * f.w;
        }
        delta[q] = acc;
      }
    } else {
      for (int q = 0; q < kRowTile; ++q) {
        if (!Member(members, q)) continue;
        const float* t = a.t + (r0 + q) * a.r_total + seg * a.rank;
        float acc = 0.0f;
        for (int64_t r = 0; r < a.rank; ++r) acc += ToF(b[r]) * t[r];
        delta[q] = acc;
      }
    }
  });
}

constexpr int kExpandThreads = 128;  // output columns per block of LoraExpand

// y + delta into out at `at`: fp32 unrounded (the logits), or rounded to T
// as the eager path does.
template <typename T>
__device__ __forceinline__ void StoreSum(void* out, bool out_f32, int64_t at, float y, float delta) {
  if (out_f32) {
    static_cast<float*>(out)[at] = y + delta;
  } else {
    static_cast<T*>(out)[at] = FromF<T>(AddDelta<T>(y, delta));
  }
}

// Grid (ceil(d_total / kExpandThreads), ceil(rows / kRowTile)), one thread
// per column and tile: out[r, c] = y[r, c] + delta (y null: 0 + delta),
// for rows with an adapter when out is y, for every row otherwise.
template <typename T, int R>
__global__ void LoraExpandKernel(Lora<T> a, const T* y, void* out, bool out_f32, int64_t ld, int64_t rows) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kExpandThreads + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowTile;
  const int n = static_cast<int>(min(static_cast<int64_t>(kRowTile), rows - r0));
  if (c >= a.d_total) return;
  const bool every_row = out != static_cast<const void*>(y);
  int s[kRowTile];
  TileSlots(a.slot, r0, n, s);
  const unsigned written = every_row ? (1u << n) - 1 : AdapterRows(s);
  float old[kRowTile];  // y loaded with the factors, before any store
#pragma unroll
  for (int q = 0; q < kRowTile; ++q) old[q] = y && Member(written, q) ? ToF(y[(r0 + q) * ld + c]) : 0.0f;
  float delta[kRowTile];
  ColumnDelta<T, R>(a, s, r0, c, a.Segment(c), delta);
#pragma unroll
  for (int q = 0; q < kRowTile; ++q)
    if (Member(written, q)) StoreSum<T>(out, out_f32, (r0 + q) * ld + c, old[q], delta[q]);
}

constexpr int kMmaExpandWarps = 4;
constexpr int kMmaExpandTiles = 2;  // 16-column M tiles per warp
constexpr int kMmaExpandCols = kMmaExpandWarps * kMmaExpandTiles * 16;  // columns per block

// c += the delta of output columns [cm, cm + 16) for the tile's rows (each
// slot run: B rows g and g + 8, R / 16 8-byte loads each, against t of the
// run's rows; t split into hi + lo bf16 operands, two mma per k chunk, so
// the delta keeps ~16 bits of t). Columns past d_total get 0. Segments
// (and so t's offset) change only at multiples of 16 columns.
template <int R>
__device__ __forceinline__ void MmaColumnsDelta(const Lora<bf16_t>& a, const int (&s)[kRowTile], int64_t r0,
                                                int64_t cm, float (&c)[4]) {
  static_assert(R % 16 == 0, "rank: a multiple of 16");
  constexpr int K = R / 16;
  if (cm >= a.d_total) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int seg = a.Segment(cm);
  ForEachSlotRun(s, [&](int sl, unsigned members) {
    if (sl < 0) return;
    const bool t_ok = Member(members, g);
    const bf16_t* b_lo = a.B + (static_cast<int64_t>(sl) * a.d_total + cm + g) * R + tq * 4;
    const bf16_t* b_hi = b_lo + 8 * R;
    const bool lo_ok = cm + g < a.d_total, hi_ok = cm + g + 8 < a.d_total;
    const float* tr = a.t + (r0 + g) * a.r_total + seg * R + tq * 4;
    uint2 bl[K], bh[K];
    float4 tv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      bl[k] = lo_ok ? *reinterpret_cast<const uint2*>(b_lo + 16 * k) : make_uint2(0, 0);
      bh[k] = hi_ok ? *reinterpret_cast<const uint2*>(b_hi + 16 * k) : make_uint2(0, 0);
      tv[k] = t_ok ? *reinterpret_cast<const float4*>(tr + 16 * k) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint32_t h0 = PackBf16(tv[k].x, tv[k].y), h1 = PackBf16(tv[k].z, tv[k].w);
      const __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(&h0);
      const __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(&h1);
      const uint32_t l0 = PackBf16(tv[k].x - __low2float(p0), tv[k].y - __high2float(p0));
      const uint32_t l1 = PackBf16(tv[k].z - __low2float(p1), tv[k].w - __high2float(p1));
      Mma(c, bl[k].x, bh[k].x, bl[k].y, bh[k].y, h0, h1);
      Mma(c, bl[k].x, bh[k].x, bl[k].y, bh[k].y, l0, l1);
    }
  });
}

// Grid (ceil(d_total / kMmaExpandCols), ceil(rows / kRowTile)): each warp
// adds the delta of kMmaExpandTiles 16-column tiles (MmaColumnsDelta) to
// the tile's rows, as LoraExpandKernel does one column per thread.
template <int R>
__global__ void LoraExpandMmaKernel(Lora<bf16_t> a, const bf16_t* y, void* out, bool out_f32, int64_t ld,
                                    int64_t rows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowTile;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kMmaExpandWarps + warp) * kMmaExpandTiles * 16;
  if (c0 >= a.d_total) return;
  const int n = static_cast<int>(min(static_cast<int64_t>(kRowTile), rows - r0));
  const bool every_row = out != static_cast<const void*>(y);
  int s[kRowTile];
  TileSlots(a.slot, r0, n, s);
  const unsigned written = every_row ? (1u << n) - 1 : AdapterRows(s);
  // This lane's cells: columns c0 + 16 m + AccM(g, e), rows r0 + AccRow(tq, e).
  auto cell = [&](int m, int e, int64_t* at) {
    const int q = AccRow(tq, e);
    const int64_t col = c0 + 16 * m + AccM(g, e);
    *at = (r0 + q) * ld + col;
    return Member(written, q) && col < a.d_total;
  };
  float old[kMmaExpandTiles][4];
#pragma unroll
  for (int m = 0; m < kMmaExpandTiles; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int64_t at;
      old[m][e] = 0.0f;
      if (y && cell(m, e, &at)) old[m][e] = ToF(y[at]);
    }
  float c[kMmaExpandTiles][4] = {};
#pragma unroll
  for (int m = 0; m < kMmaExpandTiles; ++m) MmaColumnsDelta<R>(a, s, r0, c0 + 16 * m, c[m]);
#pragma unroll
  for (int m = 0; m < kMmaExpandTiles; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int64_t at;
      if (cell(m, e, &at)) StoreSum<bf16_t>(out, out_f32, at, old[m][e], c[m][e]);
    }
}

// The tensor-core expand takes lora when its rank is 16, 32 or 64 and its
// segments are whole 16-column tiles.
bool MmaExpandFits(const LoraArgs& lora) {
  if (lora.rank != 16 && lora.rank != 32 && lora.rank != 64) return false;
  if (lora.r_total % 4 != 0 || !Aligned16(lora.t) || (reinterpret_cast<uintptr_t>(lora.B) & 7u) != 0) return false;
  for (int k = 0; k < kMaxSegments; ++k)
    if (lora.seg_end[k] % 16 != 0) return false;
  return true;
}

template <typename T>
void LaunchExpand(const LoraArgs& lora, const void* y, void* out, bool out_f32, int64_t ld, int64_t rows,
                  cudaStream_t stream) {
  const T* yt = static_cast<const T*>(y);
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (MmaExpandFits(lora)) {
      const dim3 grid(Blocks(lora.d_total, kMmaExpandCols), Blocks(rows, kRowTile));
      const Lora<T> a = Resolve<T>(lora);
      const unsigned threads = 32 * kMmaExpandWarps;
      switch (lora.rank) {
        case 16: return LoraExpandMmaKernel<16><<<grid, threads, 0, stream>>>(a, yt, out, out_f32, ld, rows);
        case 32: return LoraExpandMmaKernel<32><<<grid, threads, 0, stream>>>(a, yt, out, out_f32, ld, rows);
        default: return LoraExpandMmaKernel<64><<<grid, threads, 0, stream>>>(a, yt, out, out_f32, ld, rows);
      }
    }
  }
  const dim3 grid(Blocks(lora.d_total, kExpandThreads), Blocks(rows, kRowTile));
  WithRank<T>(lora, [&](auto r) {
    LoraExpandKernel<T, decltype(r)::value><<<grid, kExpandThreads, 0, stream>>>(Resolve<T>(lora), yt, out, out_f32,
                                                                                  ld, rows);
  });
}

}  // namespace

void LoraExpand(bool bf16, const LoraArgs& lora, const void* y, void* out, bool out_f32, int64_t ld, int64_t rows,
                cudaStream_t stream) {
  if (rows <= 0 || !lora.B) return;
  LOOM_DISPATCH(bf16, LaunchExpand, lora, y, out, out_f32, ld, rows, stream);
}

}  // namespace loom::engine::cuda
