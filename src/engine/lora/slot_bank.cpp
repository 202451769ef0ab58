#include "engine/lora/slot_bank.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "common/hash.h"

namespace loom::engine {
namespace {

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

SlotBank::SlotBank(int num_slots, int max_rank, at::Device device,
                   const std::vector<std::tuple<std::string, TargetGroup, int64_t, int64_t>>& targets)
    : num_slots_(num_slots), max_rank_(max_rank), device_(device), slots_(num_slots) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  targets_.reserve(targets.size());
  for (const auto& [module, group, d_in, d_out] : targets) {
    LoraTarget t;
    t.module = module;
    t.group = group;
    t.d_in = d_in;
    t.d_out = d_out;
    // at:: factories ignore requires_grad in 1.13: set it on the result.
    t.A = at::zeros({num_slots, max_rank, d_in}, opts).requires_grad_();
    t.B = at::zeros({num_slots, d_out, max_rank}, opts).requires_grad_();
    targets_.push_back(std::move(t));
  }
  scales_ = at::zeros({num_slots}, opts);
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
    at::Tensor rows = KaimingRows(config.seed, t.module, config.rank, t.d_in);
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
    for (auto& t : targets_) {
      t.A.select(0, s).zero_();
      t.B.select(0, s).zero_();
    }
    scales_.select(0, s).zero_();
  }
  ZeroGrad(s);
  slots_[s] = SlotState{};
}

void SlotBank::ZeroGrad(int s) {
  if (s < 0 || s >= num_slots_) return;
  c10::NoGradGuard no_grad;
  for (auto& t : targets_) {
    if (t.A.grad().defined()) t.A.grad().select(0, s).zero_();
    if (t.B.grad().defined()) t.B.grad().select(0, s).zero_();
  }
}

bool SlotBank::Uses(const LoraTarget& t, const std::vector<int>& seg_slot) const {
  for (int s : seg_slot)
    if (trains(s, t.group)) return true;
  return false;
}

at::Tensor SlotBank::Delta(const LoraTarget& t, const at::Tensor& x, const std::vector<int64_t>& seg_begin,
                           const std::vector<int>& seg_slot) const {
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const int64_t rows = x.size(0);
  std::vector<at::Tensor> parts;
  int64_t covered = 0;
  const size_t n = seg_slot.size();
  for (size_t i = 0; i < n;) {
    // Merge the run of sequences that share an effective slot: the product is
    // row-wise, so one matmul pair over the run is exact.
    const int s = trains(seg_slot[i], t.group) ? seg_slot[i] : -1;
    size_t j = i + 1;
    while (j < n && (trains(seg_slot[j], t.group) ? seg_slot[j] : -1) == s) ++j;
    const int64_t begin = seg_begin[i], len = seg_begin[j] - begin;
    covered = seg_begin[j];
    i = j;
    if (len == 0) continue;
    if (s < 0) {
      parts.push_back(at::zeros({len, t.d_out}, xf.options()));
      continue;
    }
    const LoraConfig& c = slots_[s].config;
    const at::Tensor a = t.A.select(0, s).narrow(0, 0, c.rank);  // [r, d_in]
    const at::Tensor b = t.B.select(0, s).narrow(1, 0, c.rank);  // [d_out, r]
    parts.push_back(at::linear(at::linear(xf.narrow(0, begin, len), a), b) * (c.alpha / c.rank));
  }
  if (covered < rows) parts.push_back(at::zeros({rows - covered, t.d_out}, xf.options()));
  if (parts.empty()) return at::zeros({rows, t.d_out}, xf.options());
  if (parts.size() == 1) return parts[0];
  return at::cat(parts, 0);
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
  r.mask = owner.unsqueeze(0).eq(col).to(at::kFloat) * scale;  // [T, U*R]
  return r;
}

bool SlotBank::PreferRouted(TargetGroup g, const std::vector<int64_t>& seg_begin,
                            const std::vector<int>& seg_slot) const {
  std::vector<int> distinct;
  int runs = 0, prev = -2;
  for (size_t i = 0; i < seg_slot.size(); ++i) {
    if (seg_begin[i + 1] == seg_begin[i]) continue;
    const int s = trains(seg_slot[i], g) ? seg_slot[i] : -1;
    if (s != prev) ++runs;
    prev = s;
    if (s >= 0 && std::find(distinct.begin(), distinct.end(), s) == distinct.end()) distinct.push_back(s);
  }
  // The routed form multiplies every token by all used slots' A (U*R rows):
  // on CUDA that trades cheap FLOPs for launches up to U*R = 512; on the CPU
  // FLOPs are the cost, so only small U*R (few, low-rank slots) pays.
  const int64_t limit = device_.is_cuda() ? 512 : 64;
  return runs > 1 && static_cast<int64_t>(distinct.size()) * max_rank_ <= limit;
}

at::Tensor SlotBank::RoutedDelta(const LoraTarget& t, const at::Tensor& x, const LoraRouting& routing) const {
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const int64_t U = routing.num_slots();
  if (U == 0) return at::zeros({x.size(0), t.d_out}, xf.options());
  const int64_t ur = U * max_rank_;
  const at::Tensor a = t.A.index_select(0, routing.slots).reshape({ur, t.d_in});                     // [U*R, d_in]
  const at::Tensor b = t.B.index_select(0, routing.slots).permute({1, 0, 2}).reshape({t.d_out, ur});  // [d_out, U*R]
  return at::linear(at::linear(xf, a) * routing.mask, b);
}

}  // namespace loom::engine
