// Transformer: a Hugging Face decoder-only model (qwen2, qwen3, qwen3_moe, gpt_oss, deepseek_v2/_v3) with frozen
// base weights, run over a packed batch with per-sequence LoRA slots.
//
// A packed batch is one token axis across all sequences: no padding,
// positions restart at 0 for each sequence, attention never crosses a
// sequence boundary (block-diagonal causal mask).
//
// Threading: engine thread only. The base weights are read-only after Load.
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/lora/slot_bank.h"
#include "engine/model/attention.h"
#include "engine/model/config.h"
#include "engine/model/parallel.h"
#include "engine/model/unembed.h"

namespace loom::engine {

struct CachedBatch;  // engine/model/cached_batch.h: the sampler's rows over a paged KV cache
struct KvCache;
struct KvRowShape;

// A batch in the uniform layout (engine/train/uniform_pass.h): S sequences
// of L rows each, back to back, each its own LoRA group, with each
// sequence's slot and alpha/r per target group already on the device
// (scale 0: no LoRA for that sequence and group). The forward then reads
// nothing from the host but shapes and the three switches, so a CUDA graph
// of it replays with any slots. The groups' routing is LoraGroups with
// identity set: rows S * L, max_rows L, slots [S], scale [S, 1, 1].
struct UniformLora {
  LoraGroups attn, mlp, unembed;
  bool attn_on = false, mlp_on = false, unembed_on = false;  // whether the group's LoRA runs at all
};

struct PackedBatch {
  at::Tensor tokens;                  // [T] int64 on device
  at::Tensor positions;               // [T] int64 on device, restarting per sequence
  std::vector<int64_t> seq_begin;     // size S+1, cumulative offsets (cu_seqlens)
  std::vector<int> seq_slot;          // size S, slot of each sequence (-1 = base only); unused when uniform is set
  // Set for the uniform layout: the LoRA routing comes from here, not from
  // seq_slot, and seq_begin must be 0, L, 2L, ..., S * L.
  std::shared_ptr<const UniformLora> uniform;
  // Empty, or size S: the earlier sequence each one continues (-1: none), a
  // shared prefix (engine/train/shared_prefix.h) that continues none
  // itself. A continuation's positions start after its prefix's, and its
  // attention sees the prefix's keys (PaddedLayout::Shared). Only for a
  // model whose SharesPrefixes().
  std::vector<int> seq_prefix;

  static PackedBatch Make(const std::vector<std::vector<int32_t>>& seqs, const std::vector<int>& slots,
                          at::Device device, const std::vector<int>& prefix = {});
  int64_t num_tokens() const { return seq_begin.empty() ? 0 : seq_begin.back(); }
};

class Transformer {
  struct Impl;  // the weights (transformer_impl.h)

 public:
  // Reads config.json and the safetensors weights of model_dir. Every
  // expected tensor must be present with its exact shape; a missing, extra or
  // mis-shaped tensor is Status::Invalid naming it. Weights are converted to
  // dtype (kFloat or kBFloat16), placed on device, and never require grad.
  // With parallel.split(), this rank's part of each split block
  // (parallel.h); the model must be one whose blocks split (SplitSupport).
  static Result<std::unique_ptr<Transformer>> Load(const std::string& model_dir, at::Device device,
                                                   at::ScalarType dtype, const Parallel& parallel = {});
  // Same from tensors already in memory, keyed by Hugging Face name (tests,
  // converters). The same checks apply.
  static Result<std::unique_ptr<Transformer>> FromTensors(const ModelConfig& config,
                                                          const std::map<std::string, at::Tensor>& weights,
                                                          at::Device device, at::ScalarType dtype,
                                                          const Parallel& parallel = {});
  // Ok when config's blocks split over tp ranks (parallel.h): plain and
  // sliding attention whose heads and key/value heads tp divides, dense
  // MLPs (and shared experts) whose width it divides; else Invalid naming
  // what does not split (MLA, Gated DeltaNet, gated attention, a width).
  // With ep ranks, ep must divide the experts.
  static Status SplitSupport(const ModelConfig& config, int tp, int ep = 1);
  const Parallel& parallel() const { return parallel_; }
  // Hugging Face names and shapes of the base weights this config needs
  // (lm_head.weight only when embeddings are untied).
  static std::vector<std::pair<std::string, std::vector<int64_t>>> ExpectedWeights(const ModelConfig& config);

  const ModelConfig& config() const { return config_; }
  at::Device device() const { return device_; }
  at::ScalarType dtype() const { return dtype_; }
  // The frozen weights, for the fused decode path (engine/sample/cuda); the
  // type is private, so callers hold it as `const auto&`.
  const Impl& weights() const { return *impl_; }

  // Every adaptable linear, for SlotBank: per layer q, k, v, o, then
  // gate, up, down (dense MLP) or the experts' gate_up and down (MoE layer,
  // engine/model/moe.h); lm_head last. Split over ranks, this rank's parts
  // (FactorShard); whole: as one process holds them (the same order).
  std::vector<LoraTargetSpec> LoraTargets() const { return Targets(/*whole=*/false); }
  std::vector<LoraTargetSpec> WholeLoraTargets() const { return Targets(/*whole=*/true); }

  // Final-normed hidden states [T, hidden] (fp32 for the loss), differentiable
  // into the bank's A/B of the slots the batch uses. Layers [0,
  // recompute_layers) keep only their input for the backward and run again
  // there (recompute.h): the same values and gradients, less memory, one
  // more forward of those layers.
  at::Tensor Hidden(const PackedBatch& batch, const SlotBank& bank, int64_t recompute_layers = 0) const;

  // Log-probabilities of target tokens under lm_head (+ unembed LoRA).
  // targets: [T] or [T, K] int64. Computed in chunks of tokens so that
  // full-vocabulary logits never exist for the whole batch. Returns fp32 of
  // the targets' shape, differentiable into hidden and the bank. mode: how
  // the chunks run (unembed.h); kKeep where the pass has memory for its
  // logits in the model dtype until the backward.
  at::Tensor TargetLogprobs(const at::Tensor& hidden, const at::Tensor& targets, const PackedBatch& batch,
                            const SlotBank& bank, int64_t chunk_tokens = 1024,
                            UnembedMode mode = UnembedMode::kRecompute) const;

  // Full logits [T, vocab] fp32 for a few rows (sampler, tests).
  at::Tensor Logits(const at::Tensor& hidden, const PackedBatch& batch, const SlotBank& bank) const;

  // The sampler's incremental forward (defined in transformer_decode.cpp):
  // runs each row's new tokens over its cached keys/values, writes the new
  // keys/values into cache, and returns final-normed hidden states
  // [new tokens, hidden] fp32. Same math as Hidden(); not differentiable.
  at::Tensor ForwardCached(const CachedBatch& batch, KvCache& cache, const SlotBank& bank) const;
  // One token's row of layer `layer`'s KV pools for this config
  // (cached_batch.h), and every layer's.
  static KvRowShape KvShape(const ModelConfig& config, int64_t layer);
  static std::vector<KvRowShape> KvShapes(const ModelConfig& config);

  // Every frozen base tensor (tests, memory accounting). None requires grad.
  std::vector<at::Tensor> BaseWeights() const;

  // Attention kernel (default: DefaultAttentionKernel()). Both give the same
  // numbers to float tolerance; kMath is the reference.
  void set_attention_kernel(AttentionKernel k) { attention_kernel_ = k; }
  AttentionKernel attention_kernel() const { return attention_kernel_; }

 private:
  Transformer() = default;
  // FromTensors' work over names and shapes (checked first) and a reader
  // that gives each tensor when the model takes it.
  static Result<std::unique_ptr<Transformer>> Build(const ModelConfig& config,
                                                    const std::map<std::string, std::vector<int64_t>>& shapes,
                                                    const std::function<at::Tensor(const std::string&)>& read,
                                                    at::Device device, at::ScalarType dtype, const Parallel& parallel);
  std::vector<LoraTargetSpec> Targets(bool whole) const;
  std::shared_ptr<Impl> impl_;
  Parallel parallel_;
  ModelConfig config_;
  at::Device device_ = at::kCPU;
  at::ScalarType dtype_ = at::kFloat;
  AttentionKernel attention_kernel_ = DefaultAttentionKernel();
};

}  // namespace loom::engine
