// ModelConfig: the fields of a Hugging Face config.json that loom's
// architectures use. Parse() rejects unsupported model_type or rope scaling
// with a message naming the field. Torch-free.
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"

namespace loom::engine {

struct ModelConfig {
  std::string model_type;          // "qwen2" | "qwen3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;            // qwen3 states it; qwen2: hidden / heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;     // qwen2: q/k/v have bias; qwen3: per config (default false)
  bool qk_norm = false;            // qwen3: per-head RMSNorm on q and k
  std::string torch_dtype;         // as stated in config.json

  static Result<ModelConfig> Parse(const std::string& json_text);
  static Result<ModelConfig> Load(const std::string& model_dir);
  std::string ToJson() const;      // HF-compatible config.json text
};

}  // namespace loom::engine
