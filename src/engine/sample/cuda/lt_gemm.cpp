#include "engine/sample/cuda/lt_gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

namespace loom::engine::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr int kCandidates = 16;  // the heuristic's algorithms tried a shape
constexpr int kTimedRuns = 36;   // a timed run per layer of a qwen3-4b step

// The largest power of two up to 256 that divides the address (cuBLASLt's
// algorithms assume 256 unless told less).
uint32_t Alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

cublasLtHandle_t H(void* p) { return static_cast<cublasLtHandle_t>(p); }
cublasLtMatmulDesc_t D(void* p) { return static_cast<cublasLtMatmulDesc_t>(p); }

}  // namespace

// A tuned shape: its operand layouts (column-major, as cuBLASLt reads the
// row-major operands: W^T [k, n] transposed, x^T [k, rows], y^T [n, rows])
// and the chosen algorithm.
struct LtGemm::Shape {
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  uint32_t align = 256;  // the operands' alignment the algorithm was chosen for
  bool has_algo = false;
  ~Shape() {
    for (cublasLtMatrixLayout_t l : {a, b, c})
      if (l) cublasLtMatrixLayoutDestroy(l);
  }
};

LtGemm::LtGemm() {
  cublasLtHandle_t h = nullptr;
  if (cublasLtCreate(&h) != CUBLAS_STATUS_SUCCESS) return;
  handle_ = h;
  cublasLtMatmulDesc_t d = nullptr;
  if (cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return;
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
  desc_ = d;
  if (cudaMalloc(&workspace_, kWorkspaceBytes) != cudaSuccess) workspace_ = nullptr;
}

LtGemm::~LtGemm() {
  shapes_.clear();
  if (workspace_) cudaFree(workspace_);
  if (desc_) cublasLtMatmulDescDestroy(D(desc_));
  if (handle_) cublasLtDestroy(H(handle_));
}

bool LtGemm::Tune(int64_t rows, int64_t n, int64_t k, const std::vector<const void*>& ws, const void* x, void* y,
                  cudaStream_t stream, std::string* line, const std::function<bool(size_t)>& baseline) {
  const Key key{rows, n, k};
  if (auto it = shapes_.find(key); it != shapes_.end()) return it->second->has_algo;
  auto shape = std::make_unique<Shape>();
  Shape& s = *shape;
  shapes_.emplace(key, std::move(shape));
  if (!handle_ || !desc_ || !workspace_ || ws.empty() || !x || !y || rows <= 0 || n <= 0 || k <= 0) return false;
  if (cublasLtMatrixLayoutCreate(&s.a, CUDA_R_16BF, k, n, k) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&s.b, CUDA_R_16BF, k, rows, k) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&s.c, CUDA_R_16BF, n, rows, n) != CUBLAS_STATUS_SUCCESS)
    return false;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return false;
  size_t ws_bytes = kWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes);
  // Candidates that work at the operands' alignment (Run refuses less).
  s.align = std::min(Alignment(x), Alignment(y));
  for (const void* w : ws) s.align = std::min(s.align, Alignment(w));
  for (const cublasLtMatmulPreferenceAttributes_t a :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    cublasLtMatmulPreferenceSetAttribute(pref, a, &s.align, sizeof s.align);
  cublasLtMatmulHeuristicResult_t found[kCandidates];
  int count = 0;
  const cublasStatus_t heuristic =
      cublasLtMatmulAlgoGetHeuristic(H(handle_), D(desc_), s.a, s.b, s.c, s.c, pref, kCandidates, found, &count);
  cublasLtMatmulPreferenceDestroy(pref);
  if (heuristic != CUBLAS_STATUS_SUCCESS || count <= 0) return false;

  cudaEvent_t start = nullptr, stop = nullptr;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  // Microseconds a launch of launch(i) (on ws[i]), the runs cycling
  // through ws; a negative value when it did not run.
  auto time = [&](const auto& launch) {
    if (!launch(size_t{0})) return -1.0;
    cudaEventRecord(start, stream);
    for (int r = 0; r < kTimedRuns; ++r)
      if (!launch(static_cast<size_t>(r) % ws.size())) return -1.0;
    cudaEventRecord(stop, stream);
    if (cudaEventSynchronize(stop) != cudaSuccess) return -1.0;
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    return static_cast<double>(ms) * 1e3 / kTimedRuns;
  };
  // chosen: -2 none yet, -1 the baseline, else the candidate's index.
  double first = -1, best = -1, base = -1;
  int chosen = -2;
  if (baseline) {
    base = time(baseline);
    if (base >= 0) best = base, chosen = -1;
  }
  for (int i = 0; i < count; ++i) {
    if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
    const double us = time([&](size_t w) { return Launch(s, &found[i].algo, x, ws[w], y, stream); });
    if (us < 0) continue;
    if (first < 0) first = us;
    if (chosen == -2 || us * kMinGain < best) {
      best = us;
      chosen = i;
    }
  }
  cudaStreamSynchronize(stream);
  cudaGetLastError();  // an algorithm that failed to launch leaves nothing sticky behind
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (line) {
    char text[240];
    if (chosen == -1)
      std::snprintf(text, sizeof text,
                    "rows %lld, n %lld, k %lld: cublasGemmEx kept, %.2f us a launch (cuBLASLt's first of %d %.2f)",
                    static_cast<long long>(rows), static_cast<long long>(n), static_cast<long long>(k), base, count,
                    first);
    else if (chosen >= 0)
      std::snprintf(text, sizeof text,
                    "rows %lld, n %lld, k %lld: candidate %d of %d, %.2f us a launch (the first %.2f%s%.2f)",
                    static_cast<long long>(rows), static_cast<long long>(n), static_cast<long long>(k), chosen, count,
                    best, first, base >= 0 ? ", cublasGemmEx " : "", base >= 0 ? base : 0.0);
    if (chosen >= -1) *line = text;
  }
  if (chosen < 0) return false;
  s.algo = found[chosen].algo;
  s.has_algo = true;
  return true;
}

bool LtGemm::Run(const void* x, const void* w, void* y, int64_t rows, int64_t n, int64_t k,
                 cudaStream_t stream) const {
  const auto it = shapes_.find(Key{rows, n, k});
  if (it == shapes_.end() || !it->second->has_algo) return false;
  const Shape& s = *it->second;
  if (Alignment(x) < s.align || Alignment(w) < s.align || Alignment(y) < s.align) return false;
  return Launch(s, &s.algo, x, w, y, stream);
}

bool LtGemm::Launch(const Shape& s, const void* algo, const void* x, const void* w, void* y,
                    cudaStream_t stream) const {
  const float one = 1.0f, zero = 0.0f;
  return cublasLtMatmul(H(handle_), D(desc_), &one, w, s.a, x, s.b, &zero, y, s.c, y, s.c,
                        static_cast<const cublasLtMatmulAlgo_t*>(algo), workspace_, kWorkspaceBytes,
                        stream) == CUBLAS_STATUS_SUCCESS;
}

}  // namespace loom::engine::cuda
