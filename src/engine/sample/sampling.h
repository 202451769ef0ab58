// Token choice from logits: greedy, temperature, top-k, top-p, driven by a
// counter-based PRNG so that a row's draw depends only on (seed, sample
// index, step), never on which other rows share the decode step.
//
// The reported logprob of a chosen token is log_softmax of the unscaled
// (temperature 1, unfiltered) logits: what the trainer's forward computes
// for the same token, so RL losses see consistent numbers.
//
// Pure functions; the decode thread calls them.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace loom::engine::sample {

// Uniform double in [0, 1) from a SplitMix64-style hash of the three keys.
double UniformDraw(uint64_t seed, uint64_t sample_index, uint64_t step);

struct RowChoiceParams {
  double temperature = 1.0;  // <= 0: greedy
  int64_t top_k = -1;        // -1: off
  double top_p = 1.0;
  double u = 0.0;            // the row's uniform draw
};

struct Choices {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};

// logits [S, V] fp32, one RowChoiceParams per row. Inverse-CDF sampling
// after temperature scaling. Rows with top-k or top-p draw over the tokens
// sorted by probability (stable: ties keep id order), after top-k, then
// top-p (the smallest prefix whose mass reaches top_p; the most likely token
// is always kept); rows without truncation draw over token-id order (the
// same distribution, no sort of the vocabulary).
Choices ChooseTokens(const at::Tensor& logits, const std::vector<RowChoiceParams>& rows);

}  // namespace loom::engine::sample
