// ModelRunner: turns the scheduler's rows into CachedBatches, runs the
// shared frozen Transformer over the paged KV cache, and returns logits
// (as nano-vllm's model_runner.py). It owns the KV pools; the scheduler's
// BlockManager decides which blocks each sequence uses.
//
// Rows of one adapter must be adjacent (the scheduler sorts them), so
// SlotBank::Delta runs one matmul pair per adapter group per step. On CUDA,
// decode steps go through FastDecode (one graph replay) when it is available.
//
// Threading: the decode thread only.
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "engine/lora/slot_bank.h"
#include "engine/model/cached_batch.h"
#include "engine/model/transformer.h"
#include "engine/sample/fast_decode.h"
#include "engine/sample/sequence.h"

namespace loom::engine::sample {

class ModelRunner {
 public:
  // decode: the fast path's switches (DecodeOptions::cuda_graphs off: none).
  ModelRunner(std::shared_ptr<const Transformer> model, SlotBank* bank, int64_t num_blocks, int64_t block_size,
              const DecodeOptions& decode);

  // Bytes of K and V for one token across all layers, in the model dtype.
  static int64_t KvBytesPerToken(const Transformer& model);

  using PrefillChunk = sample::PrefillChunk;
  // Runs every chunk (rows in order; the new tokens attend to their cached
  // prefix too), writing its K/V into sequence 0's blocks (allocated by the
  // caller). Fills output.prompt_logprobs / topk when asked, which needs the
  // whole prompt in one chunk. Returns the logits of each chunk's last
  // token, [chunks, vocab] fp32.
  at::Tensor Prefill(const std::vector<PrefillChunk>& chunks);

  // One new token (the last of seq.tokens) per sequence at position
  // seq.cached, blocks allocated by the caller. Returns [rows, vocab] fp32.
  at::Tensor Decode(const std::vector<Sequence*>& seqs);

  // Copies the first `rows` token rows of block src into block dst, in
  // every layer (a forked sample's own copy of the partial prompt block).
  void CopyBlock(int src, int dst, int64_t rows);

  const Transformer& model() const { return *model_; }

  // Slot s of the bank was (re)loaded: the fast decode path refreshes its copy.
  void SlotChanged(int s) {
    if (fast_) fast_->SlotChanged(s);
  }
  bool fast_decode() const { return fast_ != nullptr; }

 private:
  int64_t Row(const Sequence& s, int64_t pos) const;
  void PromptLogprobs(SampleRequest& r, const at::Tensor& hidden, int64_t begin);

  std::shared_ptr<const Transformer> model_;
  SlotBank* bank_;
  int64_t block_size_;
  KvCache cache_;  // num_blocks + 1 blocks: the last is the fast path's scratch
  std::unique_ptr<FastDecode> fast_;  // CUDA graphs of fused kernels, or null
};

}  // namespace loom::engine::sample
