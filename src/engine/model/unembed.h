// unembed: log-probabilities of target tokens under lm_head plus the
// per-sequence unembed LoRA, computed in chunks of tokens so that
// full-vocabulary logits never exist for the whole batch — not in the
// forward pass and not in what autograd keeps for the backward pass: the
// backward recomputes one chunk's logits at a time (activation
// checkpointing), so peak memory is one chunk x vocab, whatever T is.
//
// Pure functions of their inputs; engine thread (they run on its device).
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "engine/lora/slot_bank.h"

namespace loom::engine {

// What the unembed LoRA adds for one batch: runs of rows [begin, end) that
// use one slot's lm_head adapter at its own rank and scale.
struct UnembedSpec {
  at::Tensor A, B;  // the bank's lm_head stacks [N, R, hidden], [N, vocab, R]; undefined if none applies
  struct Run {
    int64_t begin = 0, end = 0;
    int64_t slot = 0, rank = 0;
    double scale = 0.0;
  };
  std::vector<Run> runs;  // sorted, disjoint; rows outside any run get no LoRA
};

// Which computation runs. On CUDA with a bf16 lm_head the fused one
// (model/cuda/unembed_kernels.h): bf16 logits (the LoRA added into them by
// GEMM), logsumexp and target gather in one kernel, the gradient written
// over the logits by another, no fp32 [rows, vocab] tensor; kKeep keeps the
// pass's logits (2 bytes x vocab a row) from the forward for the backward,
// kRecompute recomputes them a chunk at a time. Elsewhere, and with kPlain
// (the reference), logits in the model dtype then fp32 plus an fp32 LoRA.
enum class UnembedMode { kRecompute, kKeep, kPlain };

// The runs of sequences whose slot trains the unembed group.
UnembedSpec MakeUnembedSpec(const SlotBank& bank, const std::vector<int64_t>& seq_begin,
                            const std::vector<int>& seq_slot);

// hidden [T, hidden] fp32; targets [T] or [T, K] int64 in [0, vocab);
// lm_head [vocab, hidden] in the model dtype (logits are computed in that
// dtype, as HF does, then in fp32). Returns fp32 of the targets' shape:
// logit[target] - logsumexp(logits). Differentiable into hidden and the
// spec's A and B: the used slots' gradient slices are added into A.grad and
// B.grad in place (lora_nodes.h), no autograd gradient is returned for them.
at::Tensor ChunkedTargetLogprobs(const at::Tensor& hidden, const at::Tensor& targets, const at::Tensor& lm_head,
                                 const UnembedSpec& spec, int64_t chunk_tokens,
                                 UnembedMode mode = UnembedMode::kRecompute);

// The same for the uniform layout (transformer.h, UniformLora): rows are S
// sequences of L = groups.max_rows rows, sequence s adapted by the bank's
// A/B of slot groups.slots[s] at groups.scale[s] (0: no LoRA), every factor
// at full rank R (rows past a slot's rank are zero, so they add exact zeros).
// The slots are read on the device, so the computation depends on nothing
// host-side but shapes. chunk_tokens must be a multiple of L. The backward
// adds each sequence's factor gradients into A.grad / B.grad in place (as
// lora_nodes.h) and returns none for A and B.
at::Tensor UniformTargetLogprobs(const at::Tensor& hidden, const at::Tensor& targets, const at::Tensor& lm_head,
                                 const at::Tensor& A, const at::Tensor& B, const LoraGroups& groups,
                                 int64_t chunk_tokens, UnembedMode mode = UnembedMode::kRecompute);

}  // namespace loom::engine
