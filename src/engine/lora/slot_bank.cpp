#include "engine/lora/slot_bank.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "common/hash.h"
#include "engine/lora/lora_nodes.h"
#include "engine/lora/slot_rows.h"

namespace loom::engine {
namespace {

// t with its non-finite entries replaced by exact zeros (RoutedDelta): one
// elementwise pass, and its gradient passes through where t was finite.
at::Tensor FiniteOrZero(const at::Tensor& t) { return at::nan_to_num(t, 0.0, 0.0, 0.0); }

// Uniform in [-bound, bound) from the top 53 bits of splitmix64. Its output
// is fixed by its definition, so an adapter's initial weights are the same on
// every libtorch version and device.
double UniformSym(uint64_t& state, double bound) {
  const double u = static_cast<double>(SplitMix64Next(state) >> 11) * (1.0 / 9007199254740992.0);
  return (2.0 * u - 1.0) * bound;
}

// Rows [0, rank) of A for one target: kaiming_uniform(a=sqrt(5)) as PEFT
// initialises lora_A, i.e. U(-1/sqrt(d_in), 1/sqrt(d_in)).
at::Tensor KaimingRows(uint64_t seed, const std::string& module, int64_t rank, int64_t d_in) {
  uint64_t state = seed * 0x9E3779B97F4A7C15ull ^ Fnv1a64(module);
  const double bound = 1.0 / std::sqrt(static_cast<double>(d_in));
  at::Tensor rows = at::empty({rank, d_in}, at::TensorOptions().dtype(at::kFloat));
  float* p = rows.data_ptr<float>();
  for (int64_t i = 0; i < rank * d_in; ++i) p[i] = static_cast<float>(UniformSym(state, bound));
  return rows;
}

bool TrainsGroup(const LoraConfig& c, TargetGroup g) {
  switch (g) {
    case TargetGroup::kAttn: return c.train_attn;
    case TargetGroup::kMlp: return c.train_mlp;
    case TargetGroup::kUnembed: return c.train_unembed;
  }
  return false;
}

}  // namespace

SlotBank::SlotBank(int num_slots, int max_rank, at::Device device, const std::vector<LoraTargetSpec>& targets)
    : num_slots_(num_slots), max_rank_(max_rank), device_(device), slots_(num_slots), ragged_(device.is_cuda()) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  targets_.reserve(targets.size());
  for (const LoraTargetSpec& spec : targets) {
    LoraTarget t;
    static_cast<LoraTargetSpec&>(t) = spec;
    targets_.push_back(std::move(t));
  }
  // Columns by group, each target's A then B, in target order within a group.
  int64_t cols = 0;
  for (int g = 0; g < 3; ++g) {
    const int64_t begin = cols;
    for (LoraTarget& t : targets_) {
      if (static_cast<int>(t.group) != g) continue;
      t.a_col = cols;
      cols += t.AElems(max_rank);
      t.b_col = cols;
      cols += t.BElems(max_rank);
    }
    group_cols_[g] = {begin, cols - begin};
  }
  flat_ = at::zeros({num_slots, cols}, opts);
  flat_grad_ = at::zeros({num_slots, cols}, opts);
  for (LoraTarget& t : targets_) {
    // Leaves sharing the flat buffer's storage (at:: factories ignore
    // requires_grad in 1.13: set it on the result).
    t.A = FactorView(flat_, t, true).detach().requires_grad_();
    t.B = FactorView(flat_, t, false).detach().requires_grad_();
    t.A.mutable_grad() = FactorView(flat_grad_, t, true);
    t.B.mutable_grad() = FactorView(flat_grad_, t, false);
  }
  scales_ = at::zeros({num_slots}, opts);
  for (const LoraTarget& t : targets_)
    if (t.is_expert()) group_has_experts_[static_cast<int>(t.group)] = true;
}

std::vector<int64_t> LoraTargetSpec::FactorShape(bool a, int64_t r) const {
  std::vector<int64_t> shape = a ? std::vector<int64_t>{r, d_in} : std::vector<int64_t>{d_out, r};
  if (per_expert == (a ? ExpertFactor::kA : ExpertFactor::kB)) shape.insert(shape.begin(), experts);
  return shape;
}

at::Tensor SlotBank::FactorView(const at::Tensor& buffer, const LoraTarget& t, bool a) const {
  std::vector<int64_t> shape = t.FactorShape(a, max_rank_);
  shape.insert(shape.begin(), num_slots_);
  return buffer.narrow(1, a ? t.a_col : t.b_col, a ? t.AElems(max_rank_) : t.BElems(max_rank_)).view(shape);
}

const LoraTarget* SlotBank::find(const std::string& module) const {
  for (const auto& t : targets_)
    if (t.module == module) return &t;
  return nullptr;
}

LoraTarget* SlotBank::find(const std::string& module) {
  for (auto& t : targets_)
    if (t.module == module) return &t;
  return nullptr;
}

bool SlotBank::trains(int s, TargetGroup g) const {
  if (s < 0 || s >= num_slots_ || !slots_[s].bound) return false;
  return TrainsGroup(slots_[s].config, g);
}

Status SlotBank::Bind(int s, const LoraConfig& config) {
  if (s < 0 || s >= num_slots_)
    return Status::Invalid("slot " + std::to_string(s) + " is outside [0, " + std::to_string(num_slots_) + ")");
  if (config.rank < 1 || config.rank > max_rank_)
    return Status::Invalid("lora_config.rank " + std::to_string(config.rank) + " must be in [1, " +
                           std::to_string(max_rank_) + "]");
  if (!(config.alpha > 0.0) || !std::isfinite(config.alpha))
    return Status::Invalid("lora alpha must be a finite number > 0");
  Release(s);
  c10::NoGradGuard no_grad;
  for (auto& t : targets_) {
    if (!TrainsGroup(config, t.group)) continue;
    if (t.per_expert == ExpertFactor::kA) {
      // Split over expert-parallel ranks: this rank's experts, by their whole index.
      const int64_t first = t.a_shard.kind == ShardKind::kSplit ? t.a_shard.offset : 0;
      for (int64_t e = 0; e < t.experts; ++e)
        t.A.select(0, s).select(0, e).narrow(0, 0, config.rank)
            .copy_(KaimingRows(config.seed, t.module + "." + std::to_string(first + e), config.rank, t.d_in));
      continue;
    }
    // A split A (its columns: a row-split target under tensor parallel) is
    // this rank's columns of the whole adapter's rows.
    const bool split = t.a_shard.kind == ShardKind::kSplit;
    at::Tensor rows = KaimingRows(config.seed, t.module, config.rank, split ? t.a_shard.full : t.d_in);
    if (split) rows = rows.narrow(1, t.a_shard.offset, t.d_in);
    t.A.select(0, s).narrow(0, 0, config.rank).copy_(rows);
  }
  slots_[s].bound = true;
  slots_[s].config = config;
  slots_[s].step = 0;
  scales_.select(0, s).fill_(config.alpha / config.rank);
  return Status::Ok();
}

void SlotBank::Release(int s) {
  if (s < 0 || s >= num_slots_) return;
  {
    c10::NoGradGuard no_grad;
    flat_.select(0, s).zero_();
    scales_.select(0, s).zero_();
  }
  ZeroGrad(s);
  slots_[s] = SlotState{};
}

void SlotBank::ZeroGrad(int s) {
  if (s < 0 || s >= num_slots_) return;
  slots_[s].grad_dirty = false;
  c10::NoGradGuard no_grad;
  flat_grad_.select(0, s).zero_();
}

at::ScalarType SlotBank::ComputeType(const at::Tensor& x) const {
  return lora_fp32_ ? at::kFloat : x.scalar_type();
}

bool SlotBank::Uses(const LoraTarget& t, const std::vector<int>& seg_slot) const {
  for (int s : seg_slot)
    if (trains(s, t.group)) return true;
  return false;
}

at::Tensor SlotBank::Delta(const LoraTarget& t, const at::Tensor& x, const std::vector<int64_t>& seg_begin,
                           const std::vector<int>& seg_slot) const {
  std::vector<LoraRun> runs;
  const size_t n = seg_slot.size();
  for (size_t i = 0; i < n;) {
    // Merge the run of sequences that share an effective slot: the product is
    // row-wise, so one matmul pair over the run is exact.
    const int s = trains(seg_slot[i], t.group) ? seg_slot[i] : -1;
    size_t j = i + 1;
    while (j < n && (trains(seg_slot[j], t.group) ? seg_slot[j] : -1) == s) ++j;
    LoraRun r;
    r.begin = seg_begin[i];
    r.len = seg_begin[j] - r.begin;
    r.slot = s;
    if (s >= 0) {
      const LoraConfig& c = slots_[s].config;
      r.rank = c.rank;
      r.scale = c.alpha / c.rank;
    }
    runs.push_back(r);
    i = j;
  }
  return SegmentLoraDelta(x, t.A, t.B, runs, ComputeType(x), t.d_out);
}

LoraRouting SlotBank::Route(TargetGroup g, const std::vector<int64_t>& seg_begin,
                            const std::vector<int>& seg_slot) const {
  LoraRouting r;
  const int64_t T = seg_begin.empty() ? 0 : seg_begin.back();
  std::vector<int64_t> used;             // distinct training slots, first-seen order
  std::vector<int64_t> token_col(T, -1); // routed index u of each token's slot
  std::vector<float> token_scale(T, 0.0f);
  for (size_t i = 0; i < seg_slot.size(); ++i) {
    const int s = seg_slot[i];
    if (!trains(s, g)) continue;
    auto it = std::find(used.begin(), used.end(), s);
    const int64_t u = it - used.begin();
    if (it == used.end()) used.push_back(s);
    const float scale = static_cast<float>(slots_[s].config.alpha / slots_[s].config.rank);
    for (int64_t row = seg_begin[i]; row < seg_begin[i + 1]; ++row) {
      token_col[row] = u;
      token_scale[row] = scale;
    }
  }
  if (used.empty()) return r;
  r.slots = at::tensor(used, at::kLong).to(device_);
  const at::Tensor col = at::tensor(token_col, at::kLong).to(device_).unsqueeze(1);      // [T, 1]
  const at::Tensor scale = at::tensor(token_scale, at::kFloat).to(device_).unsqueeze(1);  // [T, 1]
  const int64_t U = static_cast<int64_t>(used.size());
  std::vector<int64_t> owner_host(static_cast<size_t>(U * max_rank_));
  for (size_t c = 0; c < owner_host.size(); ++c) owner_host[c] = static_cast<int64_t>(c) / max_rank_;
  const at::Tensor owner = at::tensor(owner_host, at::kLong).to(device_);
  r.select = owner.unsqueeze(0).eq(col);  // [T, U*R]
  r.scale = scale;                        // [T, 1]
  return r;
}

LoraBatchShape SlotBank::Shape(TargetGroup g, const std::vector<int64_t>& seg_begin,
                               const std::vector<int>& seg_slot) const {
  LoraBatchShape shape;
  shape.rows = seg_begin.empty() ? 0 : seg_begin.back();
  std::vector<int> distinct;
  std::vector<int64_t> rows_of;  // rows per distinct slot
  int prev = -2;
  for (size_t i = 0; i < seg_slot.size(); ++i) {
    const int64_t len = seg_begin[i + 1] - seg_begin[i];
    if (len == 0) continue;
    const int s = trains(seg_slot[i], g) ? seg_slot[i] : -1;
    if (s != prev) ++shape.runs;
    prev = s;
    if (s < 0) continue;
    auto it = std::find(distinct.begin(), distinct.end(), s);
    if (it == distinct.end()) {
      distinct.push_back(s);
      rows_of.push_back(0);
      it = distinct.end() - 1;
    }
    rows_of[static_cast<size_t>(it - distinct.begin())] += len;
  }
  shape.slots = static_cast<int64_t>(distinct.size());
  for (int64_t n : rows_of) shape.max_rows = std::max(shape.max_rows, n);
  return shape;
}

LoraForm SlotBank::SelectForm(bool cuda, const LoraBatchShape& shape, int64_t max_rank) {
  // One run is one matmul pair in the segment form already.
  if (shape.runs <= 1 || shape.slots == 0) return LoraForm::kSegment;
  // On CUDA the grouped form does only the needed FLOPs, plus those of the
  // padding (U*Lmax rows in all), in a fixed number of kernels, and needs no
  // isolation pass (no row meets another slot's factors).
  if (cuda && shape.slots * shape.max_rows <= 2 * shape.rows) return LoraForm::kGrouped;
  // The routed form multiplies every row by all used slots' A (U*R columns),
  // plus the elementwise passes that keep slots isolated: on CUDA that
  // trades FLOPs for launches while U*R is small; on the CPU FLOPs are the
  // cost, so only small U*R (few, low-rank slots) pays.
  if (shape.slots * max_rank <= (cuda ? 128 : 64)) return LoraForm::kRouted;
  return LoraForm::kSegment;
}

LoraForm SlotBank::ChooseForm(TargetGroup g, const std::vector<int64_t>& seg_begin,
                              const std::vector<int>& seg_slot) const {
  if (forced_form_) return *forced_form_;
  return SelectForm(device_.is_cuda(), Shape(g, seg_begin, seg_slot), max_rank_);
}

at::Tensor SlotBank::RoutedDelta(const LoraTarget& t, const at::Tensor& x, const LoraRouting& routing) const {
  const at::ScalarType ct = ComputeType(x);
  const at::Tensor xf = x.to(ct);
  const int64_t U = routing.num_slots();
  if (U == 0) return at::zeros({x.size(0), t.d_out}, xf.options());
  const int64_t ur = U * max_rank_;
  // Cast before the finite check: an fp32 value past the compute type's range becomes inf there.
  const at::Tensor a = FiniteOrZero(t.A.index_select(0, routing.slots).reshape({ur, t.d_in}).to(ct));  // [U*R, d_in]
  const at::Tensor b = FiniteOrZero(
      t.B.index_select(0, routing.slots).permute({1, 0, 2}).reshape({t.d_out, ur}).to(ct));  // [d_out, U*R]
  const at::Tensor zero = at::zeros({}, xf.options());
  const at::Tensor xs = FiniteOrZero(xf);
  const at::Tensor h = at::where(routing.select, at::linear(xs, a) * routing.scale.to(ct), zero);  // [T, U*R]
  at::Tensor y = at::linear(h, b);
  if (y.requires_grad()) y.register_hook([](const at::Tensor& g) { return FiniteOrZero(g); });
  return y;
}

LoraGroups SlotBank::Group(TargetGroup g, const std::vector<int64_t>& seg_begin,
                           const std::vector<int>& seg_slot) const {
  LoraGroups r;
  r.rows = seg_begin.empty() ? 0 : seg_begin.back();
  std::vector<int64_t> used;              // distinct training slots, first-seen order
  std::vector<std::vector<size_t>> segs;  // each group's non-empty segments, in packed order
  std::vector<int64_t> rows_of;           // each group's rows
  for (size_t i = 0; i < seg_slot.size(); ++i) {
    const int s = seg_slot[i];
    if (!trains(s, g) || seg_begin[i + 1] == seg_begin[i]) continue;
    auto it = std::find(used.begin(), used.end(), s);
    if (it == used.end()) {
      used.push_back(s);
      segs.emplace_back();
      rows_of.push_back(0);
      it = used.end() - 1;
    }
    const size_t u = static_cast<size_t>(it - used.begin());
    segs[u].push_back(i);
    rows_of[u] += seg_begin[i + 1] - seg_begin[i];
  }
  if (used.empty()) return r;
  const int64_t U = static_cast<int64_t>(used.size());
  for (int64_t n : rows_of) r.max_rows = std::max(r.max_rows, n);
  const int64_t L = r.max_rows;
  std::vector<int64_t> gather(static_cast<size_t>(U * L));
  std::vector<int64_t> scatter(static_cast<size_t>(r.rows), U * L);  // default: the zero row
  std::vector<float> scale(static_cast<size_t>(U));
  std::vector<int64_t> pads;
  for (int64_t u = 0; u < U; ++u) {
    int64_t pos = u * L;
    for (size_t i : segs[u])
      for (int64_t row = seg_begin[i]; row < seg_begin[i + 1]; ++row) {
        gather[pos] = row;
        scatter[row] = pos;
        ++pos;
      }
    // Pad with the group's first row: a valid row whose output is never read.
    const int64_t pad_row = seg_begin[segs[u].front()];
    for (; pos < (u + 1) * L; ++pos) {
      gather[pos] = pad_row;
      pads.push_back(pos);
    }
    const LoraConfig& c = slots_[used[u]].config;
    scale[u] = static_cast<float>(c.alpha / c.rank);
  }
  r.base_rows = std::any_of(scatter.begin(), scatter.end(), [&](int64_t p) { return p == U * L; });
  r.slots = at::tensor(used, at::kLong).to(device_);
  r.scale = at::tensor(scale, at::kFloat).to(device_).view({U, 1, 1});
  r.identity = !r.base_rows && U * L == r.rows;
  for (int64_t i = 0; r.identity && i < U * L; ++i) r.identity = gather[static_cast<size_t>(i)] == i;
  r.gather = at::tensor(gather, at::kLong).to(device_);
  r.scatter = at::tensor(scatter, at::kLong).to(device_);
  if (!pads.empty()) r.pads = at::tensor(pads, at::kLong).to(device_);
  if (ragged_ && !r.identity && !r.base_rows) {
    // Ragged where the groups' segments, taken in group order, tile the rows.
    int64_t next = 0;
    bool tiled = true;
    std::vector<int32_t> ends;
    std::vector<float> row_scale(static_cast<size_t>(r.rows));
    for (int64_t u = 0; u < U && tiled; ++u) {
      for (size_t i : segs[static_cast<size_t>(u)]) {
        tiled = tiled && seg_begin[i] == next;
        next = seg_begin[i + 1];
      }
      if (!tiled) break;
      std::fill(row_scale.begin() + (ends.empty() ? 0 : ends.back()), row_scale.begin() + next, scale[u]);
      ends.push_back(static_cast<int32_t>(next));
      r.ends_host.push_back(next);
    }
    if (tiled && next == r.rows) {
      r.ragged = true;
      r.ends = at::tensor(ends, at::kInt).to(device_);
      r.row_scale = at::tensor(row_scale, at::kFloat).to(device_).view({r.rows, 1});
    } else {
      r.ends_host.clear();
    }
  }
  return r;
}

at::Tensor SlotBank::GroupedDelta(const LoraTarget& t, const at::Tensor& x, const LoraGroups& routing,
                                  const PassFactors* pass) const {
  TORCH_CHECK(x.size(0) == routing.rows, "GroupedDelta: x has ", x.size(0), " rows, the routing ", routing.rows);
  if (!pass || !pass->cast.defined() || t.is_expert())
    return GroupedLoraDelta(x, t.A, t.B, routing, ComputeType(x), t.d_out);
  TORCH_CHECK(pass->cast.scalar_type() == ComputeType(x) && pass->cast.size(0) == routing.num_slots(),
              "GroupedDelta: the cast factors do not match the routing or the compute type");
  const JointTarget f = CastFactors(t, *pass);
  return GroupedLoraDelta(x, t.A, t.B, routing, ComputeType(x), t.d_out, &f, pass->token);
}

PassFactors SlotBank::PassGroup(TargetGroup g, const at::Tensor& slots, at::ScalarType ct, bool grads) const {
  PassFactors f;
  f.cast = CastGroup(g, slots, ct);
  const auto [begin, len] = GroupColumns(g);
  const LoraTarget* anchor = nullptr;  // a leaf that requires grad, so that the flush node is recorded
  for (const LoraTarget& t : targets_)
    if (t.group == g && t.A.requires_grad()) {
      anchor = &t;
      break;
    }
  if (!grads || !anchor || len == 0) return f;
  f.grad = at::zeros_like(f.cast);
  f.token = GradientFlushToken(anchor->A, f.grad, flat_grad_.narrow(1, begin, len), slots);
  return f;
}

JointTarget SlotBank::CastFactors(const LoraTarget& t, const PassFactors& pass) const {
  const int64_t begin = GroupColumns(t.group).first, U = pass.cast.size(0);
  std::vector<int64_t> a_shape = t.FactorShape(true, max_rank_), b_shape = t.FactorShape(false, max_rank_);
  a_shape.insert(a_shape.begin(), U);
  b_shape.insert(b_shape.begin(), U);
  const auto view = [&](const at::Tensor& buffer, bool a) {
    if (!buffer.defined()) return at::Tensor();
    return a ? buffer.narrow(1, t.a_col - begin, t.AElems(max_rank_)).view(a_shape)
             : buffer.narrow(1, t.b_col - begin, t.BElems(max_rank_)).view(b_shape);
  };
  return JointTarget{t.A, t.B, view(pass.cast, true), view(pass.cast, false), view(pass.grad, true),
                     view(pass.grad, false)};
}

at::Tensor SlotBank::CastGroup(TargetGroup g, const at::Tensor& slots, at::ScalarType ct) const {
  const auto [begin, len] = GroupColumns(g);
  return GatherSlotRows(flat_.narrow(1, begin, len), slots, ct);
}

}  // namespace loom::engine
