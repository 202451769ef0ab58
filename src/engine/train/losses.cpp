#include "engine/train/losses.h"

namespace loom::engine::train {
namespace {

int64_t TotalTokens(const std::vector<const Datum*>& data) {
  int64_t t = 0;
  for (const Datum* d : data) t += static_cast<int64_t>(d->tokens.size());
  return t;
}

// One [T] fp32 tensor from a 1-D input key of every datum.
at::Tensor PackVector(const std::vector<const Datum*>& data, const std::string& key, at::Device device) {
  std::vector<float> out;
  out.reserve(TotalTokens(data));
  for (const Datum* d : data) {
    const Array& a = d->loss_fn_inputs.at(key);
    for (int64_t j = 0; j < a.numel(); ++j) out.push_back(ValueAt(a, j));
  }
  return at::tensor(out, at::kFloat).to(device);
}

}  // namespace

float ValueAt(const Array& a, size_t j) {
  return a.dtype == Array::DType::kInt64 ? static_cast<float>(a.i64[j]) : a.f32[j];
}

at::Tensor PackTargets(const std::vector<const Datum*>& data, int64_t k_cols) {
  const int64_t total = TotalTokens(data);
  const int64_t width = k_cols == 0 ? 1 : k_cols;
  std::vector<int64_t> out(static_cast<size_t>(total * width), 0);
  int64_t row = 0;
  for (const Datum* d : data) {
    const Array& a = d->loss_fn_inputs.at("target_tokens");
    const int64_t n = a.shape[0];
    const int64_t k = a.shape.size() == 2 ? a.shape[1] : 1;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < k; ++c) out[(row + t) * width + c] = a.i64[t * k + c];
    row += n;
  }
  at::Tensor t = at::tensor(out, at::kLong);
  return k_cols == 0 ? t : t.view({total, k_cols});
}

LossInputs PackLossInputs(const LossSpec& spec, const std::vector<const Datum*>& data, int64_t k_cols,
                          at::Device device) {
  LossInputs in;
  if (spec.kind != LossKind::kCrossEntropy) {
    in.sampler_logprobs = PackVector(data, "logprobs", device);
    in.advantages = PackVector(data, "advantages", device);
    return in;
  }
  const int64_t total = TotalTokens(data);
  const int64_t width = k_cols == 0 ? 1 : k_cols;
  std::vector<float> w(static_cast<size_t>(total * width), 0.0f);
  int64_t row = 0;
  for (const Datum* d : data) {
    const Array& targets = d->loss_fn_inputs.at("target_tokens");
    const int64_t n = targets.shape[0];
    const int64_t k = targets.shape.size() == 2 ? targets.shape[1] : 1;
    auto it = d->loss_fn_inputs.find("weights");
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < k; ++c)
        w[(row + t) * width + c] = it == d->loss_fn_inputs.end() ? 1.0f : ValueAt(it->second, t * k + c);
    row += n;
  }
  at::Tensor wt = at::tensor(w, at::kFloat);
  if (k_cols != 0) wt = wt.view({total, k_cols});
  in.weights = wt.to(device);
  return in;
}

at::Tensor ElementwiseLoss(const LossSpec& spec, const at::Tensor& lp, const LossInputs& in) {
  if (spec.kind == LossKind::kCrossEntropy) return -lp * in.weights;
  const at::Tensor& q = in.sampler_logprobs;
  const at::Tensor& adv = in.advantages;
  switch (spec.kind) {
    case LossKind::kImportanceSampling:
      return -at::exp(lp - q) * adv;
    case LossKind::kPpo: {
      at::Tensor ratio = at::exp(lp - q);
      at::Tensor clipped = at::clamp(ratio, spec.clip_low, spec.clip_high);
      return -at::min(ratio * adv, clipped * adv);
    }
    case LossKind::kCispo: {
      at::Tensor clipped = at::clamp(at::exp(lp - q), spec.clip_low, spec.clip_high).detach();
      return -clipped * lp * adv;
    }
    case LossKind::kDro: {
      at::Tensor diff = lp - q;
      return -(lp * adv - 0.5 * spec.beta * diff * diff);
    }
    default:
      break;
  }
  return -lp * in.weights;
}

}  // namespace loom::engine::train
