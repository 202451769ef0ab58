#include "engine/train/adamw.h"

#include <c10/core/GradMode.h>
#include "engine/train/text.h"
#if LOOM_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "engine/train/cuda/adamw_kernels.h"
#endif

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>

namespace loom::engine::train {
namespace {

at::Tensor Column(const std::vector<double>& v, at::Device device) {
  std::vector<float> f(v.begin(), v.end());
  return at::tensor(f, at::kFloat).to(device);
}

// [U] → [U, 1, ..., 1] so it broadcasts over a [U, ...] block of rows.
at::Tensor Spread(const at::Tensor& col, int64_t dims) {
  std::vector<int64_t> shape(static_cast<size_t>(dims), 1);
  shape[0] = col.size(0);
  return col.view(shape);
}

// The slots of one round that step targets of group g: those live[k] for
// which take(k) holds and whose slot trains g, with their factors' inputs.
struct GroupSteps {
  std::vector<size_t> ks;  // indices into live
  std::vector<int64_t> slots, steps;
  std::vector<AdamParams> params;
  std::vector<double> scales;
  bool empty() const { return slots.empty(); }
  AdamWRows Rows(at::Device device) const { return AdamWRows::Make(slots, params, steps, scales, device); }
};

template <typename Take>
GroupSteps StepsOf(const SlotBank& bank, const std::vector<OptimStepCall>& calls, const std::vector<size_t>& live,
                   const std::vector<double>& scale, TargetGroup g, Take&& take) {
  GroupSteps r;
  for (size_t k = 0; k < live.size(); ++k) {
    const int s = calls[live[k]].slot;
    if (!take(k) || !bank.trains(s, g)) continue;
    r.ks.push_back(k);
    r.slots.push_back(s);
    r.params.push_back(calls[live[k]].params);
    r.steps.push_back(bank.slot(s).step + 1);
    r.scales.push_back(scale[k]);
  }
  return r;
}

}  // namespace

AdamWRows AdamWRows::Make(const std::vector<int64_t>& slots, const std::vector<AdamParams>& params,
                          const std::vector<int64_t>& steps, const std::vector<double>& grad_scales,
                          at::Device device) {
  const size_t u = slots.size();
  std::vector<double> decay(u), b1(u), omb1(u), b2(u), omb2(u), inv_bc2(u), eps(u), step_size(u);
  for (size_t i = 0; i < u; ++i) {
    const AdamParams& p = params[i];
    const double t = static_cast<double>(steps[i]);
    decay[i] = 1.0 - p.learning_rate * p.weight_decay;
    b1[i] = p.beta1;
    omb1[i] = 1.0 - p.beta1;
    b2[i] = p.beta2;
    omb2[i] = 1.0 - p.beta2;
    inv_bc2[i] = 1.0 / std::sqrt(1.0 - std::pow(p.beta2, t));
    eps[i] = p.eps;
    step_size[i] = p.learning_rate / (1.0 - std::pow(p.beta1, t));
  }
  AdamWRows r;
  r.index = at::tensor(slots, at::kLong).to(device);
  r.grad_scale = Column(grad_scales, device);
  r.decay = Column(decay, device);
  r.beta1 = Column(b1, device);
  r.one_minus_beta1 = Column(omb1, device);
  r.beta2 = Column(b2, device);
  r.one_minus_beta2 = Column(omb2, device);
  r.inv_sqrt_bc2 = Column(inv_bc2, device);
  r.eps = Column(eps, device);
  r.step_size = Column(step_size, device);
  return r;
}

namespace {

// The updated rows.index rows of param and its moments, computed out of place.
struct UpdatedRows {
  at::Tensor p, m, v;
};

UpdatedRows ComputeRows(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq, const AdamWRows& rows) {
  const int64_t dims = param.dim();
  auto s = [&](const at::Tensor& col) { return Spread(col, dims); };
  UpdatedRows u;
  u.p = param.detach().index_select(0, rows.index);
  u.m = exp_avg.index_select(0, rows.index);
  u.v = exp_avg_sq.index_select(0, rows.index);
  at::Tensor g = grad.defined() ? grad.index_select(0, rows.index).to(at::kFloat) * s(rows.grad_scale)
                                : at::zeros_like(u.p);
  u.p.mul_(s(rows.decay));
  u.m.mul_(s(rows.beta1)).add_(g * s(rows.one_minus_beta1));
  u.v.mul_(s(rows.beta2)).add_(g * g * s(rows.one_minus_beta2));
  at::Tensor denom = (u.v.sqrt() * s(rows.inv_sqrt_bc2)).add_(s(rows.eps));
  u.p.sub_(u.m / denom * s(rows.step_size));
  return u;
}

// The multi-tensor AdamW update of p, m, v, with gradients g and the
// per-entry factors f (gscale, decay, b1, 1-b1, b2, 1-b2, 1/sqrt(bc2), eps,
// -step size). In place, or (in_place false) into new tensors that replace
// the lists' entries, leaving the tensors they named untouched: the first
// multiply of each list writes a fresh tensor, so no separate copy is made.
void ForeachAdamW(std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g, std::vector<at::Tensor>& m,
                  std::vector<at::Tensor>& v, const std::vector<at::Scalar> (&f)[9], bool in_place) {
  const std::vector<at::Tensor> gs = at::_foreach_mul(g, f[0]);
  const auto scale = [&](std::vector<at::Tensor>& x, const std::vector<at::Scalar>& by) {
    if (in_place) at::_foreach_mul_(x, by);
    else x = at::_foreach_mul(x, by);
  };
  scale(p, f[1]);
  scale(m, f[2]);
  at::_foreach_add_(m, at::_foreach_mul(gs, f[3]));
  scale(v, f[4]);
  at::_foreach_addcmul_(v, gs, gs, f[5]);
  std::vector<at::Tensor> denom = at::_foreach_sqrt(v);
  at::_foreach_mul_(denom, f[6]);
  at::_foreach_add_(denom, f[7]);
  at::_foreach_addcdiv_(p, m, denom, f[8]);
}

}  // namespace

void AdamWUpdateRows(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const AdamWRows& rows) {
  if (rows.size() == 0) return;
  c10::NoGradGuard no_grad;
  const UpdatedRows u = ComputeRows(param, grad, exp_avg, exp_avg_sq, rows);
  param.detach().index_copy_(0, rows.index, u.p);
  exp_avg.index_copy_(0, rows.index, u.m);
  exp_avg_sq.index_copy_(0, rows.index, u.v);
}

Status ValidateAdamParams(const AdamParams& p) {
  auto check = [](const char* name, double v, double lo, double hi, bool hi_open) -> Status {
    if (!std::isfinite(v) || v < lo || (hi_open ? v >= hi : v > hi)) {
      return Status::Invalid(Cat("adam_params.", name, ": ", v, " is outside [", lo, ", ", hi, hi_open ? ")" : "]"));
    }
    return Status::Ok();
  };
  const double inf = HUGE_VAL;
  for (Status s : {check("learning_rate", p.learning_rate, 0, inf, false), check("beta1", p.beta1, 0, 1, true),
                   check("beta2", p.beta2, 0, 1, true), check("eps", p.eps, 0, inf, false),
                   check("weight_decay", p.weight_decay, 0, inf, false),
                   check("grad_clip_norm", p.grad_clip_norm, 0, inf, false)}) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

SlotOptimizer::SlotOptimizer(const SlotBank& bank, bool moments_on_host, int64_t stage_bytes) : on_host_(moments_on_host) {
  const at::Tensor& flat = bank.flat();
  if (flat.is_cuda() || on_host_) path_ = Path::kForeach;
  if (on_host_) {
    const auto host = flat.options().device(at::kCPU).pinned_memory(flat.is_cuda());
    exp_avg_ = at::zeros(flat.sizes(), host);
    exp_avg_sq_ = at::zeros(flat.sizes(), host);
    const int64_t row_bytes = 2 * 4 * std::max<int64_t>(1, flat.size(1));
    stage_rows_ = std::clamp<int64_t>(stage_bytes / row_bytes, 1, std::max<int64_t>(1, flat.size(0)));
    stage_m_ = at::zeros({stage_rows_, flat.size(1)}, flat.options());
    stage_v_ = at::zeros({stage_rows_, flat.size(1)}, flat.options());
    staged_row_.assign(static_cast<size_t>(flat.size(0)), -1);
  } else {
    exp_avg_ = at::zeros_like(flat);
    exp_avg_sq_ = at::zeros_like(flat);
  }
  for (const LoraTarget& t : bank.targets()) {
    a_.push_back({bank.FactorView(exp_avg_, t, true), bank.FactorView(exp_avg_sq_, t, true)});
    b_.push_back({bank.FactorView(exp_avg_, t, false), bank.FactorView(exp_avg_sq_, t, false)});
  }
}

void SlotOptimizer::set_path(Path p) {
  if (on_host_ && p == Path::kRows)
    throw std::invalid_argument("SlotOptimizer: the rows path needs the moments beside the bank, not on the host");
  path_ = p;
}

at::Tensor SlotOptimizer::MomentRow(bool first, int64_t s) const {
  if (!on_host_) return (first ? exp_avg_ : exp_avg_sq_).select(0, s);
  const int64_t row = staged_row_.at(static_cast<size_t>(s));
  if (row < 0) throw std::logic_error(Cat("SlotOptimizer: slot ", s, "'s moments are not staged"));
  return (first ? stage_m_ : stage_v_).select(0, row);
}

void SlotOptimizer::Reset(int s) {
  c10::NoGradGuard no_grad;
  exp_avg_.select(0, s).zero_();
  exp_avg_sq_.select(0, s).zero_();
}

std::vector<Result<OptimStepOutput>> SlotOptimizer::Step(SlotBank& bank, const std::vector<OptimStepCall>& calls) {
  std::vector<Result<OptimStepOutput>> results(calls.size(), Result<OptimStepOutput>(Status::Internal("not run")));
  // Rounds of distinct slots, in call order: a slot listed twice steps twice.
  std::vector<size_t> round;
  std::set<int> in_round;
  for (size_t i = 0; i < calls.size(); ++i) {
    if (in_round.count(calls[i].slot)) {
      StepRound(bank, calls, round, results);
      round.clear();
      in_round.clear();
    }
    round.push_back(i);
    in_round.insert(calls[i].slot);
  }
  if (!round.empty()) StepRound(bank, calls, round, results);
  // The staged-out host rows are current before anyone reads them (a
  // checkpoint save, Reset, the next stage-in of the same slot is ordered anyway).
#if LOOM_CUDA_KERNELS
  if (on_host_ && bank.flat().is_cuda()) c10::cuda::getCurrentCUDAStream().synchronize();
#endif
  return results;
}

void SlotOptimizer::StepRound(SlotBank& bank, const std::vector<OptimStepCall>& calls,
                              const std::vector<size_t>& which, std::vector<Result<OptimStepOutput>>& results) {
  if (!on_host_) return StepResident(bank, calls, which, results);
  c10::NoGradGuard no_grad;
  for (size_t begin = 0; begin < which.size(); begin += static_cast<size_t>(stage_rows_)) {
    const size_t end = std::min(which.size(), begin + static_cast<size_t>(stage_rows_));
    const std::vector<size_t> chunk(which.begin() + static_cast<std::ptrdiff_t>(begin),
                                    which.begin() + static_cast<std::ptrdiff_t>(end));
    std::vector<int64_t> staged;  // slots in range, in staging-row order (a round's slots are distinct)
    for (size_t i : chunk) {
      const int s = calls[i].slot;
      if (s < 0 || s >= bank.num_slots()) continue;
      const int64_t row = static_cast<int64_t>(staged.size());
      staged_row_[static_cast<size_t>(s)] = row;
      stage_m_.select(0, row).copy_(exp_avg_.select(0, s), /*non_blocking=*/true);
      stage_v_.select(0, row).copy_(exp_avg_sq_.select(0, s), /*non_blocking=*/true);
      staged.push_back(s);
    }
    StepResident(bank, calls, chunk, results);
    for (size_t row = 0; row < staged.size(); ++row) {
      const int64_t s = staged[row];
      exp_avg_.select(0, s).copy_(stage_m_.select(0, static_cast<int64_t>(row)), /*non_blocking=*/true);
      exp_avg_sq_.select(0, s).copy_(stage_v_.select(0, static_cast<int64_t>(row)), /*non_blocking=*/true);
      staged_row_[static_cast<size_t>(s)] = -1;
    }
  }
}

at::Tensor SlotOptimizer::SquaredNorms(const SlotBank& bank, const std::vector<int64_t>& slots,
                                       const at::Tensor& index) const {
  const auto& targets = bank.targets();
  const at::Device device = index.device();
  const int64_t u = static_cast<int64_t>(slots.size());
  at::Tensor sq = at::zeros({u}, at::TensorOptions().dtype(at::kDouble).device(device));
  if (path_ == Path::kForeach) {
    // The live slots' flat gradient rows; per group (a column range), one
    // fp64-accumulated sum of squares, masked by whether the slot trains it.
    // On CUDA straight from the rows (SquaredSums, fp64 partial sums added
    // in a fixed order); elsewhere from a gathered copy.
    const TargetGroup groups[] = {TargetGroup::kAttn, TargetGroup::kMlp, TargetGroup::kUnembed};
    const at::Tensor& flat_grad = bank.flat_grad();
    at::Tensor rows;
    std::vector<double> mask;  // [group][slot]: whether the slot trains the group
    for (TargetGroup g : groups)
      for (int64_t s : slots) mask.push_back(bank.trains(static_cast<int>(s), g) ? 1.0 : 0.0);
    const at::Tensor masks = at::tensor(mask, at::kDouble).view({3, u}).to(device, /*non_blocking=*/true);
    for (int gi = 0; gi < 3; ++gi) {
      const auto [begin, len] = bank.GroupColumns(groups[gi]);
      if (len == 0) continue;
      at::Tensor sums;
#if LOOM_CUDA_KERNELS
      if (flat_grad.is_cuda() && index.is_contiguous() && index.scalar_type() == at::kLong) {
        at::Tensor partial = at::empty({u, cuda::SquaredSumBlocks(len)}, sq.options());
        cuda::SquaredSums(flat_grad.data_ptr<float>() + begin, flat_grad.stride(0), index.data_ptr<int64_t>(), u, len,
                          partial.data_ptr<double>(), c10::cuda::getCurrentCUDAStream(device.index()).stream());
        sums = partial.sum(1);
      }
#endif
      if (!sums.defined()) {
        if (!rows.defined()) rows = flat_grad.index_select(0, index);
        sums = rows.narrow(1, begin, len).square().sum({1}, false, at::kDouble);
      }
      sq.add_(sums * masks[gi]);
    }
    return sq;
  }
  // Per target: the rows of every slot, masked by whether the slot trains it.
  const TargetGroup groups[] = {TargetGroup::kAttn, TargetGroup::kMlp, TargetGroup::kUnembed};
  at::Tensor group_mask[3];
  for (int g = 0; g < 3; ++g) {
    std::vector<double> mask;
    for (int64_t s : slots) mask.push_back(bank.trains(static_cast<int>(s), groups[g]) ? 1.0 : 0.0);
    group_mask[g] = at::tensor(mask, at::kDouble).to(device);
  }
  for (const LoraTarget& t : targets) {
    for (const at::Tensor* p : {&t.A, &t.B}) {
      const at::Tensor& grad = p->grad();
      if (!grad.defined()) continue;
      at::Tensor rows = grad.index_select(0, index).to(at::kDouble);
      sq.add_(rows.pow(2).flatten(1).sum(1) * group_mask[static_cast<int>(t.group)]);
    }
  }
  return sq;
}

at::Tensor SlotOptimizer::GlobalSquaredNorms(const SlotBank& bank, const std::vector<int64_t>& slots,
                                             const at::Tensor& index, const at::Tensor& sq) const {
  // The whole factors' squares (kWhole, and kPartial ones, summed after each
  // pass) are the same on every rank: each rank adds 1/size of them.
  at::Tensor whole = at::zeros_like(sq);
  for (const LoraTarget& t : bank.targets()) {
    std::vector<double> mask;
    for (int64_t s : slots) mask.push_back(bank.trains(static_cast<int>(s), t.group) ? 1.0 : 0.0);
    const at::Tensor m = at::tensor(mask, at::kDouble).to(sq.device());
    for (auto [p, shard] : {std::pair{&t.A, &t.a_shard}, std::pair{&t.B, &t.b_shard}}) {
      if (shard->kind == ShardKind::kSplit || !p->grad().defined()) continue;
      whole.add_(p->grad().index_select(0, index).to(at::kDouble).pow(2).flatten(1).sum(1) * m);
    }
  }
  at::Tensor global = sq - whole + whole / static_cast<double>(tp_->size());
  tp_->AllReduceSum(global);
  return global;
}

SlotOptimizer::ForeachLists SlotOptimizer::BuildForeachLists(const SlotBank& bank, const std::vector<int64_t>& slots,
                                                              const std::vector<AdamParams>& params,
                                                              const std::vector<int64_t>& steps,
                                                              const std::vector<double>& scales,
                                                              TargetGroup group) const {
  ForeachLists l;
  // One entry per slot: the group's columns of its flat rows (weights,
  // gradient, moments), each one contiguous span.
  const auto [begin, len] = bank.GroupColumns(group);
  if (len == 0) return l;
  const at::Tensor p = bank.flat().narrow(1, begin, len), g = bank.flat_grad().narrow(1, begin, len);
  for (size_t k = 0; k < slots.size(); ++k) {
    const AdamParams& a = params[k];
    const double step = static_cast<double>(steps[k]);
    // The same fp32 factors AdamWRows::Make computes.
    const float f[9] = {static_cast<float>(scales[k]),
                        static_cast<float>(1.0 - a.learning_rate * a.weight_decay),
                        static_cast<float>(a.beta1),
                        static_cast<float>(1.0 - a.beta1),
                        static_cast<float>(a.beta2),
                        static_cast<float>(1.0 - a.beta2),
                        static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(a.beta2, step))),
                        static_cast<float>(a.eps),
                        -static_cast<float>(a.learning_rate / (1.0 - std::pow(a.beta1, step)))};
    const int64_t s = slots[k];
    l.p.push_back(p.select(0, s));
    l.g.push_back(g.select(0, s));
    l.m.push_back(MomentRow(true, s).narrow(0, begin, len));
    l.v.push_back(MomentRow(false, s).narrow(0, begin, len));
    l.owners.push_back(static_cast<int64_t>(k));
    for (int i = 0; i < 9; ++i) l.f[i].push_back(f[i]);
  }
  return l;
}

void SlotOptimizer::ForeachUpdate(SlotBank& bank, const std::vector<int64_t>& slots,
                                  const std::vector<AdamParams>& params, const std::vector<int64_t>& steps,
                                  const std::vector<double>& scales, TargetGroup group) {
  c10::NoGradGuard no_grad;
  ForeachLists l = BuildForeachLists(bank, slots, params, steps, scales, group);
  if (l.p.empty()) return;
#if LOOM_CUDA_KERNELS
  // On CUDA one kernel a span (adamw_kernels.h), the same arithmetic.
  if (l.p[0].is_cuda()) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(l.p[0].device().index()).stream();
    for (size_t e = 0; e < l.p.size(); ++e) {
      cuda::AdamWFactors f;
      for (int i = 0; i < 9; ++i) f.f[i] = l.f[i][e].toFloat();
      cuda::AdamWStep(l.p[e].data_ptr<float>(), l.g[e].data_ptr<float>(), l.m[e].data_ptr<float>(),
                      l.v[e].data_ptr<float>(), l.p[e].numel(), f, stream);
    }
    return;
  }
#endif
  ForeachAdamW(l.p, l.g, l.m, l.v, l.f, /*in_place=*/true);
}

std::vector<bool> SlotOptimizer::ForeachProvenFinite(const SlotBank& bank, const std::vector<int64_t>& slots,
                                                     const std::vector<AdamParams>& params,
                                                     const std::vector<int64_t>& steps,
                                                     const std::vector<double>& scales, TargetGroup group) const {
  c10::NoGradGuard no_grad;
  const ForeachLists l = BuildForeachLists(bank, slots, params, steps, scales, group);
  std::vector<bool> proven(slots.size(), true);
  if (l.p.empty()) return proven;
  // max |x| per entry of each list: one multi-tensor reduction over the four
  // lists side by side, one host copy, read as [4, entries].
  std::vector<at::Tensor> all;
  all.reserve(4 * l.p.size());
  for (const std::vector<at::Tensor>* list : {&l.p, &l.m, &l.v, &l.g}) all.insert(all.end(), list->begin(), list->end());
  const at::Tensor maxima = at::stack(at::_foreach_norm(all, at::Scalar(HUGE_VAL)))
                                .to(at::kDouble)
                                .view({4, static_cast<int64_t>(l.p.size())})
                                .cpu();
  const auto mx = maxima.accessor<double, 2>();
  // Bounds of the update's magnitudes from the inputs' (ForeachAdamW's
  // order): |v'| <= b2 |v| + (1-b2) |g s|^2, |m'| <= b1 |m| + (1-b1) |g s|,
  // |p'| <= |decay| |p| + step |m'| / eps. Far below FLT_MAX (3.4e38), fp32
  // rounding cannot carry a value past it; NaN or inf inputs compare false.
  constexpr double kBound = 1e37;
  for (size_t e = 0; e < l.p.size(); ++e) {
    const auto f = [&](int i) { return l.f[i][e].toDouble(); };
    const double g = f(0) * mx[3][e];
    const double v = f(4) * mx[2][e] + f(5) * g * g;
    const double m = f(2) * mx[1][e] + f(3) * g;
    const double p = std::abs(f(1)) * mx[0][e] + std::abs(f(8)) * m / f(7);
    if (f(7) > 0 && v <= kBound && p <= kBound) continue;
    proven[static_cast<size_t>(l.owners[e])] = false;
  }
  return proven;
}

at::Tensor SlotOptimizer::ForeachStaysFinite(const SlotBank& bank, const std::vector<int64_t>& slots,
                                             const std::vector<AdamParams>& params, const std::vector<int64_t>& steps,
                                             const std::vector<double>& scales, TargetGroup group) const {
  c10::NoGradGuard no_grad;
  const ForeachLists l = BuildForeachLists(bank, slots, params, steps, scales, group);
  const at::Device device = bank.targets()[0].A.device();
  at::Tensor bad = at::zeros({static_cast<int64_t>(slots.size())}, at::TensorOptions().device(device));
  // Chunks of list entries of at most 2^26 elements each (256 MiB per fp32
  // list), so the out-of-place update never holds more than a few of those.
  constexpr int64_t kChunkElements = int64_t{1} << 26;
  for (size_t begin = 0; begin < l.p.size();) {
    size_t end = begin;
    int64_t n = 0;
    while (end < l.p.size() && (end == begin || n + l.p[end].numel() <= kChunkElements)) n += l.p[end++].numel();
    auto cut = [&](const auto& list) { return std::vector(list.begin() + begin, list.begin() + end); };
    std::vector<at::Tensor> p = cut(l.p), m = cut(l.m), v = cut(l.v);
    std::vector<at::Scalar> f[9];
    for (int i = 0; i < 9; ++i) f[i] = cut(l.f[i]);
    // The update of ForeachUpdate, out of place.
    ForeachAdamW(p, cut(l.g), m, v, f, /*in_place=*/false);
    // x * 0 is 0 where x is finite and NaN elsewhere, so one norm per entry
    // says whether the entry is all finite (a norm of x itself could
    // overflow on finite values). The first moment needs no check:
    // |m'| <= max(|m|, |g|), both finite.
    at::Tensor entry_bad = at::zeros({static_cast<int64_t>(end - begin)}, bad.options());
    for (const std::vector<at::Tensor>* list : {&p, &v}) {
      const std::vector<at::Tensor> zeroed = at::_foreach_mul(*list, at::Scalar(0.0));
      entry_bad.add_(at::logical_not(at::isfinite(at::stack(at::_foreach_norm(zeroed)))).to(at::kFloat));
    }
    const std::vector<int64_t> owner(l.owners.begin() + static_cast<std::ptrdiff_t>(begin),
                                     l.owners.begin() + static_cast<std::ptrdiff_t>(end));
    bad.index_add_(0, at::tensor(owner, at::kLong).to(device), entry_bad);
    begin = end;
  }
  return bad.eq(0);
}

// The rows path's updated rows of one target, computed once for the check
// and written after it (only the rows of slots whose step is taken).
struct SlotOptimizer::PendingRows {
  size_t target = 0;
  at::Tensor index;        // the group's stepped slots, [U]
  std::vector<size_t> ks;  // index k (into live) of each
  UpdatedRows a, b;
};

std::vector<bool> SlotOptimizer::Stable(const SlotBank& bank, const std::vector<OptimStepCall>& calls,
                                        const std::vector<size_t>& live, const std::vector<bool>& finite,
                                        const std::vector<double>& scale,
                                        std::vector<PendingRows>* pending) const {
  std::vector<bool> stable(live.size(), true);
  const auto& targets = bank.targets();
  if (targets.empty()) return stable;
  const at::Device device = targets[0].A.device();
  const TargetGroup groups[] = {TargetGroup::kAttn, TargetGroup::kMlp, TargetGroup::kUnembed};
  // ok[k] accumulates on the device over every target the slot trains.
  at::Tensor ok = at::ones({static_cast<int64_t>(live.size())}, at::TensorOptions().dtype(at::kBool).device(device));
  for (TargetGroup g : groups) {
    const GroupSteps gs = StepsOf(bank, calls, live, scale, g, [&](size_t k) { return finite[k]; });
    if (gs.empty()) continue;
    at::Tensor group_ok;
    if (path_ == Path::kForeach) {
      // Bounds prove most steps finite; the rest get the exact dry run.
      const std::vector<bool> proven = ForeachProvenFinite(bank, gs.slots, gs.params, gs.steps, gs.scales, g);
      group_ok = at::ones({static_cast<int64_t>(gs.slots.size())}, ok.options());
      GroupSteps rest;
      std::vector<int64_t> at_rest;  // positions in gs of rest's slots
      for (size_t i = 0; i < proven.size(); ++i) {
        if (proven[i]) continue;
        at_rest.push_back(static_cast<int64_t>(i));
        rest.slots.push_back(gs.slots[i]);
        rest.params.push_back(gs.params[i]);
        rest.steps.push_back(gs.steps[i]);
        rest.scales.push_back(gs.scales[i]);
      }
      if (!rest.empty())
        group_ok.index_copy_(0, at::tensor(at_rest, at::kLong).to(device),
                             ForeachStaysFinite(bank, rest.slots, rest.params, rest.steps, rest.scales, g));
    } else {
      const AdamWRows rows = gs.Rows(device);
      group_ok = at::ones({rows.size()}, ok.options());
      const auto finite_rows = [](const at::Tensor& t) { return at::isfinite(t).flatten(1).all(1); };
      for (size_t ti = 0; ti < targets.size(); ++ti) {
        const LoraTarget& t = targets[ti];
        if (t.group != g) continue;
        PendingRows pr{ti, rows.index, gs.ks, ComputeRows(t.A, t.A.grad(), a_[ti].exp_avg, a_[ti].exp_avg_sq, rows),
                       ComputeRows(t.B, t.B.grad(), b_[ti].exp_avg, b_[ti].exp_avg_sq, rows)};
        // The first moment needs no check: |m'| <= max(|m|, |g|), both finite.
        for (const UpdatedRows* u : {&pr.a, &pr.b})
          for (const at::Tensor* x : {&u->p, &u->v}) group_ok.logical_and_(finite_rows(*x));
        pending->push_back(std::move(pr));
      }
    }
    const std::vector<int64_t> ks(gs.ks.begin(), gs.ks.end());
    const at::Tensor at_k = at::tensor(ks, at::kLong).to(device);
    ok.index_copy_(0, at_k, ok.index_select(0, at_k).logical_and(group_ok));
  }
  const at::Tensor host = ok.cpu();
  const bool* h = host.data_ptr<bool>();
  for (size_t k = 0; k < live.size(); ++k) stable[k] = h[k];
  return stable;
}

void SlotOptimizer::StepResident(SlotBank& bank, const std::vector<OptimStepCall>& calls,
                                 const std::vector<size_t>& which, std::vector<Result<OptimStepOutput>>& results) {
  c10::NoGradGuard no_grad;
  std::vector<size_t> live;  // indices into calls that passed the checks
  for (size_t i : which) {
    const OptimStepCall& c = calls[i];
    if (c.slot < 0 || c.slot >= bank.num_slots()) {
      results[i] = Status::Invalid(Cat("slot: ", c.slot, " is outside [0, ", bank.num_slots(), ")"));
      continue;
    }
    if (!bank.slot(c.slot).bound) {
      results[i] = Status::Precondition(Cat("slot ", c.slot, " is not bound to a model"));
      continue;
    }
    Status s = ValidateAdamParams(c.params);
    if (!s.ok()) {
      results[i] = s;
      continue;
    }
    live.push_back(i);
  }
  if (live.empty()) return;
  auto& targets = bank.targets();
  const at::Device device = targets.empty() ? at::Device(at::kCPU) : targets[0].A.device();
  std::vector<int64_t> slots;
  for (size_t i : live) slots.push_back(calls[i].slot);
  at::Tensor all_index = at::tensor(slots, at::kLong).to(device);

  at::Tensor sq = SquaredNorms(bank, slots, all_index);
  if (tp_ != nullptr) sq = GlobalSquaredNorms(bank, slots, all_index, sq);
  const TargetGroup groups[] = {TargetGroup::kAttn, TargetGroup::kMlp, TargetGroup::kUnembed};
  at::Tensor norms_host = sq.sqrt().cpu();
  const double* norms = norms_host.data_ptr<double>();

  // Per group: the finite slots that train it, with their hyperparameters.
  std::vector<bool> finite(live.size());
  std::vector<double> scale(live.size(), 1.0);
  for (size_t k = 0; k < live.size(); ++k) {
    finite[k] = std::isfinite(norms[k]);
    const double clip = calls[live[k]].params.grad_clip_norm;
    if (finite[k] && clip > 0) scale[k] = std::min(1.0, clip / (norms[k] + 1e-6));
  }
  // A step whose result would not be finite anywhere in the slot (weights or
  // moments: an extreme learning rate or decay, a gradient whose square
  // overflows fp32) is not taken at all: the slot keeps its weights, moments,
  // step and gradients, and its call fails. Found by running the update out
  // of place first (one host sync for all slots), so nothing is written yet.
  std::vector<PendingRows> pending;  // the rows path's computed update
  std::vector<bool> stable = Stable(bank, calls, live, finite, scale, &pending);
  if (tp_ != nullptr) {  // a slot steps on every rank or on none
    std::vector<int64_t> mine(stable.begin(), stable.end());
    at::Tensor all = at::tensor(mine, at::kLong).to(device);
    tp_->AllReduceMin(all);
    const at::Tensor host = all.cpu();
    for (size_t k = 0; k < stable.size(); ++k) stable[k] = host.data_ptr<int64_t>()[k] != 0;
  }
  auto steps_now = [&](size_t k) { return finite[k] && stable[k]; };

  if (path_ == Path::kForeach) {
    for (int g = 0; g < 3; ++g) {
      const GroupSteps gs = StepsOf(bank, calls, live, scale, groups[g], steps_now);
      if (!gs.empty()) ForeachUpdate(bank, gs.slots, gs.params, gs.steps, gs.scales, groups[g]);
    }
  }
  for (const PendingRows& pr : pending) {
    std::vector<int64_t> keep;  // positions in pr.ks whose slot steps
    for (size_t i = 0; i < pr.ks.size(); ++i)
      if (stable[pr.ks[i]]) keep.push_back(static_cast<int64_t>(i));
    if (keep.empty()) continue;
    const bool all = keep.size() == pr.ks.size();
    const at::Tensor sel = all ? at::Tensor() : at::tensor(keep, at::kLong).to(device);
    const auto pick = [&](const at::Tensor& t) { return all ? t : t.index_select(0, sel); };
    const at::Tensor index = pick(pr.index);
    const LoraTarget& t = targets[pr.target];
    for (auto [param, mo, u] : {std::tuple{&t.A, &a_[pr.target], &pr.a}, std::tuple{&t.B, &b_[pr.target], &pr.b}}) {
      param->detach().index_copy_(0, index, pick(u->p));
      mo->exp_avg.index_copy_(0, index, pick(u->m));
      mo->exp_avg_sq.index_copy_(0, index, pick(u->v));
    }
  }
  // Every stepped or skipped slot starts its next accumulation from zero (a
  // slot whose step was refused keeps its gradients, for a retry).
  std::vector<int64_t> cleared;
  for (size_t k = 0; k < live.size(); ++k) {
    if (!stable[k]) continue;
    cleared.push_back(calls[live[k]].slot);
    bank.slot(calls[live[k]].slot).grad_dirty = false;
  }
  if (!cleared.empty() && path_ == Path::kForeach) {
    std::vector<int64_t> sorted = cleared;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::pair<int64_t, int64_t>> runs;  // (first slot, count) of consecutive slots
    for (int64_t s : sorted) {
      if (!runs.empty() && runs.back().first + runs.back().second == s) ++runs.back().second;
      else runs.push_back({s, 1});
    }
    for (const auto& [first, len] : runs) bank.flat_grad().narrow(0, first, len).zero_();
  } else if (!cleared.empty()) {
    const at::Tensor index = at::tensor(cleared, at::kLong).to(device);
    for (LoraTarget& t : targets) {
      for (at::Tensor* p : {&t.A, &t.B}) {
        if (p->grad().defined()) p->mutable_grad().index_fill_(0, index, 0.0);
      }
    }
  }
  for (size_t k = 0; k < live.size(); ++k) {
    const OptimStepCall& c = calls[live[k]];
    if (!stable[k]) {
      const AdamParams& a = c.params;
      results[live[k]] = Status::Invalid(
          Cat("adam_params: this step would make the adapter's weights or optimizer moments non-finite (learning_rate ",
              a.learning_rate, ", weight_decay ", a.weight_decay, ", eps ", a.eps, ", gradient norm ", norms[k],
              "); it was not applied: the adapter keeps its weights, moments, step and accumulated gradients"));
      continue;
    }
    SlotState& st = bank.slot(c.slot);
    OptimStepOutput out;
    out.skipped = !finite[k];
    if (finite[k]) {
      st.step += 1;
      out.metrics["grad_norm"] = norms[k];
    }
    out.metrics["step"] = static_cast<double>(st.step);
    out.metrics["learning_rate"] = c.params.learning_rate;
    out.metrics["skipped"] = out.skipped ? 1.0 : 0.0;
    results[live[k]] = out;
  }
}

}  // namespace loom::engine::train
