// decode_kernels: GPU time of each fused decode kernel (src/engine/sample/cuda,
// one family per .cu) alone, at the shapes of the qwen3-4b preset, with and
// without LoRA, next to cuBLAS for the base projections of the same rows.
// Built with the GPU build (build-gpu/bench/decode_kernels); run:
//
//   build-gpu/bench/decode_kernels [rows...]      (default: 1 64)
//
// Every kernel runs once per layer over 36 layers' own buffers (so the
// adapters' factors come from memory, not L2, as in a decode step), 4 times,
// captured in one CUDA graph; the figure is µs per launch over 20 replays
// (DECODE_KERNELS_REPLAYS=n: n).
// LoRA: 8 slots (DECODE_KERNELS_SLOTS=n: n), rank 32, rows sorted by slot (as the sampler orders them).
// `cublas || lora X`: projection X's GEMM with its LoRA (shrink, expand)
// on a forked branch, as the sampler's step runs them; `lora, cublas X`:
// the same one after the other. Where the two are equal, nothing overlaps.
// `(split)`: the shrink splits a long d_in over several blocks per output
// tile (k::ShrinkScratch), as the sampler's step does by default.
// `attn ctx C dims|tokens`: DecodeAttention of every row over C tokens of
// its paged K/V (blocks scattered), in each k::AttentionForm, with the two
// forms' largest difference printed after the table
// (DECODE_KERNELS_CTX="C ...": other context lengths).
// DECODE_KERNELS_LT=1: also each base projection over 36 layers' own
// weights (out of L2, as in a step) through cublasGemmEx (what at::linear
// runs) and through cuBLASLt as --decode-gemm tuned runs it (k::LtGemm: the
// heuristic's candidates timed, its first pick kept unless another is 3%
// faster).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "engine/sample/cuda/attention.h"
#include "engine/model/cuda/gemv.h"
#include "engine/sample/cuda/lora.h"
#include "engine/sample/cuda/lt_gemm.h"
#include "engine/sample/cuda/rmsnorm.h"
#include "engine/sample/cuda/rope.h"
#include "engine/sample/cuda/silu.h"

namespace {

namespace k = loom::engine::cuda;
using bf16 = __nv_bfloat16;

constexpr int kLayers = 36, kHidden = 2560, kHeads = 32, kKvHeads = 8, kHeadDim = 128, kInter = 9728;
constexpr int kVocab = 151936, kRank = 32, kRepeats = 4, kMaxRows = 512;
constexpr int kKvBlock = 16;  // the sampler's KV block (tokens)
// Timed replays per kernel; DECODE_KERNELS_REPLAYS overrides (profilers: 1).
int replays = 20;
// Adapter slots the rows spread over; DECODE_KERNELS_SLOTS overrides (the RL
// loop's 256-row step: 16).
int num_slots = 8;

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// n random bf16 in [-scale, scale).
bf16* Random(size_t n, float scale, std::mt19937& rng) {
  std::vector<bf16> h(n);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (auto& v : h) v = __float2bfloat16(u(rng));
  bf16* d = nullptr;
  Check(cudaMalloc(&d, n * sizeof(bf16)), "cudaMalloc");
  Check(cudaMemcpy(d, h.data(), n * sizeof(bf16), cudaMemcpyHostToDevice), "cudaMemcpy");
  return d;
}

template <typename T>
T* Zeros(size_t n) {
  T* d = nullptr;
  Check(cudaMalloc(&d, n * sizeof(T)), "cudaMalloc");
  Check(cudaMemset(d, 0, n * sizeof(T)), "cudaMemset");
  return d;
}

// One LoRA group of one layer: A [slots, r_total, d_in], B [slots, d_total, rank].
struct Group {
  int64_t d_in, r_total, d_total;
  std::vector<int64_t> seg;
  bf16 *A, *B;
};

// µs per launch of fn(layer, stream), captured kLayers * kRepeats times.
double Time(cudaStream_t st, const std::function<void(int, cudaStream_t)>& fn) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  Check(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
  for (int r = 0; r < kRepeats; ++r)
    for (int l = 0; l < kLayers; ++l) fn(l, st);
  Check(cudaStreamEndCapture(st, &graph), "end capture");
  Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  Check(cudaGraphLaunch(exec, st), "warm up");
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, st);
  for (int i = 0; i < replays; ++i) cudaGraphLaunch(exec, st);
  cudaEventRecord(b, st);
  Check(cudaEventSynchronize(b), "replay");
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return ms * 1e3 / (replays * kRepeats * kLayers);
}

// The base projection y [rows, n] = x [rows, kd] w^T over 36 layers' own
// weights: cublasGemmEx (what at::linear calls), then cuBLASLt's candidates
// for the shape as the sampler's --decode-gemm tuned times them
// (k::LtGemm); prints µs per launch of each.
void LtSweep(cudaStream_t st, cublasHandle_t blas, const char* name, int rows, int n, int kd,
             const std::vector<bf16*>& w, const bf16* x, bf16* y) {
  const float one = 1.0f, zero = 0.0f;
  cublasSetStream(blas, st);
  const double gemmex = Time(st, [&](int l, cudaStream_t s) {
    cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, kd, &one, w[l], CUDA_R_16BF, kd, x, CUDA_R_16BF, kd, &zero,
                 y, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  });
  k::LtGemm lt;
  const std::vector<const void*> ws(w.begin(), w.end());
  std::string line;
  const bool tuned = lt.Tune(rows, n, kd, ws, x, y, st, &line);
  const double chosen = tuned ? Time(st, [&](int l, cudaStream_t s) { lt.Run(x, w[l], y, rows, n, kd, s); }) : 0.0;
  std::printf("  lt %-8s gemmex %8.2f, tuned %8.2f (%s)\n", name, gemmex, chosen,
              tuned ? line.c_str() : "no algorithm");
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* r = std::getenv("DECODE_KERNELS_REPLAYS")) replays = std::max(1, std::atoi(r));
  if (const char* s = std::getenv("DECODE_KERNELS_SLOTS")) num_slots = std::max(1, std::atoi(s));
  const bool lt_sweep = std::getenv("DECODE_KERNELS_LT") != nullptr && std::atoi(std::getenv("DECODE_KERNELS_LT")) != 0;
  std::vector<int> row_counts;
  for (int i = 1; i < argc; ++i) row_counts.push_back(std::atoi(argv[i]));
  if (row_counts.empty()) row_counts = {1, 64};
  std::mt19937 rng(1);
  cudaStream_t st;
  Check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  cublasHandle_t blas;
  cublasCreate(&blas);
  cublasSetStream(blas, st);

  const int qkv_width = (kHeads + 2 * kKvHeads) * kHeadDim;
  // Per layer: qkv, o, gate_up, down; and lm_head's.
  std::vector<std::vector<Group>> groups(kLayers);
  auto make = [&](int64_t d_in, std::vector<int64_t> outs) {
    Group g{d_in, kRank * static_cast<int64_t>(outs.size()), 0, {}, nullptr, nullptr};
    for (int64_t o : outs) g.seg.push_back(g.d_total += o);
    g.A = Random(static_cast<size_t>(num_slots * g.r_total * d_in), 0.02f, rng);
    g.B = Random(static_cast<size_t>(num_slots * g.d_total * kRank), 0.02f, rng);
    return g;
  };
  for (auto& l : groups) {
    l.push_back(make(kHidden, {kHeads * kHeadDim, kKvHeads * kHeadDim, kKvHeads * kHeadDim}));
    l.push_back(make(kHeads * kHeadDim, {kHidden}));
    l.push_back(make(kHidden, {kInter, kInter}));
    l.push_back(make(kInter, {kHidden}));
  }
  const Group head = make(kHidden, {kVocab});
  // Base weights of one layer (cuBLAS reference; weights of 36 layers would
  // not change a bandwidth-bound GEMM's time per byte).
  bf16* w_qkv = Random(static_cast<size_t>(qkv_width) * kHidden, 0.02f, rng);
  bf16* w_o = Random(static_cast<size_t>(kHidden) * kHeads * kHeadDim, 0.02f, rng);
  bf16* w_gu = Random(static_cast<size_t>(2 * kInter) * kHidden, 0.02f, rng);
  bf16* w_down = Random(static_cast<size_t>(kHidden) * kInter, 0.02f, rng);
  bf16* norm_w = Random(kHidden, 1.0f, rng);
  bf16* qk_norm = Random(kHeadDim, 1.0f, rng);

  bf16* x = Random(static_cast<size_t>(kMaxRows) * kInter, 1.0f, rng);
  bf16* x2 = Random(static_cast<size_t>(kMaxRows) * kInter, 1.0f, rng);
  bf16* y = Random(static_cast<size_t>(kMaxRows) * kVocab, 1.0f, rng);
  bf16* q_out = Zeros<bf16>(static_cast<size_t>(kMaxRows) * kHeads * kHeadDim);
  const int64_t pool_rows = kMaxRows + 1;
  bf16* k_pool = Zeros<bf16>(static_cast<size_t>(pool_rows) * kKvHeads * kHeadDim);
  bf16* v_pool = Zeros<bf16>(static_cast<size_t>(pool_rows) * kKvHeads * kHeadDim);
  float* logits = Zeros<float>(static_cast<size_t>(kMaxRows) * kVocab);
  bf16* delta = Zeros<bf16>(static_cast<size_t>(kMaxRows) * 2 * kInter);
  float* t = Zeros<float>(static_cast<size_t>(kMaxRows) * 3 * kRank);
  const int64_t tickets = static_cast<int64_t>(kMaxRows) * ((3 * kRank + 15) / 16);
  const k::ShrinkScratch split{Zeros<float>(static_cast<size_t>(kMaxRows) * 8 * kRank), int64_t{kMaxRows} * 8 * kRank,
                               Zeros<int>(static_cast<size_t>(tickets)), tickets};
  float* scale = Zeros<float>(num_slots);
  std::vector<float> ones(num_slots, 1.0f);
  cudaMemcpy(scale, ones.data(), sizeof(float) * num_slots, cudaMemcpyHostToDevice);
  std::vector<float> inv_freq_h(kHeadDim / 2);
  for (int i = 0; i < kHeadDim / 2; ++i) inv_freq_h[i] = std::pow(1e6f, -2.0f * i / kHeadDim);
  float* inv_freq = Zeros<float>(kHeadDim / 2);
  cudaMemcpy(inv_freq, inv_freq_h.data(), sizeof(float) * inv_freq_h.size(), cudaMemcpyHostToDevice);
  int64_t* positions = Zeros<int64_t>(kMaxRows);
  std::vector<int64_t> rows_h(kMaxRows);
  for (int i = 0; i < kMaxRows; ++i) rows_h[i] = i;
  int64_t* write_rows = Zeros<int64_t>(kMaxRows);
  cudaMemcpy(write_rows, rows_h.data(), sizeof(int64_t) * kMaxRows, cudaMemcpyHostToDevice);
  int32_t* slots = Zeros<int32_t>(kMaxRows);
  int32_t* no_slots = Zeros<int32_t>(kMaxRows);
  std::vector<int32_t> minus(kMaxRows, -1);
  cudaMemcpy(no_slots, minus.data(), sizeof(int32_t) * kMaxRows, cudaMemcpyHostToDevice);

  auto args = [&](const Group& g, const int32_t* slot) {
    k::LoraArgs a;
    a.B = g.B;
    a.t = t;
    a.slot = slot;
    a.rank = kRank;
    a.r_total = g.r_total;
    a.d_total = g.d_total;
    for (size_t i = 0; i < g.seg.size(); ++i) a.seg_end[i] = g.seg[i];
    return a;
  };
  auto gemm = [&](int rows, const bf16* w, int n, int kd, bf16* out, cudaStream_t s) {
    const float one = 1.0f, zero = 0.0f;
    cublasSetStream(blas, s);
    cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, kd, &one, w, CUDA_R_16BF, kd, x, CUDA_R_16BF, kd, &zero, out,
                 CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };

  // Correctness first: shrink and expand of layer 0's q, k, v against the
  // host, 13 rows over two tiles with slots scattered and one base row.
  {
    const int rows = 13;
    const Group& g = groups[0][0];
    std::vector<int32_t> sl(rows);
    for (int r = 0; r < rows; ++r) sl[r] = r == 5 ? -1 : (r * 5) % 3;
    cudaMemcpy(slots, sl.data(), sizeof(int32_t) * rows, cudaMemcpyHostToDevice);
    auto host = [](const bf16* d, size_t n) {
      std::vector<bf16> h(n);
      cudaMemcpy(h.data(), d, n * sizeof(bf16), cudaMemcpyDeviceToHost);
      std::vector<float> f(n);
      for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(h[i]);
      return f;
    };
    const std::vector<float> hx = host(x, static_cast<size_t>(rows) * g.d_in);
    const std::vector<float> hA = host(g.A, static_cast<size_t>(num_slots) * g.r_total * g.d_in);
    const std::vector<float> hB = host(g.B, static_cast<size_t>(num_slots) * g.d_total * kRank);
    const std::vector<float> hy = host(y, static_cast<size_t>(rows) * g.d_total);
    k::LoraShrink(true, x, g.d_in, g.A, slots, scale, t, rows, g.d_in, g.r_total, st);
    std::vector<float> ht(static_cast<size_t>(rows) * g.r_total);
    cudaMemcpyAsync(ht.data(), t, ht.size() * sizeof(float), cudaMemcpyDeviceToHost, st);
    k::LoraExpand(true, args(g, slots), y, y, false, g.d_total, rows, st);
    Check(cudaStreamSynchronize(st), "check");
    const std::vector<float> hy2 = host(y, static_cast<size_t>(rows) * g.d_total);
    double t_err = 0, y_err = 0, y_scale = 0;
    for (int r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < g.r_total; ++j) {
        double ref = 0;
        if (sl[r] >= 0)
          for (int64_t i = 0; i < g.d_in; ++i) ref += double(hx[r * g.d_in + i]) * hA[(sl[r] * g.r_total + j) * g.d_in + i];
        t_err = std::max(t_err, std::abs(ref - ht[r * g.r_total + j]));
      }
      for (int64_t c = 0; c < g.d_total; ++c) {
        double delta = 0;
        const int seg = c < g.seg[0] ? 0 : c < g.seg[1] ? 1 : 2;
        if (sl[r] >= 0)
          for (int q = 0; q < kRank; ++q)
            delta += double(hB[(sl[r] * g.d_total + c) * kRank + q]) * ht[r * g.r_total + seg * kRank + q];
        const double ref = hy[r * g.d_total + c] + delta;
        y_err = std::max(y_err, std::abs(ref - hy2[r * g.d_total + c]));
        y_scale = std::max(y_scale, std::abs(ref));
      }
    }
    std::printf("check (13 rows, scattered slots): shrink max |err| %.3g, expand max |err| %.3g (|y| <= %.3g)\n",
                t_err, y_err, y_scale);
    // The delta alone (y null), added by the consumer, against the expand
    // in place: the same cells.
    const Group& gu = groups[0][2];
    const size_t cells = static_cast<size_t>(rows) * kInter;
    k::LoraShrink(true, x, gu.d_in, gu.A, slots, scale, t, rows, gu.d_in, gu.r_total, st);
    k::LoraExpand(true, args(gu, slots), nullptr, delta, false, gu.d_total, rows, st);
    k::SiluMul(true, y, delta, x2, rows, kInter, st);
    Check(cudaStreamSynchronize(st), "check silu");
    const std::vector<float> consumer = host(x2, cells);
    k::LoraExpand(true, args(gu, slots), y, y, false, gu.d_total, rows, st);
    k::SiluMul(true, y, nullptr, x2, rows, kInter, st);
    Check(cudaStreamSynchronize(st), "check silu");
    const std::vector<float> in_place = host(x2, cells);
    double s_err = 0;
    for (size_t i = 0; i < cells; ++i) s_err = std::max(s_err, double(std::abs(consumer[i] - in_place[i])));
    std::printf("check: SiluMul adding the delta vs LoraExpand in place + SiluMul: max |diff| %.3g\n", s_err);
    // down's shrink (d_in 9728) split over blocks, twice (the tickets must
    // be left 0 for the second), against the host.
    const Group& dn = groups[0][3];
    const std::vector<float> hxd = host(x, static_cast<size_t>(rows) * dn.d_in);
    const std::vector<float> hAd = host(dn.A, static_cast<size_t>(num_slots) * dn.r_total * dn.d_in);
    for (int pass = 0; pass < 2; ++pass) {
      Check(cudaMemsetAsync(t, 0xff, sizeof(float) * rows * dn.r_total, st), "clear t");
      const int parts = k::LoraShrink(true, x, dn.d_in, dn.A, slots, scale, t, rows, dn.d_in, dn.r_total, st, &split);
      std::vector<float> htd(static_cast<size_t>(rows) * dn.r_total);
      Check(cudaMemcpyAsync(htd.data(), t, htd.size() * sizeof(float), cudaMemcpyDeviceToHost, st), "copy t");
      Check(cudaStreamSynchronize(st), "check split");
      double d_err = 0, d_scale = 0;
      for (int r = 0; r < rows; ++r)
        for (int64_t j = 0; j < dn.r_total; ++j) {
          double ref = 0;
          if (sl[r] >= 0)
            for (int64_t i = 0; i < dn.d_in; ++i)
              ref += double(hxd[r * dn.d_in + i]) * hAd[(sl[r] * dn.r_total + j) * dn.d_in + i];
          d_err = std::max(d_err, std::abs(ref - htd[r * dn.r_total + j]));
          d_scale = std::max(d_scale, std::abs(ref));
        }
      std::printf("check down, shrink split in %d parts, pass %d: max |err| %.3g (|t| <= %.3g)\n", parts, pass + 1,
                  d_err, d_scale);
    }
  }

  cudaStream_t side;
  Check(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "stream");
  cudaEvent_t fork, join;
  cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
  // main(s) with lora(side) on a branch forked from s and joined back, as
  // the sampler's graph runs a projection beside its LoRA.
  auto forked = [&](cudaStream_t s, const std::function<void(cudaStream_t)>& main,
                    const std::function<void(cudaStream_t)>& lora) {
    cudaEventRecord(fork, s);
    cudaStreamWaitEvent(side, fork, 0);
    lora(side);
    cudaEventRecord(join, side);
    main(s);
    cudaStreamWaitEvent(s, join, 0);
  };

  // Context lengths of the attention rows (DECODE_KERNELS_CTX="64 192 320" by default).
  std::vector<int> contexts = {64, 192, 320};
  if (const char* c = std::getenv("DECODE_KERNELS_CTX")) {
    contexts.clear();
    for (const char* p = c; *p;) {
      char* end = nullptr;
      const long v = std::strtol(p, &end, 10);
      if (end == p) break;
      if (v > 0) contexts.push_back(static_cast<int>(v));
      p = end;
    }
  }
  std::vector<std::string> attn_checks;
  std::printf("decode kernels, qwen3-4b shapes, LoRA rank %d, %d slots, us per launch\n", kRank, num_slots);
  for (int rows : row_counts) {
    if (rows < 1 || rows > kMaxRows) continue;
    // Rows sorted by slot, as the sampler orders them: row r of rows gets slot r * slots / rows.
    std::vector<int32_t> sl(rows);
    for (int r = 0; r < rows; ++r) sl[r] = rows >= num_slots ? r * num_slots / rows : r % num_slots;
    cudaMemcpy(slots, sl.data(), sizeof(int32_t) * rows, cudaMemcpyHostToDevice);
    std::vector<std::pair<std::string, double>> out;
    auto run = [&](const char* name, const std::function<void(int, cudaStream_t)>& fn) {
      out.emplace_back(name, Time(st, fn));
    };
    const char* names[] = {"qkv", "o", "gate_up", "down"};
    const int outs[] = {qkv_width, kHidden, 2 * kInter, kHidden};
    const bf16* ws[] = {w_qkv, w_o, w_gu, w_down};
    for (int g = 0; g < 4; ++g) {
      const std::string n = names[g];
      const int64_t d_in = groups[0][g].d_in;
      run(("cublas " + n).c_str(), [&, g](int, cudaStream_t s) { gemm(rows, ws[g], outs[g], d_in, y, s); });
      if (rows <= k::kGemvMaxRows)
        run(("gemv " + n).c_str(), [&, g](int, cudaStream_t s) {
          k::Gemv(true, x, d_in, ws[g], nullptr, y, false, rows, outs[g], d_in, s);
        });
      // Layer l's shrink of this projection (sp: split over blocks).
      auto shrink = [&, g](int l, cudaStream_t s, const k::ShrinkScratch* sp) {
        const Group& gr = groups[l][g];
        k::LoraShrink(true, x, gr.d_in, gr.A, slots, scale, t, rows, gr.d_in, gr.r_total, s, sp);
      };
      run(("shrink " + n).c_str(), [&](int l, cudaStream_t s) { shrink(l, s, nullptr); });
      run(("expand " + n + " (delta)").c_str(), [&, g](int l, cudaStream_t s) {
        k::LoraExpand(true, args(groups[l][g], slots), nullptr, delta, false, groups[l][g].d_total, rows, s);
      });
      // The step's critical path for this projection: the GEMM beside its
      // LoRA branch (forked and joined, as fast_decode runs them), and the
      // same one after the other on one stream.
      auto lora = [&, g](int l, cudaStream_t s, const k::ShrinkScratch* sp) {
        shrink(l, s, sp);
        k::LoraExpand(true, args(groups[l][g], slots), nullptr, delta, false, groups[l][g].d_total, rows, s);
      };
      auto base = [&, g](cudaStream_t s) { gemm(rows, ws[g], outs[g], d_in, y, s); };
      run(("cublas || lora " + n).c_str(),
          [&](int l, cudaStream_t s) { forked(s, base, [&](cudaStream_t b) { lora(l, b, nullptr); }); });
      run(("lora, cublas " + n).c_str(), [&](int l, cudaStream_t s) {
        lora(l, s, nullptr);
        base(s);
      });
      if (d_in > kHidden) {
        run(("shrink " + n + " (split)").c_str(), [&](int l, cudaStream_t s) { shrink(l, s, &split); });
        run(("cublas || lora " + n + " (split)").c_str(),
            [&](int l, cudaStream_t s) { forked(s, base, [&](cudaStream_t b) { lora(l, b, &split); }); });
      }
    }
    run("shrink head", [&](int, cudaStream_t s) {
      k::LoraShrink(true, x, kHidden, head.A, slots, scale, t, rows, kHidden, head.r_total, s);
    });
    run("expand head (to f32)", [&](int, cudaStream_t s) {
      k::LoraExpand(true, args(head, slots), y, logits, true, kVocab, rows, s);
    });
    run("silu", [&](int, cudaStream_t s) { k::SiluMul(true, y, nullptr, x2, rows, kInter, s); });
    run("silu + delta", [&](int, cudaStream_t s) { k::SiluMul(true, y, delta, x2, rows, kInter, s); });
    auto rope = [&](const bf16* d, cudaStream_t s) {
      k::QkNormRopeWrite(true, y, d, qk_norm, qk_norm, positions, inv_freq, 1.0f, write_rows, q_out, k_pool, v_pool,
                         rows, kHeads, kKvHeads, kHeadDim, 1e-6f, s);
    };
    run("rope", [&](int, cudaStream_t s) { rope(nullptr, s); });
    run("rope + delta", [&](int, cudaStream_t s) { rope(delta, s); });
    run("expand qkv, base rows", [&](int l, cudaStream_t s) {
      k::LoraExpand(true, args(groups[l][0], no_slots), nullptr, delta, false, groups[l][0].d_total, rows, s);
    });
    run("norm (x + add)", [&](int, cudaStream_t s) {
      k::RmsNorm(true, x2, y, nullptr, x2, norm_w, x, rows, kHidden, 1e-6f, s);
    });
    run("norm (x + add + delta)", [&](int, cudaStream_t s) {
      k::RmsNorm(true, x2, y, delta, x2, norm_w, x, rows, kHidden, 1e-6f, s);
    });
    // Attention over each context length, both forms (kTokens where
    // TokenLanesApply, else it is kDims again), and how far apart they are.
    for (int ctx : contexts) {
      const int width = (ctx + kKvBlock - 1) / kKvBlock;
      const int64_t blocks = static_cast<int64_t>(rows) * width;
      std::vector<int32_t> tab(static_cast<size_t>(blocks));
      for (int64_t i = 0; i < blocks; ++i) tab[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7) % blocks);
      int32_t* table = Zeros<int32_t>(static_cast<size_t>(blocks));
      std::vector<int32_t> lens(static_cast<size_t>(rows), ctx);
      int32_t* ctx_len = Zeros<int32_t>(static_cast<size_t>(rows));
      cudaMemcpy(table, tab.data(), sizeof(int32_t) * tab.size(), cudaMemcpyHostToDevice);
      cudaMemcpy(ctx_len, lens.data(), sizeof(int32_t) * lens.size(), cudaMemcpyHostToDevice);
      // Two pools, alternated by layer: a step's K/V comes from memory, not L2.
      const size_t pool = static_cast<size_t>(blocks) * kKvBlock * kKvHeads * kHeadDim;
      bf16* kp[2] = {Random(pool, 1.0f, rng), Random(pool, 1.0f, rng)};
      bf16* vp[2] = {Random(pool, 1.0f, rng), Random(pool, 1.0f, rng)};
      bf16* outs[2] = {Zeros<bf16>(static_cast<size_t>(rows) * kHeads * kHeadDim),
                       Zeros<bf16>(static_cast<size_t>(rows) * kHeads * kHeadDim)};
      const k::AttentionForm forms[2] = {k::AttentionForm::kDims, k::AttentionForm::kTokens};
      for (int f = 0; f < 2; ++f) {
        const std::string n = "attn ctx " + std::to_string(ctx) + (f == 0 ? " dims" : " tokens");
        run(n.c_str(), [&, f](int l, cudaStream_t s) {
          k::DecodeAttention(true, x, kp[l % 2], vp[l % 2], table, width, ctx_len, kKvBlock, outs[f], rows, kHeads,
                             kKvHeads, kHeadDim, s, forms[f]);
        });
      }
      const size_t n_out = static_cast<size_t>(rows) * kHeads * kHeadDim;
      std::vector<bf16> a(n_out), b(n_out);
      Check(cudaStreamSynchronize(st), "attention");
      cudaMemcpy(a.data(), outs[0], n_out * sizeof(bf16), cudaMemcpyDeviceToHost);
      cudaMemcpy(b.data(), outs[1], n_out * sizeof(bf16), cudaMemcpyDeviceToHost);
      double diff = 0;
      for (size_t i = 0; i < n_out; ++i)
        diff = std::max(diff, std::abs(double(__bfloat162float(a[i])) - __bfloat162float(b[i])));
      attn_checks.push_back("rows " + std::to_string(rows) + " ctx " + std::to_string(ctx) + ": tokens form " +
                            (k::TokenLanesApply(true, rows, kHeads, kKvHeads, kHeadDim) ? "runs" : "falls back") +
                            ", max |dims - tokens| " + std::to_string(diff));
      for (void* p : {static_cast<void*>(table), static_cast<void*>(ctx_len), static_cast<void*>(kp[0]),
                      static_cast<void*>(kp[1]), static_cast<void*>(vp[0]), static_cast<void*>(vp[1]),
                      static_cast<void*>(outs[0]), static_cast<void*>(outs[1])})
        cudaFree(p);
    }
    std::printf("\nrows %d\n", rows);
    for (const auto& [name, us] : out) std::printf("  %-24s %8.2f\n", name.c_str(), us);
    for (const std::string& c : attn_checks) std::printf("  check: %s\n", c.c_str());
    attn_checks.clear();
    if (lt_sweep) {
      const char* lt_names[] = {"qkv", "o", "gate_up", "down"};
      const int lt_n[] = {qkv_width, kHidden, 2 * kInter, kHidden};
      const int lt_k[] = {kHidden, kHeads * kHeadDim, kHidden, kInter};
      for (int g = 0; g < 4; ++g) {
        // One random layer copied into 36 buffers: the same values at 36 addresses, none in L2.
        const size_t elems = static_cast<size_t>(lt_n[g]) * lt_k[g];
        std::vector<bf16*> w(kLayers);
        w[0] = Random(elems, 0.02f, rng);
        for (int l = 1; l < kLayers; ++l) {
          w[l] = Zeros<bf16>(elems);
          cudaMemcpy(w[l], w[0], elems * sizeof(bf16), cudaMemcpyDeviceToDevice);
        }
        LtSweep(st, blas, lt_names[g], rows, lt_n[g], lt_k[g], w, x, y);
        for (bf16* p : w) cudaFree(p);
      }
    }
  }
  Check(cudaDeviceSynchronize(), "sync");
  return 0;
}
