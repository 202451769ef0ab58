// FastDecode: the sampler's decode step as one replayed CUDA graph of fused
// kernels (engine/sample/cuda, one family per file), instead of ~70 eager libtorch ops per layer.
// It computes what Transformer::ForwardCached + Logits compute for a decode
// batch (same op order, rounding to the model dtype where the eager path
// rounds); only where the eager path runs a matmul in fp32 on fp32 LoRA
// factors, it uses factors rounded to the model dtype (a bf16 mirror of the
// sampler's SlotBank, refreshed per slot when an adapter loads).
//
// Per-row adapters are applied BGMV-style: each row reads its own slot's
// factors (rows of one adapter, a tile of 8, share the loads; the sampler
// sorts a step's rows by slot), so a step with 8 distinct adapters costs
// the same launches as a step with one. The shrink (x A^T) runs on a
// parallel branch of the graph beside the base projection of the same x,
// and so does the expand (t B^T), into a delta buffer that the
// projection's consumer (norm, RoPE, SiLU*up) adds as it reads; only
// lm_head's expand waits for its GEMM. For bf16 models both run on tensor
// cores, and a shrink with a long input (down's, o's) is split over several
// blocks per output tile, the last to finish adding the partial sums.
// Projections of at most 4 rows use a matrix-vector kernel, not cuBLAS.
//
// Graphs are keyed by (batch bucket, block-table width bucket, with LoRA or
// not): a step of S rows replays the graph of the next power of two >= S, its
// padding rows write to a scratch KV row that no sequence owns.
//
// Availability: CUDA builds (LOOM_CUDA_KERNELS) on a CUDA device, bf16 or
// fp32 models with head_dim 32/64/128/256, unless DecodeOptions turns it
// off (cuda_graphs); its other switches (gemv, split_shrink) are fixed at
// construction. Models with experts only with DecodeOptions::moe_graphs, and
// then qwen3_moe in bf16 whose experts' block reads nothing on the host
// (MoeReadsNoHost): that block runs as ATen ops inside the graph, its expert
// LoRA in the pair form (engine/model/moe.h). Elsewhere MakeFastDecode
// returns nullptr and the sampler stays eager.
//
// Profiling: DecodeOptions::profile hands the step a DecodeProfiler
// (engine/sample/cuda/decode_profiler.h) that times each stage. Without it
// (production) the profiler is null and costs a pointer test per stage
// while a graph is captured and one per step.
//
// Threading: the sampler's decode thread only.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/lora/slot_bank.h"
#include "engine/model/cached_batch.h"
#include "engine/model/transformer.h"
#include "engine/sample_api.h"

namespace loom::engine {

// The most rows one Decode takes (a larger step runs eager).
inline constexpr int64_t kFastDecodeMaxRows = 512;

// One decode step, host side: per row the new token, its position, the KV
// row it is written to, the context length including it, its block table
// and its sampler slot (-1 = base).
struct DecodeStep {
  std::vector<int64_t> tokens, positions, write_rows;
  std::vector<int32_t> ctx_len;
  std::vector<const std::vector<int>*> tables;
  std::vector<int> slots;
};

class FastDecode {
 public:
  virtual ~FastDecode() = default;
  // Logits [rows, vocab] fp32 (valid until the next call), or an undefined
  // tensor when this step cannot take the fast path (the caller runs eager).
  virtual at::Tensor Decode(const DecodeStep& step) = 0;
  // Slot s of the bank was rebound or loaded: refresh its mirror before use.
  virtual void SlotChanged(int s) = 0;
  // The graphs captured so far, and the seconds their captures took.
  virtual int64_t graphs_captured() const { return 0; }
  virtual double capture_seconds() const { return 0; }
};

// scratch_row: a KV row (in every layer's pools) that no sequence uses.
std::unique_ptr<FastDecode> MakeFastDecode(std::shared_ptr<const Transformer> model, const SlotBank* bank,
                                           KvCache* cache, int64_t block_size, int64_t scratch_row,
                                           const DecodeOptions& options);

}  // namespace loom::engine
