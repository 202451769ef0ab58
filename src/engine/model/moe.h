// MoE: the mixture-of-experts MLP block (qwen3_moe, gpt_oss) with each
// slot's expert LoRA, as one of the decoder layer's shared blocks.
//
// Routing (as Hugging Face computes it), by MoeRouter:
//   kSoftmaxTopK (qwen3_moe): router logits h W_r^T in the model dtype;
//     softmax over all E experts in fp32; the top-k probabilities,
//     renormalised to sum 1 when norm_topk, cast back to the model dtype.
//   kTopKSoftmax (gpt_oss): logits h W_r^T + b_r; top-k of the logits; a
//     softmax over those k in the model dtype.
//   kGroupedSoftmax (deepseek_v2): logits in fp32 (h and W_r cast); softmax
//     over all E; the experts split into `groups` groups of E / groups, each
//     ranked by its best score; top-k among the `topk_groups` best groups
//     (others masked to 0); the chosen scores times routed_scale, in fp32
//     (greedy: one group).
//   kGroupedSigmoid (deepseek_v3): logits in fp32; sigmoid scores s; the
//     choice ranks s + score_bias (the correction bias), groups by the sum
//     of their two best; the weights are the chosen s, renormalised to sum
//     1 (+1e-20) when norm_topk, times routed_scale, in fp32.
// Each token's output is the routing-weighted sum of its k experts' MLPs
// (gate_up [2I, H] with the gate rows first, down [H, I], each with an
// optional per-expert bias added before the weighting, so the down bias is
// scaled by the routing weight too), by MoeActivation:
//   kSwiGlu: silu(gate) * up;
//   kClampedSwiGlu (gpt_oss): g = min(gate, 7), u = clamp(up, -7, 7),
//     g * sigmoid(1.702 g) * (u + 1).
// gpt_oss checkpoints store the experts [E, in, out] with gate/up columns
// interleaved; the loader permutes them into this layout, so the grouped
// GEMMs and the expert LoRA are one code path for both families. The router is
// frozen; its input still gets the gradient through the routing weights. A
// token's route depends only on its own hidden state, so packing never
// changes it.
//
// Expert matmuls are grouped: the (token, choice) pairs are sorted by
// expert, and then by the token's LoRA slot within an expert, and every
// projection is one grouped GEMM over those segments (GroupedLinear). The
// expert LoRA (slot_bank.h: gate_up shares A across experts and keeps B per
// expert, down keeps A per expert and shares B) runs over the (expert, slot)
// segments with each segment's own factors, two grouped GEMMs per target
// (the segment form), or, for the sampler's steps of few rows, per pair with
// batched matmuls over gathered factors (the pair form, ExpertLoraRows).
//
// Threading: pure functions of their arguments; the engine or sampler thread.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "engine/lora/slot_bank.h"

namespace loom::engine {

enum class MoeRouter { kSoftmaxTopK, kTopKSoftmax, kGroupedSoftmax, kGroupedSigmoid };
enum class MoeActivation { kSwiGlu, kClampedSwiGlu };

// One MoE layer's frozen weights (undefined router: a dense layer).
struct MoeWeights {
  at::Tensor router;        // [E, H]
  at::Tensor router_bias;   // [E] or undefined
  at::Tensor gate_up;       // [E, 2I, H]
  at::Tensor gate_up_bias;  // [E, 2I] (gate then up) or undefined
  at::Tensor down;          // [E, H, I]
  at::Tensor down_bias;     // [E, H] or undefined
  at::Tensor score_bias;    // [E] fp32 (kGroupedSigmoid's correction bias) or undefined
  int64_t top_k = 0;
  bool norm_topk = false;   // kSoftmaxTopK and kGroupedSigmoid
  int64_t groups = 1, topk_groups = 1;  // the grouped routers
  double routed_scale = 1.0;            // the grouped routers
  MoeRouter router_kind = MoeRouter::kSoftmaxTopK;
  MoeActivation activation = MoeActivation::kSwiGlu;
  // Split over expert-parallel ranks (parallel.h): this rank holds experts
  // [expert_begin, expert_begin + gate_up.size(0)) of the router's E; the
  // block's output is then this rank's experts' share of every token.
  int64_t expert_begin = 0;
  bool defined() const { return router.defined(); }
};

// The expert LoRA in the pair form: per row its slot, with no grouping of
// rows by slot, so it is made and used on the device alone (no host read: a
// CUDA graph can hold it). Each (token, choice) pair then gathers its own
// slot's per-expert factor, and each token its slot's shared one, so the
// form costs a fixed number of ops whatever the slots and experts: for the
// sampler's steps of few rows (a decode step), where the segment form would
// read the segments' sizes on the host and run a matmul per non-empty
// (expert, slot) segment.
struct ExpertLoraRows {
  at::Tensor slot;   // [T] int64: the token's slot (0 where it has none)
  at::Tensor keep;   // [T, 1] bool: it has one
  at::Tensor scale;  // [T, 1] fp32: its alpha/r (0 where none)
  // The per-expert factors are gathered in runs of at most this many bytes
  // of fp32 (at least one pair a run), so the form's memory stays bounded.
  int64_t run_bytes = int64_t{64} << 20;
  bool defined() const { return slot.defined(); }
  // From each row's slot on the device ([T] integer, -1: none; the caller
  // gives -1 to rows whose slot does not train the mlp group).
  static ExpertLoraRows FromSlots(const SlotBank& bank, const at::Tensor& slots);
};

// Which slot's expert LoRA each token of a batch uses, built once per batch
// and shared by every MoE layer. Tokens whose sequence's slot does not train
// the mlp group use none.
struct ExpertLoraRouting {
  std::vector<int64_t> slots;  // U distinct slots that train the mlp group, in first-use order
  at::Tensor token_group;      // [T] int64 on the device: the token's index into slots, U for none
  at::Tensor slot_ids;         // [U] int64 on the device
  at::Tensor scale;            // [U + 1] fp32 on the device: each slot's alpha/r, then 0
  at::Tensor group_slot;       // [U + 1] int64 on the device: each group's slot (group U: slot 0's)
  bool unslotted = false;      // some token is in group U (its sequence's slot does not train the mlp group)
  // Per token: its slot (group U: slot 0's, whose rows keep selects away),
  // keep and alpha/r, made once per batch; the segment form reads keep and
  // scale, the pair form all of it (undefined when U is 0).
  ExpertLoraRows rows;
  int64_t num_slots() const { return static_cast<int64_t>(slots.size()); }
  // Rows [seq_begin[i], seq_begin[i+1]) use seq_slot[i].
  static ExpertLoraRouting Make(const SlotBank& bank, const std::vector<int64_t>& seq_begin,
                                const std::vector<int>& seq_slot, at::Device device);
};

// Whether the sampler's eager steps take the pair form for P pairs on
// `device`: at most kPairFormMaxPairs on a GPU, kPairFormMaxPairsCpu on the
// CPU. A prefill's many tokens batch better by segment where launches are
// cheap: on the CPU, one layer at Qwen3-30B-A3B's widths with 8 adapters, a
// 16-row decode step (128 pairs) took 264 ms in the pair form against 277
// by segment, a 128-token prefill (1,024 pairs) 866 against 606. The
// trainer keeps the segment form whatever the grad mode, so that a
// recomputed layer's no-grad forward gives the kept forward's bits.
inline constexpr int64_t kPairFormMaxPairs = 2048, kPairFormMaxPairsCpu = 256;
bool PairFormFits(int64_t pairs, const at::Device& device);

// The block's output [T, H] for normed hidden rows h [T, H], with the expert
// LoRA of lora's slots when lora has any and the targets are given (both or
// neither), in the segment form. Differentiable into h and into the bank's
// expert factors of the routed slots (their gradients land in the bank's
// gradient buffer).
at::Tensor MoeForward(const MoeWeights& w, const at::Tensor& h, const SlotBank& bank, const LoraTarget* gate_up,
                      const LoraTarget* down, const ExpertLoraRouting* lora);
// The block with the expert LoRA in the pair form (rows undefined: the base
// alone). With bf16 on CUDA and at most 512 experts, all on this rank, it
// reads nothing on the host (MoeReadsNoHost), so a CUDA graph can hold it.
// pair_gemv (the sampler's decode graphs, DecodeOptions::moe_gemv): without
// grad and where PairGemvApplies, each pair's projections are
// matrix-vector products over its own expert's rows instead of the sorted
// pairs' grouped GEMMs (the same sums in another order).
at::Tensor MoeForward(const MoeWeights& w, const at::Tensor& h, const SlotBank& bank, const LoraTarget* gate_up,
                      const LoraTarget* down, const ExpertLoraRows& rows, bool pair_gemv = false);
// Whether MoeForward with ExpertLoraRows reads nothing on the host for rows
// of dtype `dtype` on `device` (GroupedLinear's one-call case, all experts).
bool MoeReadsNoHost(const MoeWeights& w, at::ScalarType dtype, const at::Device& device);
// Whether MoeForward's pair_gemv takes h's rows that way: a CUDA build, h
// and the experts bf16 on CUDA, every expert on this rank, at most
// kPairGemvMaxPairs (token, expert) pairs (4 rows at top-8), widths a
// multiple of 8 and the expert tensors contiguous and 16-byte aligned.
inline constexpr int64_t kPairGemvMaxPairs = 32;
bool PairGemvApplies(const MoeWeights& w, const at::Tensor& h);

// y[rows of g] = x[rows of g] w[g]^T for groups g of consecutive rows:
// x [P, in], w [G, out, in], counts [G] int64 on x's device (summing to P).
// One grouped GEMM on CUDA for bf16 with 8-aligned widths (libtorch 2.8+;
// one per 512 groups, under its limit, after a host read of the counts);
// otherwise one matmul per non-empty group (the reference path).
at::Tensor GroupedLinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts);

}  // namespace loom::engine
