// SlotBank: N LoRA adapter slots at maximum rank R over a frozen base model.
//
// Layout (a few large tensors, not N small modules): for every adapted
// linear layer ("target") there is A [N, R, d_in] and B [N, d_out, R], FP32,
// on the engine's device. They are views into one flat buffer [N, P] (P =
// every target's R * (d_in + d_out)), so that each slot's factors are one
// contiguous row, with the targets' columns ordered by group (attn, mlp,
// unembed: each group one column range); their .grad tensors are views of
// the same layout into a flat gradient buffer, defined (zero) from the start
// and only ever changed in place. The optimizer then steps a slot as a few
// rows, not ~500 tensors (train/adamw.h). A slot of rank r < R uses rows/columns [0, r); the
// rest stay exactly zero, so their gradients are zero and AdamW leaves them
// zero. scale[slot] = alpha / r. Targets a slot does not train (by group:
// attn, mlp, unembed) have zero A and B and are masked out of the optimizer.
//
// Expert targets (a mixture-of-experts layer's fused gate_up and down
// projections, one linear per expert) keep one factor per expert and share
// the other across the layer's experts: gate_up has A [N, R, d_in] shared and
// B [N, E, d_out, R] per expert; down has A [N, E, R, d_in] per expert and B
// [N, d_out, R] shared (miles' shared outer factors: the per-slot bytes grow
// with E only through the experts' narrow side). Either way the rank is
// A's dim -2 and B's dim -1, for plain and expert targets alike.
//
// Threading: engine thread only.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "engine/api.h"

namespace loom::engine {

enum class TargetGroup { kAttn, kMlp, kUnembed };

// Which factor of an expert target is kept per expert (the other is shared).
enum class ExpertFactor { kNone, kA, kB };

// How a factor of a target relates to the whole adapter when the model is
// split over tensor-parallel ranks (engine/model/parallel.h):
//   kWhole:   the whole factor on every rank, computed on the same rows, so
//             its gradient is the same everywhere (and so is the factor);
//   kPartial: the whole factor on every rank, but each rank's gradient is a
//             part (its split block's share): the engine sums them after
//             each pass, so the factor stays the same everywhere;
//   kSplit:   this rank's part of the factor: dim `dim` of FactorShape, of
//             whole size `full`, from `offset` on (rank parts in rank order).
enum class ShardKind { kWhole, kPartial, kSplit };
struct FactorShard {
  ShardKind kind = ShardKind::kWhole;
  int dim = -1;
  int64_t full = 0;
  int64_t offset = 0;
};

// What the bank is built from: one adaptable linear (or per-expert linears)
// of the base model.
struct LoraTargetSpec {
  std::string module;  // HF module path; expert targets name the parameter: "model.layers.0.mlp.experts.gate_up_proj"
  TargetGroup group = TargetGroup::kAttn;
  int64_t d_in = 0;
  int64_t d_out = 0;
  int64_t experts = 0;  // 0: a plain linear; E: one linear per expert
  ExpertFactor per_expert = ExpertFactor::kNone;
  // HF's parameter (and so PEFT's lora_B rows) interleaves the two halves of
  // d_out: HF row 2j is loom's row j, 2j + 1 is row d_out / 2 + j (gpt_oss gate_up).
  bool hf_interleaved = false;
  // This rank's part of the whole adapter (single process: both kWhole).
  FactorShard a_shard, b_shard;
  // Elements of A and of B at rank R.
  int64_t AElems(int64_t R) const { return (per_expert == ExpertFactor::kA ? experts : 1) * R * d_in; }
  int64_t BElems(int64_t R) const { return (per_expert == ExpertFactor::kB ? experts : 1) * d_out * R; }
  // One slot's A (a) or B at rank r: [r, d_in] or [E, r, d_in]; [d_out, r] or [E, d_out, r].
  std::vector<int64_t> FactorShape(bool a, int64_t r) const;
};

// One adapted linear layer of the base model.
struct LoraTarget : LoraTargetSpec {
  at::Tensor A;         // [N, R, d_in] (per-expert A: [N, E, R, d_in]) fp32 leaf, requires_grad (a view of the bank's flat buffer)
  at::Tensor B;         // [N, d_out, R] (per-expert B: [N, E, d_out, R]) fp32 leaf, requires_grad (likewise)
  int64_t a_col = 0, b_col = 0;  // where A's and B's AElems(R) and BElems(R) columns start in the flat row
  bool is_expert() const { return experts > 0; }
};

// How a packed batch's tokens reach the slots of one target group, built
// once per batch and shared by every target of the group (RoutedDelta).
// slots: the U distinct slots that train the group; select [T, U*R] is true
// over the token's own slot's R columns; scale [T, 1] is that slot's alpha/r
// (0 for a token with no training slot).
struct LoraRouting {
  at::Tensor slots;   // [U] int64 on the device (undefined when U == 0)
  at::Tensor select;  // [T, U*R] bool
  at::Tensor scale;   // [T, 1] fp32
  int64_t num_slots() const { return slots.defined() ? slots.size(0) : 0; }
};

// The grouped (segmented) form's routing of a packed batch for one target
// group, built once per batch and shared by every target of the group
// (GroupedDelta). The batch's rows are grouped by effective slot (the
// sequence's slot if it trains the group, else none); group u holds the rows
// of every sequence of slots[u], in packed order, whatever their positions
// (a slot's sequences need not be adjacent). Each group is padded to
// max_rows (Lmax) rows by repeating one of its valid rows; the pad rows'
// outputs are never read back, and their gradient is zeroed (pads) where
// the padded gradient is gathered (lora_nodes.cpp, UnpadRowsNode).
struct LoraGroups {
  at::Tensor slots;     // [U] int64 on the device (undefined when U == 0)
  at::Tensor scale;     // [U, 1, 1] fp32: alpha / r of each group's slot
  at::Tensor gather;    // [U * Lmax] int64: the packed row at each padded position
  at::Tensor scatter;   // [T] int64: the padded position of each packed row;
                        // U * Lmax (an appended zero row) for rows without a training slot
  at::Tensor pads;      // [P] int64: the padded positions that hold no packed row (undefined when none)
  int64_t rows = 0;     // T
  int64_t max_rows = 0; // Lmax
  bool base_rows = false;  // whether some row has no training slot (then the zero row is appended)
  bool identity = false;   // gather is 0..T-1 (each slot one run, equal lengths): no gather/scatter needed
  // The ragged order (where the bank allows it, SlotBank::AllowRagged): not
  // an identity, but every row in a group and each group's rows one run, in
  // group order, so the grouped GEMMs run over the packed rows as they are,
  // each group its own length (no gather, no pads; lora_nodes.h).
  bool ragged = false;
  at::Tensor ends;               // ragged: [U] int32 on the device, each group's end row
  std::vector<int64_t> ends_host;  // ragged: the same on the host
  at::Tensor row_scale;          // ragged: [T, 1] fp32, each row's group's alpha / r
  int64_t num_slots() const { return slots.defined() ? slots.size(0) : 0; }
};

// The three forms of the LoRA delta (same value, different kernels).
enum class LoraForm {
  kSegment,  // Delta: one matmul pair per run of equal slots
  kRouted,   // RoutedDelta: every row times all U slots' factors, masked (U*R columns)
  kGrouped,  // GroupedDelta: rows gathered per slot into [U, Lmax, d_in], two bmm
};

// What the choice between the forms looks at: a packed batch's shape for one
// target group (SlotBank::Shape).
struct LoraBatchShape {
  int64_t rows = 0;      // T: all rows of the batch
  int64_t runs = 0;      // runs of non-empty sequences with equal effective slot
                         // (rows without a training slot form runs too)
  int64_t slots = 0;     // U: distinct slots that train the group
  int64_t max_rows = 0;  // Lmax: rows of the largest slot's group
};

// One target of a pass whose grouped slots' factors were cast once: the
// bank's leaves A and B, and the slots' factors in the compute type ([U, R,
// d_in], [U, d_out, R]; views of SlotBank::CastGroup). JointGroupedLoraDelta
// (lora_nodes.h) takes several.
struct JointTarget {
  at::Tensor A, B, a, b;
  at::Tensor ga, gb;  // where the pass's gradients of a and b go (views of PassFactors::grad), or undefined
};

// One target group's factors for a pass (SlotBank::PassGroup): cast once,
// and, where the pass writes its gradients there, a buffer of the same
// layout that the node behind `token` adds into the bank's flat gradient
// rows once, after every LoRA node of the pass has run (lora_nodes.h,
// GradientFlushToken): a write per target instead of a cast and an
// index_add per factor.
struct PassFactors {
  at::Tensor cast;   // [U, len] in the compute type: the group's columns of the U slots' flat rows
  at::Tensor grad;   // [U, len] in the compute type, or undefined (gradients go straight to .grad)
  at::Tensor token;  // [1], or undefined: the flush node's output, an input of every node writing grad
};

struct SlotState {
  bool bound = false;
  LoraConfig config;
  int64_t step = 0;     // optimizer steps taken
  // Whether the slot's gradient rows may be non-zero: set by a backward over
  // its tokens, cleared when they are zeroed (step, ZeroGrad, Release).
  bool grad_dirty = false;
};

class SlotBank {
 public:
  // targets: every adaptable linear (Transformer::LoraTargets()).
  SlotBank(int num_slots, int max_rank, at::Device device, const std::vector<LoraTargetSpec>& targets);

  int num_slots() const { return num_slots_; }
  int max_rank() const { return max_rank_; }
  std::vector<LoraTarget>& targets() { return targets_; }
  const std::vector<LoraTarget>& targets() const { return targets_; }
  const LoraTarget* find(const std::string& module) const;
  LoraTarget* find(const std::string& module);

  const SlotState& slot(int s) const { return slots_.at(s); }
  SlotState& slot(int s) { return slots_.at(s); }
  bool trains(int s, TargetGroup g) const;

  // Per-slot scale alpha/r as a [N] fp32 tensor on the device (0 for unbound).
  const at::Tensor& scales() const { return scales_; }

  // The flat buffers every target's A and B (and their gradients) are views
  // of: [N, P] fp32, slot s's factors in row s. Weights change only under
  // NoGradGuard (binding, loading, the optimizer).
  const at::Tensor& flat() const { return flat_; }
  const at::Tensor& flat_grad() const { return flat_grad_; }
  // The columns [begin, begin + len) of group g's targets in a flat row.
  std::pair<int64_t, int64_t> GroupColumns(TargetGroup g) const { return group_cols_[static_cast<int>(g)]; }
  // Target t's A (a) or B as a view of a buffer laid out as flat() ([N, P]):
  // [N] + t.FactorShape(a, max_rank).
  at::Tensor FactorView(const at::Tensor& buffer, const LoraTarget& t, bool a) const;

  // Binds slot s: A[s,:r,:] ~ kaiming-uniform from config.seed (as PEFT does:
  // U(-1/sqrt(d_in), 1/sqrt(d_in)); each expert its own rows where A is per
  // expert), B[s] = 0; untrained groups and rows >= r
  // are zero; gradients and step are reset. The values depend only on (seed,
  // module name, r, d_in), not on libtorch's RNG. Rebinding a bound slot
  // starts it afresh. Invalid slot, rank outside [1, R] or alpha <= 0 →
  // Status::Invalid.
  Status Bind(int s, const LoraConfig& config);
  // Zeroes weights and gradients of slot s and marks it free.
  void Release(int s);
  // Zeroes the accumulated gradients of slot s only.
  void ZeroGrad(int s);

  // The dtype of the LoRA arithmetic for input rows x: x's own dtype (the
  // model dtype: bf16 on the GPU, where the fp32 factors are cast down once
  // per use and their gradients come back in fp32), or fp32 for every input
  // when set_lora_fp32(true) (x cast up, as PEFT does; the reference).
  at::ScalarType ComputeType(const at::Tensor& x) const;
  void set_lora_fp32(bool on) { lora_fp32_ = on; }
  bool lora_fp32() const { return lora_fp32_; }

  // True when some segment's slot trains t's group (so Delta can be nonzero).
  bool Uses(const LoraTarget& t, const std::vector<int>& seg_slot) const;

  // The LoRA delta for x routed per sequence: rows [seg_begin[i], seg_begin[i+1])
  // of x use slot seg_slot[i] (-1, an unbound slot, or a slot not training t's
  // group contribute zero rows). Returns scale * (x A^T) B^T with shape
  // [T, d_out] in ComputeType(x), computed per run of equal slots (segment
  // form: two small matmuls per run). One autograd node (lora_nodes.h) whose
  // backward adds the used slots' gradients into A.grad / B.grad in place
  // (A's and B's own autograd gradient stays undefined). Differentiable into A and B of the used slots only, at rank r.
  at::Tensor Delta(const LoraTarget& t, const at::Tensor& x,
                   const std::vector<int64_t>& seg_begin, const std::vector<int>& seg_slot) const;

  // The routing of a packed batch for group g (see LoraRouting).
  LoraRouting Route(TargetGroup g, const std::vector<int64_t>& seg_begin, const std::vector<int>& seg_slot) const;
  // The batch's shape for group g (see LoraBatchShape).
  LoraBatchShape Shape(TargetGroup g, const std::vector<int64_t>& seg_begin, const std::vector<int>& seg_slot) const;
  // Which form computes the delta of group g for this batch:
  // SelectForm(device is CUDA, Shape(g, ...), R). A pure function of the
  // batch (its slots, their bound state and groups, and its row counts).
  LoraForm ChooseForm(TargetGroup g, const std::vector<int64_t>& seg_begin, const std::vector<int>& seg_slot) const;
  // Tests: every batch takes form f (nullopt: the rule above). The CPU rule
  // never picks the grouped form, which the tests still check whole passes of.
  void ForceForm(std::optional<LoraForm> f) { forced_form_ = f; }
  // Whether Group marks routings ragged (LoraGroups::ragged) where their
  // rows allow it: on by default on CUDA (grouped GEMMs, at::_grouped_mm
  // for bf16), off on the CPU (a GEMM per group there), where tests turn it
  // on to check the ragged nodes against the padded ones.
  void AllowRagged(bool on) { ragged_ = on; }
  // The selection rule, with T, runs, U, Lmax from `shape` and R = max_rank:
  //   CUDA: kGrouped when runs > 1 and U*Lmax <= 2*T (padding at most
  //                  doubles the rows; only the needed FLOPs otherwise, in a
  //                  fixed number of kernels, and no isolation passes);
  //         kRouted  else when runs > 1 and U*R <= 128 (its matmuls cost
  //                  U*R/d_out of the base layer's, cheaper than launches
  //                  while small);
  //         kSegment otherwise (one run, or one slot's rows dominate).
  //   CPU:  kRouted  when runs > 1 and U*R <= 64 (FLOPs are the cost there,
  //                  so only few, low-rank slots pay), else kSegment.
  static LoraForm SelectForm(bool cuda, const LoraBatchShape& shape, int64_t max_rank);
  // Same value as Delta (to fp32 rounding), with a fixed number of kernels
  // whatever the number of sequences: select(x A_U^T * scale) B_U^T with A_U,
  // B_U the routed slots' factors side by side. Rows >= a slot's rank are
  // zero in A and B, so the full R columns add exact zeros, and gradients
  // reach only the routed slots' rows (and stay zero beyond their rank).
  //
  // Isolation: every token meets every routed slot's A and B in the two
  // matmuls, so nothing non-finite may enter them, or 0 * inf = NaN would
  // carry one slot's (or one sequence's) values into other tokens' rows.
  // Hence: other slots' columns are selected away (where, not a multiply by
  // a 0/1 mask); non-finite entries of A_U / B_U and of x enter as 0 (a row
  // of x holding one is non-finite in the base output already); and in the
  // backward the incoming gradient's non-finite entries are zeroed before
  // they meet the other slots' columns. A token's delta and the gradients of
  // the other slots are then those of a batch whose poisoned rows and slots
  // held any finite values, bit for bit.
  at::Tensor RoutedDelta(const LoraTarget& t, const at::Tensor& x, const LoraRouting& routing) const;

  // The grouped routing of a packed batch for group g (see LoraGroups).
  LoraGroups Group(TargetGroup g, const std::vector<int64_t>& seg_begin, const std::vector<int>& seg_slot) const;
  // Same value as Delta (to fp32 rounding) with a fixed number of kernels and
  // only the needed FLOPs: x's rows gathered into [U, Lmax, d_in] (in
  // ComputeType(x)), bmm with A_U^T [U, d_in, R], times the group's alpha/r, bmm with
  // B_U^T [U, R, d_out], and one gather back to packed order [T, d_out] (rows
  // without a training slot read an appended zero row). Rows >= a slot's rank
  // are zero in A and B, so the full R columns add exact zeros and their
  // gradients stay exactly zero; gradients reach only the grouped slots, in
  // place, as Delta's do. x must have routing.rows rows. pass, when given,
  // is PassGroup(t.group, routing.slots, ComputeType(x), ...) made once for
  // the pass: t's factors are then views of it (no gather or cast per use).
  at::Tensor GroupedDelta(const LoraTarget& t, const at::Tensor& x, const LoraGroups& routing,
                          const PassFactors* pass = nullptr) const;
  // Group g's columns of the given slots' flat rows, cast to ct: [U, len]
  // (GroupColumns(g).second columns), without a graph. The factors change
  // only in the optimizer, so one cast serves a whole pass.
  at::Tensor CastGroup(TargetGroup g, const at::Tensor& slots, at::ScalarType ct) const;
  // Group g's factors of the given slots for one pass: CastGroup, and with
  // grads a zero gradient buffer and its flush token (PassFactors). Only
  // for a pass whose backward runs once over every LoRA node (no layer
  // recomputed: a recomputed layer's own backward would reach the token).
  PassFactors PassGroup(TargetGroup g, const at::Tensor& slots, at::ScalarType ct, bool grads) const;
  // The most distinct slots whose group factors a pass casts once
  // (PassGroup); beyond it each target gathers and casts its own. What the
  // casts cost past the two slots of the memory plan's probes is
  // PassGroupBytes a slot (the engine's plan leaves room for it).
  static constexpr int64_t kCastOncePerPassUpTo = 16;
  // One slot's PassGroup copies of the attn and mlp groups in ct, with
  // their gradient buffers: bytes (groups holding experts are never cast).
  double PassGroupBytes(at::ScalarType ct) const {
    double bytes = 0;
    for (TargetGroup g : {TargetGroup::kAttn, TargetGroup::kMlp})
      if (!GroupHasExperts(g)) bytes += 2.0 * static_cast<double>(GroupColumns(g).second) * at::elementSize(ct);
    return bytes;
  }
  // Whether group g holds expert targets (whose factors a pass never uses
  // through the grouped form: MoeForward routes them itself).
  bool GroupHasExperts(TargetGroup g) const { return group_has_experts_[static_cast<int>(g)]; }
  // Plain target t's leaves and its factors (and gradient slots) as views of pass (PassGroup of t.group).
  JointTarget CastFactors(const LoraTarget& t, const PassFactors& pass) const;

 private:
  int num_slots_;
  int max_rank_;
  at::Device device_;
  std::vector<LoraTarget> targets_;
  std::vector<SlotState> slots_;
  std::optional<LoraForm> forced_form_;
  bool ragged_ = false;
  at::Tensor flat_, flat_grad_;
  std::pair<int64_t, int64_t> group_cols_[3];
  at::Tensor scales_;
  bool lora_fp32_ = false;
  bool group_has_experts_[3] = {false, false, false};
};

}  // namespace loom::engine
