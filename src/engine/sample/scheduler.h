// Scheduler: continuous batching (as nano-vllm's scheduler.py). Requests
// wait in a FairQueue (fair by tokens across tenants and their sampling
// sessions); between decode steps they are admitted in its order while their
// adapter has a slot (AdapterCache), their worst-case KV blocks can be
// reserved (BlockManager), and the rows fit max_batch_rows.
// A step is either a prefill or one decode step over running rows, sorted
// by adapter slot; PlanStep (step_plan.h) picks which, and whose chunks and
// rows it carries (fair across tenants: a tenant within its share never
// waits behind another's long chunk). A prefill step runs at most
// limits.max_prefill_tokens prompt tokens: a longer prompt is prefilled in
// chunks over several steps, each chunk over the K/V of the ones before (as
// a cached prefix), and samples its first token after its last chunk; its
// num_samples rows fork from that one prefill. While a prompt is prefilled,
// prefill and decode steps alternate, so running rows get a token between
// any two chunks. Admission adds a tenant's new prompt tokens only while the
// tenant's admitted ones not yet prefilled fit one step (or none are left),
// so a request admitted now is prefilled within a step or two of its
// admission, and another tenant's backlog never holds it back.
// Prefix cache (limits.prefix_cache): every full block a sequence computes,
// prompt or generated, is published to the BlockManager under the request's
// adapter identity; at admission a request takes the longest cached chain of
// its prompt's whole blocks, leaving at least its last token to prefill (its
// logits start the sampling). A request asking for prompt logprobs reuses
// nothing (they need every prompt position's hidden state).
// Invariant: every admitted request holds its adapter slot and its block
// reservation until its last sequence finishes; then its callback runs.
//
// Threading: the decode thread only.
#pragma once
#include <memory>
#include <vector>

#include "engine/sample/adapter_cache.h"
#include "engine/sample/block_manager.h"
#include "engine/sample/detokenizer.h"
#include "engine/sample/fair_queue.h"
#include "engine/sample/model_runner.h"
#include "engine/sample/sampling.h"
#include "engine/sample/sequence.h"
#include "engine/sample/step_plan.h"

namespace loom::engine::sample {

// StepLimits: new (not cached) prompt tokens per prefill step (a longer
// prompt is chunked, except one asking for prompt logprobs) and the caps on
// an over-share tenant's work in a contended step.
struct SchedulerLimits : StepLimits {
  int max_batch_rows = 256;
  bool prefix_cache = true;
};

class Scheduler {
 public:
  Scheduler(std::shared_ptr<const Transformer> model, std::unique_ptr<SlotBank> bank, int64_t num_blocks,
            int64_t block_size, SchedulerLimits limits, const DecodeOptions& decode, const Detokenizer* detok,
            std::vector<int32_t> eos);

  void Add(std::unique_ptr<SampleRequest> r) {
    r->cache_root = blocks_.RootTag(r->call.adapter_dir);  // snapshots are immutable: the directory is the version
    waiting_.Push(std::move(r));
  }
  // The trainer's copy of what adapter directory dir holds (AdapterCache::Offer).
  void Offer(const std::string& dir, std::shared_ptr<const PeftSnapshot> snapshot) {
    adapters_.Offer(dir, std::move(snapshot));
  }
  bool idle() const { return waiting_.empty() && admitted_.empty(); }
  // One prefill (chunk) or decode step; completes finished requests. On a device
  // error every admitted request fails with it.
  void Step();
  // Completes every request, queued or admitted, with status.
  void FailAll(const Status& status);
  // Completes every request of one sampling session, queued or admitted,
  // with status; their KV blocks and adapter slots are free at once.
  void Cancel(const std::string& session, const Status& status);
  // The callbacks of requests completed since the last call, with their
  // results. The caller runs them after publishing stats(), so a callback
  // never observes the scheduler's state from before its own completion.
  std::vector<std::pair<SampleCallback, Result<SampleOutput>>> TakeCompleted() { return std::move(completed_); }

  SamplerStats stats() const;
  const BlockManager& blocks() const { return blocks_; }

  // Runs, at start-up (idle, every block and slot free), the steps whose
  // working memory is the largest this scheduler will need, so the caller
  // can measure it: an eager prefill of `prefill_tokens` new tokens and a
  // decode step of max_batch_rows rows at a context that fills the KV cache
  // (at most context_window; on CUDA its graph is captured then), both through a scratch adapter at
  // the bank's max rank, and the truncated sampling of those rows. It writes
  // only into free KV blocks, binds and releases slot 0, publishes nothing,
  // and completes no request. Throws what the device throws.
  void Probe(int64_t prefill_tokens, int64_t context_window);

 private:
  void Admit();
  void PrefillStep(std::vector<PrefillChunk> chunks);
  void DecodeStep(std::vector<Sequence*> rows);
  // Decode rows and prompt chunks in one forward (ModelRunner::Mixed), or
  // one after the other where that does not qualify.
  void MixedStep(std::vector<Sequence*> rows, std::vector<PrefillChunk> chunks);
  // The halves of the steps around the runner's forward: rows sorted by
  // slot, their blocks and sampling parameters; then the chosen tokens.
  std::vector<RowChoiceParams> BeforeDecode(std::vector<Sequence*>& rows);
  void AfterDecode(const std::vector<Sequence*>& rows, const std::vector<RowChoiceParams>& params,
                   const at::Tensor& logits);
  // Each chunk's bookkeeping, and each finished prompt's first token from
  // its chunk's row of logits.
  void AfterPrefill(const std::vector<PrefillChunk>& chunks, const at::Tensor& logits);
  // Appends a chosen token; true when the sequence is done.
  bool Append(Sequence& s, int32_t token, float logprob);
  void Finish(Sequence& s, SampleStopReason why);
  void CompleteDone();
  void Complete(SampleRequest& r, Result<SampleOutput> result);
  void EnsureBlock(Sequence& s, int64_t pos);
  // The cached blocks r may reuse now (none with the cache off).
  std::vector<int> CacheHits(const SampleRequest& r) const;
  // Offers s's full, computed blocks past s.published to the prefix cache.
  void PublishFull(Sequence& s);

  std::unique_ptr<SlotBank> bank_;
  AdapterCache adapters_;
  BlockManager blocks_;
  ModelRunner runner_;
  SchedulerLimits limits_;
  const Detokenizer* detok_;
  std::vector<int32_t> eos_;
  FairQueue waiting_;
  std::vector<std::unique_ptr<SampleRequest>> admitted_;
  int64_t rows_in_use_ = 0;
  std::vector<int> free_states_;  // state slots no running sequence holds (models with Gated DeltaNet layers)
  StepHistory history_;
  uint64_t head_waited_ = 0;  // id + 1 of the last anchor request counted in admission_waits
  SamplerStats stats_;
  std::vector<std::pair<SampleCallback, Result<SampleOutput>>> completed_;
};

}  // namespace loom::engine::sample
