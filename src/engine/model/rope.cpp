#include "engine/model/rope.h"

#include <algorithm>
#include <cmath>

namespace loom::engine {
namespace {

// The dimension (of head_dim) whose wavelength turns `rotations` times over
// the original context: YaRN's correction dimension.
double CorrectionDim(double rotations, double dim, double base, double context) {
  return dim * std::log(context / (rotations * 2.0 * M_PI)) / (2.0 * std::log(base));
}

}  // namespace

double YarnMscale(double factor, double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

RopeFrequencies MakeRopeFrequencies(const ModelConfig& c, int64_t head_dim) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // HF: base^(arange(0, hd, 2) / hd) in fp32.
  const at::Tensor exponents =
      at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / static_cast<double>(head_dim);
  RopeFrequencies r;
  if (c.rope_type != "yarn") {
    r.inv_freq = 1.0 / at::pow(c.rope_theta, exponents);
    return r;
  }
  const double base = c.rope_theta, factor = c.rope_factor, dim = static_cast<double>(head_dim);
  const double context =
      static_cast<double>(c.rope_original_max_position > 0 ? c.rope_original_max_position : c.max_position_embeddings);
  const at::Tensor pos_freqs = at::pow(base, exponents);
  const at::Tensor extrapolation = 1.0 / pos_freqs;
  const at::Tensor interpolation = 1.0 / (factor * pos_freqs);
  double low = CorrectionDim(c.yarn_beta_fast, dim, base, context);
  double high = CorrectionDim(c.yarn_beta_slow, dim, base, context);
  if (c.yarn_truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;  // no division by zero in the ramp
  const at::Tensor ramp = ((at::arange(head_dim / 2, f32) - low) / (high - low)).clamp(0, 1);
  const at::Tensor extrapolation_weight = 1 - ramp;
  r.inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight;
  r.scale = YarnMscale(factor, 1.0);
  if (c.yarn_mscale > 0 && c.yarn_mscale_all_dim > 0)
    r.scale = YarnMscale(factor, c.yarn_mscale) / YarnMscale(factor, c.yarn_mscale_all_dim);
  return r;
}

}  // namespace loom::engine
