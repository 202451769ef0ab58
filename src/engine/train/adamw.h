// AdamW over a SlotBank: FP32 moments per slot laid out like the bank (one
// flat exp_avg and one exp_avg_sq [N, P] beside the bank's flat buffer, so
// one beside every A [N, R, d_in] and B [N, d_out, R] as views),
// stepped for several slots at once (index_select the slots' rows → math →
// index_copy_), with each slot's own hyperparameters and step count.
//
// The update is torch.optim.AdamW's (decoupled weight decay, bias correction
// with the slot's own step t):
//   p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
//   p ← p − lr/(1−β1^t) · m / (√v / √(1−β2^t) + eps)
// with g first scaled by min(1, clip/(‖g‖+1e-6)) when grad_clip_norm > 0,
// ‖g‖ being the global norm over the slot's trained targets.
//
// Invariant: only rows of the stepped slots change, and only in targets of
// groups the slot trains; rows ≥ a slot's rank keep zero weights because
// their gradients are zero. Threading: engine thread only.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "engine/api.h"
#include "engine/lora/slot_bank.h"
#include "engine/model/parallel.h"

namespace loom::engine::train {

// Hyperparameters of U slots stepped together, as [U] fp32 tensors on the
// device, already combined into the factors the update uses.
struct AdamWRows {
  at::Tensor index;        // [U] int64: the slot rows
  at::Tensor grad_scale;   // clip factor
  at::Tensor decay;        // 1 − lr·wd
  at::Tensor beta1, one_minus_beta1, beta2, one_minus_beta2;
  at::Tensor inv_sqrt_bc2; // 1 / √(1 − β2^t)
  at::Tensor eps;
  at::Tensor step_size;    // lr / (1 − β1^t)

  // steps[u] is the step number t of this update (≥ 1) for slots[u].
  static AdamWRows Make(const std::vector<int64_t>& slots, const std::vector<AdamParams>& params,
                        const std::vector<int64_t>& steps, const std::vector<double>& grad_scales,
                        at::Device device);
  int64_t size() const { return index.defined() ? index.size(0) : 0; }
};

// Steps rows.index of param (a [N, ...] tensor) in place with the matching
// rows of grad (undefined = zero), exp_avg and exp_avg_sq. Other rows are
// untouched.
void AdamWUpdateRows(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const AdamWRows& rows);

// Invalid naming the field when a value is non-finite or out of range
// (learning_rate ≥ 0, 0 ≤ beta < 1, eps ≥ 0, weight_decay ≥ 0, grad_clip_norm ≥ 0).
Status ValidateAdamParams(const AdamParams& params);

// SlotOptimizer: the moments of every slot of one bank and the per-slot step.
class SlotOptimizer {
 public:
  struct Moments {
    at::Tensor exp_avg;     // like the bank tensor, fp32 (a view of the flat moments)
    at::Tensor exp_avg_sq;
  };

  // The update path: kRows steps each target's rows with ~15 whole-tensor
  // kernels per A/B tensor (the reference); kForeach runs ~12 multi-tensor
  // (_foreach_*) kernels over one entry per (slot, group): the group's
  // columns of the slot's flat row (SlotBank::flat()), so neither the launch
  // count nor the host's list building scales with the number of targets.
  // Both give torch.optim.AdamW's numbers (kForeach within float rounding of
  // kRows). Default: kForeach on CUDA, kRows on CPU.
  enum class Path { kRows, kForeach };

  static constexpr int64_t kStageBytes = int64_t{4} << 30;
  // moments_on_host: the moments live in host memory (pinned when the bank
  // is on a GPU) instead of beside the bank, halving a slot's device bytes
  // (fp32 weights and gradient stay). Each step stages the stepped slots'
  // moment rows into a device buffer of at most stage_bytes (at least one
  // slot), updates them there, and copies them back; the numbers are the
  // resident path's. Host moments use the kForeach path on any device.
  explicit SlotOptimizer(const SlotBank& bank, bool moments_on_host = false, int64_t stage_bytes = kStageBytes);

  // Split over tensor-parallel ranks (engine/model/parallel.h): the global
  // norm counts every rank's split factors and the whole ones once, and a
  // slot steps only where no rank's part would turn non-finite. Every rank
  // then steps the same slots with the same clip factor.
  void set_parallel(Collective* group) { tp_ = group; }

  // Throws std::invalid_argument for kRows when the moments are on the host.
  void set_path(Path p);
  Path path() const { return path_; }
  bool moments_on_host() const { return on_host_; }
  int64_t stage_rows() const { return stage_rows_; }

  Moments& a(size_t target) { return a_[target]; }
  Moments& b(size_t target) { return b_[target]; }
  const Moments& a(size_t target) const { return a_[target]; }
  const Moments& b(size_t target) const { return b_[target]; }

  // Zeroes slot s's moments (release, load without optimizer).
  void Reset(int s);

  // One AdamW step per call, batched across the calls' slots. A slot listed
  // twice is stepped twice, in order. Each result: metrics "grad_norm"
  // (before clipping; absent when not finite), "step", "learning_rate",
  // "skipped"; skipped = true when the norm was not finite (the slot's
  // gradients are zeroed and nothing else changes). After a step the slot's
  // gradients are zero. A step that would make any of the slot's weights or
  // moments non-finite fails its call (Invalid) and changes nothing.
  std::vector<Result<OptimStepOutput>> Step(SlotBank& bank, const std::vector<OptimStepCall>& calls);

 private:
  // One round of distinct slots; with host moments, in chunks of at most
  // stage_rows_ slots, each staged in, stepped by StepResident and staged out.
  void StepRound(SlotBank& bank, const std::vector<OptimStepCall>& calls, const std::vector<size_t>& which,
                 std::vector<Result<OptimStepOutput>>& results);
  void StepResident(SlotBank& bank, const std::vector<OptimStepCall>& calls, const std::vector<size_t>& which,
                    std::vector<Result<OptimStepOutput>>& results);
  // Slot s's row of exp_avg_ (first) or exp_avg_sq_: the resident row, or
  // with host moments its staged row (s must be staged).
  at::Tensor MomentRow(bool first, int64_t s) const;
  // Per live slot (calls[live[k]]): false when its step, with the grad
  // clip scale[k], would leave a weight or moment non-finite (true for slots
  // whose gradient is not finite: they are skipped, not stepped).
  // On the rows path the update is computed here, once, and kept in
  // *pending for StepRound to write.
  struct PendingRows;
  std::vector<bool> Stable(const SlotBank& bank, const std::vector<OptimStepCall>& calls,
                           const std::vector<size_t>& live, const std::vector<bool>& finite,
                           const std::vector<double>& scale, std::vector<PendingRows>* pending) const;
  // Squared global gradient norm per live slot (fp64 [U] on the device).
  at::Tensor SquaredNorms(const SlotBank& bank, const std::vector<int64_t>& slots, const at::Tensor& index) const;
  // With tp_: this rank's local squared norms sq made global (summed over
  // the ranks, with the factors that are whole on every rank counted once).
  at::Tensor GlobalSquaredNorms(const SlotBank& bank, const std::vector<int64_t>& slots, const at::Tensor& index,
                                const at::Tensor& sq) const;
  // The multi-tensor path's lists for group g: per slot one entry, the
  // group's columns of the slot's flat rows (SlotBank::flat(): weights,
  // gradient, moments), the index k (into slots) it belongs to, and the 9
  // fp32 factors (gscale, decay, b1, 1-b1, b2, 1-b2, 1/sqrt(bc2), eps,
  // -step size).
  struct ForeachLists {
    std::vector<at::Tensor> p, g, m, v;
    std::vector<int64_t> owners;
    std::vector<at::Scalar> f[9];
  };
  ForeachLists BuildForeachLists(const SlotBank& bank, const std::vector<int64_t>& slots,
                                 const std::vector<AdamParams>& params, const std::vector<int64_t>& steps,
                                 const std::vector<double>& scales, TargetGroup group) const;
  void ForeachUpdate(SlotBank& bank, const std::vector<int64_t>& slots, const std::vector<AdamParams>& params,
                     const std::vector<int64_t>& steps, const std::vector<double>& scales, TargetGroup group);
  // Per slot (host): true when bounds computed from the largest |weight|,
  // |moment| and |gradient| of the slot's entry (one multi-tensor max
  // reduction over the lists) prove that ForeachUpdate leaves it finite. A
  // false is no verdict: ForeachStaysFinite decides those slots.
  std::vector<bool> ForeachProvenFinite(const SlotBank& bank, const std::vector<int64_t>& slots,
                                        const std::vector<AdamParams>& params, const std::vector<int64_t>& steps,
                                        const std::vector<double>& scales, TargetGroup group) const;
  // [U] bool on the device: whether ForeachUpdate would leave each of slots'
  // weights and moments finite, exactly (the update run out of place, slot
  // by slot, in bounded chunks).
  at::Tensor ForeachStaysFinite(const SlotBank& bank, const std::vector<int64_t>& slots,
                                const std::vector<AdamParams>& params, const std::vector<int64_t>& steps,
                                const std::vector<double>& scales, TargetGroup group) const;
  at::Tensor exp_avg_, exp_avg_sq_;  // [N, P] like SlotBank::flat(); a_ and b_ are views of them
  std::vector<Moments> a_, b_;
  Path path_ = Path::kRows;
  bool on_host_ = false;
  // Host moments only: [stage_rows_, P] device buffers, and per slot its
  // staging row during a chunk (-1 = not staged).
  at::Tensor stage_m_, stage_v_;
  int64_t stage_rows_ = 0;
  std::vector<int64_t> staged_row_;
  Collective* tp_ = nullptr;
};

}  // namespace loom::engine::train
