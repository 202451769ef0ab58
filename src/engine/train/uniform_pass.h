// UniformPass: a forward_backward pass in the uniform layout, with every
// device tensor at a fixed address so that a CUDA graph captured over
// Forward() and Backward() replays over the next pass's inputs
// (pass_graphs.h).
//
// The layout: S sequences of L rows each, back to back. Each datum is one
// sequence, padded at its end (token 0, positions running on, target 0,
// loss inputs 0, mask 0); sequences past the pass's datums are all padding
// on no slot. L and S are powers of two (L at least kMinLen), so that few
// shapes cover all small passes. Attention is causal within a sequence, so
// a real row never sees the padding after it; the per-token loss is
// multiplied by the mask, so padding adds nothing to a loss or a gradient.
// LoRA is routed on the device (transformer.h, UniformLora): each sequence
// is its own group, with its slot's index and alpha/r (0 where the slot does
// not train the group), at full rank R.
//
// Same values as the packed pass (forward_backward.h) to float rounding:
// the layers' arithmetic is the same but for the GEMM shapes and the
// grouped LoRA form (tests/engine/uniform_pass_test.cpp).
//
// Threading: engine thread only.
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/api.h"
#include "engine/lora/slot_bank.h"
#include "engine/model/transformer.h"
#include "engine/train/loss_spec.h"

namespace loom::engine::train {

struct UniformShape {
  static constexpr int64_t kMinLen = 64;
  int64_t seqs = 0, len = 0;
  int64_t tokens() const { return seqs * len; }
};

// The shape for sequences of these lengths (S = the next power of two of
// their count, L = that of the longest, at least kMinLen), or nothing when
// S * L exceeds max_tokens.
std::optional<UniformShape> UniformShapeFor(const std::vector<int64_t>& lengths, int64_t max_tokens);

// What decides a pass's kernels besides its shape: the loss (kind and
// parameters) and which LoRA groups run. Passes with equal keys can share
// one graph.
struct UniformKey {
  UniformShape shape;
  LossSpec spec;
  bool attn = false, mlp = false, unembed = false;
  std::string ToString() const;
};

class UniformPass {
 public:
  UniformPass(const UniformKey& key, at::Device device);

  // Copies one pass into the device buffers: datum i (validated, 1-D
  // targets, the key's loss) is sequence i on slot slots[i].
  void Load(const SlotBank& bank, const std::vector<const Datum*>& data, const std::vector<int>& slots);
  // Logprobs, per-token losses and per-sequence loss sums of the loaded
  // pass; under grad mode the sums keep the autograd graph for Backward().
  void Forward(const Transformer& model, const SlotBank& bank);
  // The backward of the sum of all sequences' losses (each slot's gradient
  // is added into the bank's .grad, as the packed pass does).
  void Backward();
  // Forgets the loaded pass's autograd graph without a backward.
  void Drop() { seq_loss_ = at::Tensor(); }

  const UniformKey& key() const { return key_; }
  // [S * L] fp32 each, and [S]; detached, at fixed addresses.
  const at::Tensor& logprobs() const { return logprobs_; }
  const at::Tensor& elementwise() const { return elementwise_; }
  const at::Tensor& seq_loss() const { return seq_loss_out_; }

 private:
  UniformKey key_;
  // Inputs: rows of dev_long_ [3, S * L] (tokens, positions, targets) and
  // dev_float_ [4, S * L] (weights, sampler logprobs, advantages, mask),
  // each filled from its pinned host twin in one copy.
  at::Tensor host_long_, host_float_, dev_long_, dev_float_;
  at::Tensor tokens_, positions_, targets_, weights_, sampler_lp_, advantages_, mask_;
  at::Tensor host_slots_, host_scales_, dev_slots_, dev_scales_;  // [3, S] per group: attn, mlp, unembed
  std::shared_ptr<UniformLora> lora_;
  at::Tensor seq_loss_;  // with the autograd graph, between Forward and Backward
  at::Tensor logprobs_, elementwise_, seq_loss_out_;
};

}  // namespace loom::engine::train
