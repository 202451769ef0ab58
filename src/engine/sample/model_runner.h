// ModelRunner: turns the scheduler's rows into CachedBatches, runs the
// shared frozen Transformer over the paged KV cache, and returns logits
// (as nano-vllm's model_runner.py). It owns the KV pools; the scheduler's
// BlockManager decides which blocks each sequence uses.
//
// Rows of one adapter must be adjacent (the scheduler sorts them), so
// SlotBank::Delta runs one matmul pair per adapter group per step. On CUDA,
// decode steps go through FastDecode (one graph replay) when it is available,
// and so do small prefill steps (FastPrefill): an eager prefill of a few
// tokens costs ~190 ATen calls per layer with an adapter (counted on the CPU,
// `loom bench sample --count-ops`), which on a GPU is host time that no
// kernel fills (~90 ms for 80 tokens on qwen3-4b), with 8 adapters more.
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
  // prefix too), on FastPrefill's graphs where the step qualifies, else
  // eager, writing its K/V into sequence 0's blocks (allocated by the
  // caller). Fills output.prompt_logprobs / topk when asked, which needs the
  // whole prompt in one chunk. Returns the logits of each chunk's last
  // token, [chunks, vocab] fp32.
  at::Tensor Prefill(const std::vector<PrefillChunk>& chunks);

  // One new token (the last of seq.tokens) per sequence at position
  // seq.cached, blocks allocated by the caller. Returns [rows, vocab] fp32.
  at::Tensor Decode(const std::vector<Sequence*>& seqs);

  // A decode step and prefill chunks in one forward on the decode graphs
  // (FastPrefill's rows after the decode rows): [seqs + chunks, vocab] fp32,
  // each sequence's next-token logits then each chunk's last token's.
  // Undefined when it does not qualify (no fast path, or the chunks would
  // not run on FastPrefill): the caller runs Decode and Prefill instead.
  at::Tensor Mixed(const std::vector<Sequence*>& seqs, const std::vector<PrefillChunk>& chunks);

  // Copies the first `rows` token rows of block src into block dst, in
  // every layer (a forked sample's own copy of the partial prompt block).
  void CopyBlock(int src, int dst, int64_t rows);

  // Models with Gated DeltaNet layers (gated_deltanet.h): `slots` recurrent
  // states a layer, one per running sequence (Sequence::state), so a decode
  // step is O(1) in the context; returns false (and holds none) for the
  // others. CopyState gives a forked sample its prompt's state.
  bool ReserveStates(int64_t slots);
  void CopyState(int src, int dst);
  // The bytes of one sequence's states over every layer (0: none).
  static int64_t StateBytesPerRow(const Transformer& model);

  const Transformer& model() const { return *model_; }

  // Slot s of the bank was (re)loaded: the fast decode path refreshes its copy.
  void SlotChanged(int s) {
    if (fast_) fast_->SlotChanged(s);
  }
  bool fast_decode() const { return fast_ != nullptr; }
  // Prefill steps that ran on FastPrefill's graphs so far, and Mixed steps.
  int64_t fast_prefills() const { return fast_prefills_; }
  int64_t mixed_steps() const { return mixed_steps_; }
  // The fast decode path's graph captures so far and their seconds (0 without it).
  int64_t graphs_captured() const { return fast_ ? fast_->graphs_captured() : 0; }
  double capture_seconds() const { return fast_ ? fast_->capture_seconds() : 0; }

 private:
  int64_t Row(const Sequence& s, int64_t pos) const;
  // Prefill on the decode graphs: every new token is a decode row at its
  // position whose context (the cached prefix and the step's earlier tokens
  // of its sequence) is read through the sequence's block table. In each
  // layer the graph writes all rows' K/V before any row attends, so a row
  // sees what a causal prefill shows it; rows go up to 256 per replay
  // (kFastPrefillSlice), in order, so a later replay's rows read what earlier ones wrote.
  // Same logits as Prefill to the fast decode path's rounding; no
  // paged-context gather, no per-sequence loop, and adapters applied per row
  // (BGMV) at the launches of one. Undefined when the step does not qualify
  // (no fast path, prompt logprobs asked, more than fast_prefill_tokens_ new
  // tokens or kFastPrefillContext context reads): the caller runs eager.
  at::Tensor FastPrefill(const std::vector<PrefillChunk>& chunks);
  // One decode row per sequence: its last token at position cached.
  void AddDecodeRows(const std::vector<Sequence*>& seqs, DecodeStep* step) const;
  // Every chunk's new tokens as rows, each chunk's last row appended to
  // *last; false when the chunks do not qualify for the graphs (see above).
  bool AddChunkRows(const std::vector<PrefillChunk>& chunks, DecodeStep* step, std::vector<int64_t>* last) const;
  // Replays the rows on the graphs, kFastPrefillSlice at a time in order;
  // the logits of rows `picks` (ascending), or undefined.
  at::Tensor Replay(const DecodeStep& all, const std::vector<int64_t>& picks);
  void PromptLogprobs(SampleRequest& r, const at::Tensor& hidden, int64_t begin);

  std::shared_ptr<const Transformer> model_;
  SlotBank* bank_;
  int64_t block_size_;
  KvCache cache_;  // num_blocks + 1 blocks: the last is the fast path's scratch
  std::unique_ptr<FastDecode> fast_;  // CUDA graphs of fused kernels, or null
  int64_t fast_prefill_tokens_;       // DecodeOptions::fast_prefill_tokens
  int64_t fast_prefills_ = 0;
  int64_t mixed_steps_ = 0;
};

}  // namespace loom::engine::sample
