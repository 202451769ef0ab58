// LtGemm: the decode step's base projections, y [rows, n] = x [rows, k] W^T
// (bf16 operands and result, fp32 accumulation, no bias), through cuBLASLt
// with the algorithm of each shape chosen by timing
// (DecodeOptions::gemm_tuned, `--decode-gemm tuned`).
//
// Why: at a decode step's tens to hundreds of rows the projections read
// far more weight bytes than they compute, and the algorithm cuBLAS picks
// for such a shape may run in less than one wave, leaving SMs (and their
// share of the memory bandwidth) idle (docs/benchmarks.md, session 6: 12-52
// of 132 idle at 64 rows). Tune times the caller's own path first when
// given (the baseline: cublasGemmEx, as at::linear calls it), then every
// candidate cuBLASLt's heuristic offers for the shape, in the heuristic's
// order; a later candidate replaces the best so far only when at least
// kMinGain faster, so that noise does not pick an algorithm. Where the
// baseline stays the best, the shape has no algorithm and Run leaves it
// to the caller's path (session 42, H100: cuBLASLt's picks for qkv and
// gate/up at 256 rows were 1-3% slower than cublasGemmEx's). Which one
// wins can differ between processes, and with it the last bf16 bit of a
// projection: as it already differs between the decode graphs' row
// buckets, each of which cuBLAS serves with its own kernel.
//
// Tune before capturing a CUDA graph that runs a shape (it synchronizes the
// stream); Run only launches, so a graph can hold it (its workspace is this
// object's, allocated once).
//
// CUDA builds only. Threading: one thread (the sampler's decode thread).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace loom::engine::cuda {

class LtGemm {
 public:
  // The least speed-up over the best candidate so far that a later one
  // needs to be chosen.
  static constexpr double kMinGain = 1.03;

  LtGemm();
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Chooses the algorithm of (rows, n, k), each candidate timed over the
  // weights ws (each a contiguous bf16 [n, k]; several, such as every
  // layer's, so that a step's weights are read from memory, not L2, as a
  // decode step reads them), reading x (at least rows * k bf16) and writing
  // y (rows * n): the caller's scratch, so that the memory is the caller's
  // allocator's. baseline, when given, launches the caller's own path on
  // stream for ws[i] (same x and y), returning false if it could not. A
  // shape tuned before returns at once. Returns whether the shape has an
  // algorithm (none: cuBLASLt offered none that ran, or none beat the
  // baseline); `line`, when given and the shape was tuned now, says what
  // was chosen.
  bool Tune(int64_t rows, int64_t n, int64_t k, const std::vector<const void*>& ws, const void* x, void* y,
            cudaStream_t stream, std::string* line = nullptr, const std::function<bool(size_t)>& baseline = {});
  // Whether (rows, n, k) was tuned (with an algorithm found or not).
  bool Tuned(int64_t rows, int64_t n, int64_t k) const { return shapes_.count(Key{rows, n, k}) > 0; }
  // y = x W^T with the shape's chosen algorithm (x and y contiguous rows).
  // False, launching nothing, when the shape was not tuned or has none, or
  // an operand is less aligned than those it was tuned with.
  bool Run(const void* x, const void* w, void* y, int64_t rows, int64_t n, int64_t k, cudaStream_t stream) const;

 private:
  struct Shape;
  // y = x W^T with algo and shape's layouts on stream; false when cuBLASLt refuses.
  bool Launch(const Shape& shape, const void* algo, const void* x, const void* w, void* y, cudaStream_t stream) const;
  using Key = std::tuple<int64_t, int64_t, int64_t>;  // rows, n, k
  void* handle_ = nullptr;     // cublasLtHandle_t
  void* desc_ = nullptr;       // cublasLtMatmulDesc_t: fp32 compute, A transposed
  void* workspace_ = nullptr;  // kWorkspaceBytes of device memory
  std::map<Key, std::unique_ptr<Shape>> shapes_;  // tuned; an entry without an algorithm: none ran
};

}  // namespace loom::engine::cuda
