// Tinker's data nouns (spec §8): what a training or sampling request carries
// and what it produces, as plain C++ values. engine/ computes on these types
// (engine/api.h and engine/sample_api.h name them), wire/ encodes them, and
// service/ passes them between the two without translating.
//
// Plain data; no thread rules.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace loom::tinker {

// A dense row-major array, as carried by Tinker's TensorData (loss_fn_inputs
// and per-datum outputs). Exactly one of f32 / i64 holds numel() values.
struct Array {
  enum class DType { kFloat32, kInt64 };
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<float> f32;
  std::vector<int64_t> i64;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  static Array Floats(std::vector<float> v) {
    Array a;
    a.shape = {static_cast<int64_t>(v.size())};
    a.f32 = std::move(v);
    return a;
  }
  static Array Ints(std::vector<int64_t> v) {
    Array a;
    a.dtype = DType::kInt64;
    a.shape = {static_cast<int64_t>(v.size())};
    a.i64 = std::move(v);
    return a;
  }
};

// One training example: the model input tokens and the loss inputs, each with
// leading dimension tokens.size() (position t predicts target_tokens[t]).
struct Datum {
  std::vector<int32_t> tokens;
  std::map<std::string, Array> loss_fn_inputs;
};

// Tinker's LoraConfig plus loom's per-slot alpha. Scale = alpha / rank.
struct LoraConfig {
  int rank = 32;
  double alpha = 32.0;
  uint64_t seed = 0;
  bool train_attn = true;     // q, k, v, o
  bool train_mlp = true;      // gate, up, down
  bool train_unembed = true;  // lm_head
};

// Tinker's ForwardBackwardInput: the data and the loss of one request.
struct ForwardBackwardInput {
  std::vector<Datum> data;
  std::string loss_fn = "cross_entropy";
  std::map<std::string, double> loss_fn_config;
  bool forward_only = false;
};

struct ForwardBackwardOutput {
  // One map per datum, in datum order: "logprobs" always, "elementwise_loss".
  std::vector<std::map<std::string, Array>> outputs;
  // "name:reduction" keys, exactly one colon each (e.g. "loss:sum").
  std::map<std::string, double> metrics;
};

// Tinker's AdamParams; weight decay is decoupled (AdamW), grad_clip_norm 0 = off.
struct AdamParams {
  double learning_rate = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-12;
  double weight_decay = 0.0;
  double grad_clip_norm = 0.0;
};

// Tinker's SamplingParams. Defaults are the SDK's.
struct SamplingParams {
  // Tokens to generate at most; unset = up to the context window.
  std::optional<int32_t> max_tokens;
  double temperature = 1.0;        // 0 = greedy (argmax)
  int32_t top_k = -1;              // -1 = off, else >= 1
  double top_p = 1.0;              // in (0, 1]
  std::optional<uint64_t> seed;    // same seed + same inputs -> same tokens; unset = fresh entropy
  std::vector<int32_t> stop_tokens;
  std::vector<std::string> stop_strings;  // matched on detokenized generated text (needs tokenizer.json)
};

enum class StopReason { kStop, kLength };  // kStop: EOS, stop token or stop string

struct SampledSequence {
  std::vector<int32_t> tokens;     // generated tokens, the stop token / string's last token included
  std::vector<float> logprobs;     // per token: log_softmax of the adapter's unscaled logits
  StopReason stop_reason = StopReason::kLength;
};

// Tinker's SampleResponse.
struct SampleOutput {
  std::vector<SampledSequence> sequences;  // num_samples of them, in sample order
  // One per prompt token; [0] is NaN (nothing predicts the first token).
  std::optional<std::vector<float>> prompt_logprobs;
  // N x K row-major (N = prompt length, K = topk_prompt_logprobs), best
  // first; row 0 is padding: token id 0, logprob kTopkPad.
  static constexpr float kTopkPad = -99999.0f;
  int32_t topk = 0;
  std::vector<int32_t> topk_token_ids;
  std::vector<float> topk_logprobs;
  // Prompt tokens whose K/V came from the sampler's prefix cache (whole blocks).
  int32_t prompt_cache_hit_tokens = 0;
};

}  // namespace loom::tinker
