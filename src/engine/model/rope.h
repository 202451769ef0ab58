// RoPE frequencies of a config: plain RoPE, or YaRN (gpt_oss) as
// transformers 5.17 computes it (_compute_yarn_parameters): the inverse
// frequencies blend interpolation (divided by factor) and extrapolation
// along a linear ramp between the correction dimensions of beta_fast and
// beta_slow (floored/ceiled only when truncate), and cos and sin are both
// multiplied by the attention factor 0.1 ln(factor) + 1 (DeepSeek's
// mscale / mscale_all_dim ratio of it when the config states both).
//
// Pure function of the config; any thread.
#pragma once
#include <ATen/ATen.h>

#include "engine/model/config.h"

namespace loom::engine {

struct RopeFrequencies {
  at::Tensor inv_freq;  // [head_dim / 2] fp32 on the CPU
  double scale = 1.0;   // applied to cos and sin (YaRN's attention factor)
};

// YaRN's magnitude scale of a factor: 0.1 mscale ln(factor) + 1 (1 for factor <= 1).
double YarnMscale(double factor, double mscale);

RopeFrequencies MakeRopeFrequencies(const ModelConfig& config, int64_t head_dim);

}  // namespace loom::engine
