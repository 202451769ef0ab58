#include "engine/sample/sampling.h"

#include <algorithm>

namespace loom::engine::sample {
namespace {

uint64_t Mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

double UniformDraw(uint64_t seed, uint64_t sample_index, uint64_t step) {
  const uint64_t h = Mix(Mix(Mix(seed) ^ (sample_index * 0xD1B54A32D192ED03ull)) ^ (step * 0x8CB92BA72F3D8DD7ull));
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
}

namespace {

constexpr double kMaxInverseTemperature = 1e30;

// Inverse-CDF draws for the rows idx of logits, written into chosen. With
// truncation (some row has top-k or top-p), over the tokens sorted by
// probability; without, over token-id order, which needs no sort of the
// vocabulary (the expensive part of a decode step at batch 64).
void Draw(const at::Tensor& logits, const std::vector<int64_t>& rows_idx, const std::vector<RowChoiceParams>& rows,
          bool truncated, at::Tensor& chosen) {
  if (rows_idx.empty()) return;
  const int64_t V = logits.size(1), n = static_cast<int64_t>(rows_idx.size());
  const auto cpu_long = at::TensorOptions().dtype(at::kLong);
  const auto cpu_f = at::TensorOptions().dtype(at::kFloat);
  std::vector<float> inv_t(n), top_p(n), u(n);
  std::vector<int64_t> top_k(n);
  for (int64_t i = 0; i < n; ++i) {
    const RowChoiceParams& p = rows[rows_idx[i]];
    // Capped where fp32 still holds logit / T (|logit| < 3.4e8): beyond it
    // the draw is its greedy limit either way, and an infinite 1/T would
    // turn the row's softmax into NaN (0 * inf).
    inv_t[i] = static_cast<float>(std::min(1.0 / p.temperature, kMaxInverseTemperature));
    top_k[i] = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
    top_p[i] = static_cast<float>(p.top_p);
    u[i] = static_cast<float>(p.u);
  }
  const at::Device dev = logits.device();
  // One host-to-device copy for the per-row scalars; no row gather when
  // every row draws (the common decode step).
  std::vector<float> scalars(inv_t);
  scalars.insert(scalars.end(), u.begin(), u.end());
  const at::Tensor sc = at::tensor(scalars, cpu_f).to(dev).view({2, n});
  const bool all_rows = n == logits.size(0);
  const at::Tensor idx = all_rows ? at::Tensor() : at::tensor(rows_idx, cpu_long).to(dev);
  const at::Tensor rows_logits = all_rows ? logits : logits.index_select(0, idx);
  // Temperature 1 everywhere (RL's usual draw): x * 1 is x, so no pass over
  // the [rows, vocab] logits to scale them.
  const bool unit = std::all_of(inv_t.begin(), inv_t.end(), [](float v) { return v == 1.0f; });
  const at::Tensor scaled = unit ? rows_logits : rows_logits * sc.select(0, 0).unsqueeze(1);
  const at::Tensor uu = sc.select(0, 1);
  auto put = [&](const at::Tensor& picked) {
    if (all_rows) {
      chosen.copy_(picked);
    } else {
      chosen.index_copy_(0, idx, picked);
    }
  };
  if (!truncated) {
    const at::Tensor cdf = at::cumsum(at::softmax(scaled, -1), -1);
    put(at::clamp_max((cdf <= (uu * cdf.select(1, V - 1)).unsqueeze(1)).sum(-1), V - 1));
    return;
  }
  at::Tensor sorted, order;
  std::tie(sorted, order) = at::sort(scaled, /*stable=*/true, /*dim=*/-1, /*descending=*/true);
  const at::Tensor probs = at::softmax(sorted, -1);
  const at::Tensor rank = at::arange(V, cpu_long.device(dev)).unsqueeze(0);
  at::Tensor keep = rank < at::tensor(top_k, cpu_long).to(dev).unsqueeze(1);
  const at::Tensor before = at::cumsum(probs, -1) - probs;  // mass of the more likely tokens
  keep = keep.logical_and(before < at::tensor(top_p, cpu_f).to(dev).unsqueeze(1));
  keep.select(1, 0).fill_(true);
  const at::Tensor cdf = at::cumsum(probs * keep.to(at::kFloat), -1);
  const at::Tensor threshold = uu * cdf.select(1, V - 1);
  at::Tensor pick = (cdf <= threshold.unsqueeze(1)).sum(-1);
  pick = at::minimum(pick, keep.sum(-1) - 1);
  put(order.gather(1, pick.unsqueeze(1)).squeeze(1));
}

}  // namespace

Choices ChooseTokens(const at::Tensor& logits, const std::vector<RowChoiceParams>& rows) {
  const int64_t S = logits.size(0), V = logits.size(1);
  std::vector<int64_t> plain, truncated;
  for (int64_t r = 0; r < S; ++r) {
    const RowChoiceParams& p = rows[r];
    if (!(p.temperature > 0)) continue;
    const bool cut = (p.top_k > 0 && p.top_k < V) || p.top_p < 1.0;
    (cut ? truncated : plain).push_back(r);
  }
  // Greedy rows take the argmax; the draws below overwrite the others (no
  // pass over the logits for it when every row draws).
  const bool any_greedy = static_cast<int64_t>(plain.size() + truncated.size()) < S;
  at::Tensor chosen = any_greedy ? logits.argmax(-1) : at::empty({S}, logits.options().dtype(at::kLong));
  Draw(logits, plain, rows, /*truncated=*/false, chosen);
  Draw(logits, truncated, rows, /*truncated=*/true, chosen);
  const at::Tensor lp = at::log_softmax(logits, -1).gather(1, chosen.unsqueeze(1)).squeeze(1);
  // One device-to-host copy (token ids are exact in double).
  const at::Tensor both = at::stack({chosen.to(at::kDouble), lp.to(at::kDouble)}).to(at::kCPU).contiguous();
  const double* tok = both.data_ptr<double>();
  const double* lps = tok + S;
  Choices c;
  c.tokens.resize(S);
  c.logprobs.resize(S);
  for (int64_t r = 0; r < S; ++r) {
    c.tokens[r] = static_cast<int32_t>(tok[r]);
    c.logprobs[r] = static_cast<float>(lps[r]);
  }
  return c;
}

}  // namespace loom::engine::sample
