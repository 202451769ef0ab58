#include "engine/train/memory_plan.h"

#include <algorithm>
#include <cmath>

namespace loom::engine::train {
namespace {
constexpr double kSafety = 1.1;
}  // namespace

double ActivationCost::Bytes(int64_t tokens, int64_t recompute_layers) const {
  const int64_t k = std::clamp<int64_t>(recompute_layers, 0, layers);
  const double per_token = recomputed + static_cast<double>(layers - k) / static_cast<double>(layers) * (kept - recomputed);
  return fixed + static_cast<double>(tokens) * per_token;
}

ActivationCost ActivationCost::FromProbes(int64_t layers, int64_t probe_tokens, const double m[2][2]) {
  ActivationCost c;
  c.layers = layers;
  const double p = static_cast<double>(probe_tokens);
  // The line through both probes, unless its slope is implausibly flat (a
  // probe that reused a cached block): then the larger pass's average, which
  // overestimates every larger pass.
  auto slope = [&](double small, double large) {
    const double fit = (large - small) / p, average = large / (2 * p);
    return fit >= 0.5 * average ? fit : average;
  };
  c.kept = slope(m[0][0], m[1][0]);
  c.recomputed = std::min(slope(m[0][1], m[1][1]), c.kept);
  c.fixed = std::max({m[0][0] - c.kept * p, m[0][1] - c.recomputed * p, 0.0});
  // Passes far larger than the probes split the caching allocator's blocks
  // less evenly: a tenth more on every term.
  c.kept *= kSafety;
  c.recomputed *= kSafety;
  c.fixed *= kSafety;
  return c;
}

ActivationCost ActivationCost::Dearest(const ActivationCost& a, const ActivationCost& b) {
  if (!a.known()) return b;
  if (!b.known()) return a;
  ActivationCost c = a;
  c.fixed = std::max(a.fixed, b.fixed);
  c.kept = std::max(a.kept, b.kept);
  c.recomputed = std::max(a.recomputed, b.recomputed);
  return c;
}

PassPlan PlanPass(const ActivationCost& cost, int64_t tokens, double available) {
  PassPlan plan;
  if (!cost.known()) {
    plan.fits = true;
    return plan;
  }
  // bytes(T, k) falls linearly in k: solve for the smallest k that fits.
  const double all_kept = cost.Bytes(tokens, 0);
  const double all_recomputed = cost.Bytes(tokens, cost.layers);
  if (all_kept <= available) {
    plan = {true, 0, all_kept};
  } else if (all_recomputed > available) {
    plan = {false, cost.layers, all_recomputed};
  } else {
    const double per_layer = (all_kept - all_recomputed) / static_cast<double>(cost.layers);
    int64_t k = static_cast<int64_t>(std::ceil((all_kept - available) / per_layer));
    k = std::clamp<int64_t>(k, 1, cost.layers);
    // The division rounds: settle on the exact fewest.
    while (k > 1 && cost.Bytes(tokens, k - 1) <= available) --k;
    while (k < cost.layers && cost.Bytes(tokens, k) > available) ++k;
    plan = {true, k, cost.Bytes(tokens, k)};
  }
  return plan;
}

int64_t MaxPassTokens(const ActivationCost& cost, double available, int64_t recompute_layers) {
  if (!cost.known() || available <= cost.fixed) return 0;
  const int64_t k = recompute_layers < 0 ? cost.layers : std::min(recompute_layers, cost.layers);
  const double per_token = cost.Bytes(1, k) - cost.fixed;
  if (per_token <= 0) return int64_t{1} << 40;
  int64_t n = static_cast<int64_t>(std::floor((available - cost.fixed) / per_token));
  while (n > 0 && cost.Bytes(n, k) > available) --n;
  return n;
}

}  // namespace loom::engine::train
