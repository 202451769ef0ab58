#include "engine/train/uniform_pass.h"

#include <fmt/format.h>

#include <algorithm>

#include "engine/train/losses.h"

namespace loom::engine::train {
namespace {

int64_t Pow2AtLeast(int64_t n, int64_t floor) {
  int64_t p = floor;
  while (p < n) p *= 2;
  return p;
}

enum Long { kTokens, kPositions, kTargets };
enum Float { kWeights, kSamplerLp, kAdvantages, kMask };
constexpr TargetGroup kGroups[3] = {TargetGroup::kAttn, TargetGroup::kMlp, TargetGroup::kUnembed};

}  // namespace

std::optional<UniformShape> UniformShapeFor(const std::vector<int64_t>& lengths, int64_t max_tokens) {
  if (lengths.empty()) return std::nullopt;
  UniformShape s;
  s.len = Pow2AtLeast(*std::max_element(lengths.begin(), lengths.end()), UniformShape::kMinLen);
  s.seqs = Pow2AtLeast(static_cast<int64_t>(lengths.size()), 1);
  if (s.tokens() > max_tokens) return std::nullopt;
  return s;
}

std::string UniformKey::ToString() const {
  return fmt::format("{}x{} {} ({}, {}, {}) lora {}{}{}", shape.seqs, shape.len, spec.name, spec.clip_low,
                     spec.clip_high, spec.beta, attn ? "a" : "-", mlp ? "m" : "-", unembed ? "u" : "-");
}

UniformPass::UniformPass(const UniformKey& key, at::Device device) : key_(key) {
  const int64_t S = key.shape.seqs, N = key.shape.tokens();
  const bool pinned = device.is_cuda();
  const auto host = [&](at::ScalarType t, std::vector<int64_t> shape) {
    return at::zeros(shape, at::TensorOptions().dtype(t).pinned_memory(pinned));
  };
  host_long_ = host(at::kLong, {3, N});
  host_float_ = host(at::kFloat, {4, N});
  host_slots_ = host(at::kLong, {3, S});
  host_scales_ = host(at::kFloat, {3, S});
  dev_long_ = host_long_.to(device);
  dev_float_ = host_float_.to(device);
  tokens_ = dev_long_[kTokens];
  positions_ = dev_long_[kPositions];
  targets_ = dev_long_[kTargets];
  weights_ = dev_float_[kWeights];
  sampler_lp_ = dev_float_[kSamplerLp];
  advantages_ = dev_float_[kAdvantages];
  mask_ = dev_float_[kMask];
  dev_slots_ = host_slots_.to(device);
  dev_scales_ = host_scales_.to(device);
  lora_ = std::make_shared<UniformLora>();
  LoraGroups* groups[3] = {&lora_->attn, &lora_->mlp, &lora_->unembed};
  for (int g = 0; g < 3; ++g) {
    groups[g]->slots = dev_slots_[g];
    groups[g]->scale = dev_scales_[g].view({S, 1, 1});
    groups[g]->rows = N;
    groups[g]->max_rows = key.shape.len;
    groups[g]->identity = true;
  }
  lora_->attn_on = key.attn;
  lora_->mlp_on = key.mlp;
  lora_->unembed_on = key.unembed;
}

void UniformPass::Load(const SlotBank& bank, const std::vector<const Datum*>& data, const std::vector<int>& slots) {
  const int64_t S = key_.shape.seqs, L = key_.shape.len;
  TORCH_CHECK(static_cast<int64_t>(data.size()) <= S && data.size() == slots.size(), "UniformPass::Load: ",
              data.size(), " datums for ", S, " sequences");
  host_long_.zero_();
  host_float_.zero_();
  host_slots_.zero_();
  host_scales_.zero_();
  int64_t* lg = host_long_.data_ptr<int64_t>();
  float* fl = host_float_.data_ptr<float>();
  int64_t* sl = host_slots_.data_ptr<int64_t>();
  float* sc = host_scales_.data_ptr<float>();
  const int64_t N = S * L;
  const bool ce = key_.spec.kind == LossKind::kCrossEntropy;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t t = 0; t < L; ++t) lg[kPositions * N + s * L + t] = t;
    if (s >= static_cast<int64_t>(data.size())) continue;
    const Datum& d = *data[static_cast<size_t>(s)];
    const Array& targets = d.loss_fn_inputs.at("target_tokens");
    auto weights = d.loss_fn_inputs.find("weights");
    for (size_t t = 0; t < d.tokens.size(); ++t) {
      const int64_t row = s * L + static_cast<int64_t>(t);
      lg[kTokens * N + row] = d.tokens[t];
      lg[kTargets * N + row] = targets.i64[t];
      fl[kMask * N + row] = 1.0f;
      if (ce) {
        fl[kWeights * N + row] = weights == d.loss_fn_inputs.end() ? 1.0f : ValueAt(weights->second, t);
      } else {
        fl[kSamplerLp * N + row] = ValueAt(d.loss_fn_inputs.at("logprobs"), t);
        fl[kAdvantages * N + row] = ValueAt(d.loss_fn_inputs.at("advantages"), t);
      }
    }
    const int slot = slots[static_cast<size_t>(s)];
    for (int g = 0; g < 3; ++g) {
      if (!bank.trains(slot, kGroups[g])) continue;
      const LoraConfig& c = bank.slot(slot).config;
      sl[g * S + s] = slot;
      sc[g * S + s] = static_cast<float>(c.alpha / c.rank);
    }
  }
  dev_long_.copy_(host_long_, /*non_blocking=*/true);
  dev_float_.copy_(host_float_, /*non_blocking=*/true);
  dev_slots_.copy_(host_slots_, /*non_blocking=*/true);
  dev_scales_.copy_(host_scales_, /*non_blocking=*/true);
}

void UniformPass::Forward(const Transformer& model, const SlotBank& bank) {
  const int64_t S = key_.shape.seqs, L = key_.shape.len;
  PackedBatch b;
  b.tokens = tokens_;
  b.positions = positions_;
  for (int64_t s = 0; s <= S; ++s) b.seq_begin.push_back(s * L);
  b.seq_slot.assign(static_cast<size_t>(S), -1);
  b.uniform = lora_;
  const at::Tensor hidden = model.Hidden(b, bank, /*recompute_layers=*/0);
  const at::Tensor lp = model.TargetLogprobs(hidden, targets_, b, bank, 1024, UnembedMode::kKeep);
  LossInputs in;
  in.weights = weights_;
  in.sampler_logprobs = sampler_lp_;
  in.advantages = advantages_;
  const at::Tensor elem = ElementwiseLoss(key_.spec, lp, in) * mask_;
  seq_loss_ = elem.view({S, L}).sum(1);
  logprobs_ = lp.detach();
  elementwise_ = elem.detach();
  seq_loss_out_ = seq_loss_.detach();
}

void UniformPass::Backward() {
  if (seq_loss_.defined() && seq_loss_.requires_grad()) seq_loss_.sum().backward();
  seq_loss_ = at::Tensor();
}

}  // namespace loom::engine::train
