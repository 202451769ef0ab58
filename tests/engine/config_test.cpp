// ModelConfig: parsing real-shaped HF configs, defaults, and errors that
// name the offending field; ToJson round trips.
#include "engine/model/config.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/model/rope.h"

namespace loom::engine {
namespace {

using json = nlohmann::json;

// The fields of Qwen2.5-0.5B's config.json on the Hub.
json Qwen25() {
  return json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
}

// The fields of Qwen3-4B's config.json on the Hub.
json Qwen3() {
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 9728,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
}

// Parses j and expects an InvalidArgument whose message names field.
void ExpectInvalidNaming(const json& j, const std::string& field) {
  auto r = ModelConfig::Parse(j.dump());
  ASSERT_FALSE(r.ok()) << "accepted config with bad " << field;
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().message();
}

TEST(ModelConfig, ParsesQwen25) {
  auto r = ModelConfig::Parse(Qwen25().dump());
  ASSERT_TRUE(r.ok()) << r.status().message();
  const ModelConfig& c = r.value();
  EXPECT_EQ(c.model_type, "qwen2");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 896);
  EXPECT_EQ(c.num_hidden_layers, 24);
  EXPECT_EQ(c.num_attention_heads, 14);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 64);  // 896 / 14
  EXPECT_EQ(c.intermediate_size, 4864);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.eos_token_id, 151643);
  EXPECT_EQ(c.max_position_embeddings, 32768);
}

TEST(ModelConfig, ParsesQwen3) {
  auto r = ModelConfig::Parse(Qwen3().dump());
  ASSERT_TRUE(r.ok()) << r.status().message();
  const ModelConfig& c = r.value();
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_EQ(c.head_dim, 128);  // stated, not 2560 / 32 = 80
  EXPECT_FALSE(c.attention_bias);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.eos_token_id, 151645);
  EXPECT_EQ(c.max_position_embeddings, 40960);
}

TEST(ModelConfig, DefaultsFollowHF) {
  json j = Qwen3();
  for (const char* f : {"num_key_value_heads", "head_dim", "attention_bias", "tie_word_embeddings", "eos_token_id"}) {
    j.erase(f);
  }
  auto r = ModelConfig::Parse(j.dump());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->num_key_value_heads, 32);
  EXPECT_EQ(r->head_dim, 80);
  EXPECT_FALSE(r->attention_bias);
  EXPECT_FALSE(r->tie_word_embeddings);
  EXPECT_EQ(r->eos_token_id, -1);
  j["attention_bias"] = true;
  j["eos_token_id"] = json::array({7, 9});
  r = ModelConfig::Parse(j.dump());
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->attention_bias);
  EXPECT_EQ(r->eos_token_id, 7);
}

TEST(ModelConfig, AcceptsTransformers5RopeParameters) {
  json j = Qwen3();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  auto r = ModelConfig::Parse(j.dump());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_DOUBLE_EQ(r->rope_theta, 5e5);
  j["rope_parameters"]["rope_type"] = "linear";
  ExpectInvalidNaming(j, "rope_parameters");
}

// Qwen's documented way past 32K: YaRN in rope_scaling (factor 4 over the
// pretrained 32,768). The figures are transformers 5.17's Qwen3RotaryEmbedding
// and Qwen2RotaryEmbedding for a head_dim of 16 and theta 10^6 (H100 machine,
// session 32; both classes gave the same): it takes the stated factor even
// where max_position_embeddings / original_max_position_embeddings differs
// (it warns), the original length from rope_scaling, else
// max_position_embeddings, and the attention factor 0.1 ln(factor) + 1 on cos
// and sin.
TEST(ModelConfig, QwenYarnRopeMatchesTransformers) {
  struct Case {
    int64_t max_positions, original;  // original 0: not stated
    std::vector<double> inv_freq;
  };
  const std::vector<Case> cases = {
      {2048, 64, {1.0, 0.11114246398210526, 0.007905694656074047, 0.0014058533124625683, 0.0002500000118743628,
                  4.4456985051510856e-05, 7.905693564680405e-06, 1.405853367941745e-06}},
      {2048, 0, {1.0, 0.17782793939113617, 0.023717083036899567, 0.0028117066249251366, 0.0002500000118743628,
                 4.4456985051510856e-05, 7.905693564680405e-06, 1.405853367941745e-06}},
      {40960, 32768, {1.0, 0.17782793939113617, 0.03162277862429619, 0.004217559937387705, 0.0005000000237487257,
                      4.4456985051510856e-05, 7.905693564680405e-06, 1.405853367941745e-06}},
  };
  for (const char* type : {"qwen2", "qwen3", "qwen3_moe"}) {
    for (const Case& k : cases) {
      json j = Qwen3();
      j["model_type"] = type;
      j["hidden_size"] = 64, j["num_attention_heads"] = 4, j["num_key_value_heads"] = 2, j["head_dim"] = 16;
      j["max_position_embeddings"] = k.max_positions;
      j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
      if (k.original > 0) j["rope_scaling"]["original_max_position_embeddings"] = k.original;
      if (std::string(type) == "qwen3_moe") {
        j["num_experts"] = 4, j["num_experts_per_tok"] = 2, j["moe_intermediate_size"] = 32;
        j["decoder_sparse_step"] = 1;
      }
      auto c = ModelConfig::Parse(j.dump());
      ASSERT_TRUE(c.ok()) << type << ": " << c.status().message();
      EXPECT_EQ(c->rope_type, "yarn");
      const RopeFrequencies r = MakeRopeFrequencies(*c, 16);
      ASSERT_EQ(r.inv_freq.numel(), 8);
      for (int64_t i = 0; i < 8; ++i) {
        const double want = k.inv_freq[static_cast<size_t>(i)];
        EXPECT_NEAR(r.inv_freq[i].item<double>(), want, 1e-6 * want)
            << type << " max " << k.max_positions << " original " << k.original << " frequency " << i;
      }
      EXPECT_NEAR(r.scale, 1.138629436111989, 1e-12) << type;
    }
  }
}

TEST(ModelConfig, EachErrorNamesItsField) {
  {
    json j = Qwen3();
    j["model_type"] = "llama";
    ExpectInvalidNaming(j, "model_type");
  }
  {
    json j = Qwen3();
    j.erase("model_type");
    ExpectInvalidNaming(j, "model_type");
  }
  {
    json j = Qwen25();
    j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
    ExpectInvalidNaming(j, "rope_scaling");
    j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"attention_factor", 1.0}};
    ExpectInvalidNaming(j, "rope_scaling.attention_factor");
  }
  for (const char* f : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}) {
    json j = Qwen3();
    j.erase(f);
    ExpectInvalidNaming(j, f);
    j[f] = 0;
    ExpectInvalidNaming(j, f);
    j[f] = "12";
    ExpectInvalidNaming(j, f);
  }
  {
    json j = Qwen3();
    j["num_key_value_heads"] = 5;  // 32 % 5 != 0
    ExpectInvalidNaming(j, "num_key_value_heads");
  }
  {
    json j = Qwen25();
    j["hidden_size"] = 900;  // not divisible by 14 heads, no head_dim
    ExpectInvalidNaming(j, "hidden_size");
  }
  {
    json j = Qwen25();
    j["use_sliding_window"] = true;
    ExpectInvalidNaming(j, "use_sliding_window");
  }
  {
    json j = Qwen25();
    j["hidden_act"] = "gelu";
    ExpectInvalidNaming(j, "hidden_act");
  }
  {
    json j = Qwen3();
    j["rms_norm_eps"] = "small";
    ExpectInvalidNaming(j, "rms_norm_eps");
  }
  {
    json j = Qwen3();
    j["tie_word_embeddings"] = 1;
    ExpectInvalidNaming(j, "tie_word_embeddings");
  }
  {
    json j = Qwen3();
    j["head_dim"] = 7;
    ExpectInvalidNaming(j, "head_dim");
  }
  EXPECT_FALSE(ModelConfig::Parse("{not json").ok());
  EXPECT_FALSE(ModelConfig::Parse("[]").ok());
  EXPECT_EQ(ModelConfig::Load("/nonexistent/loom/model").status().code(), Code::kNotFound);
}

TEST(ModelConfig, ToJsonRoundTripsAndNamesArchitecture) {
  for (const json& src : {Qwen25(), Qwen3()}) {
    auto a = ModelConfig::Parse(src.dump());
    ASSERT_TRUE(a.ok());
    const std::string text = a->ToJson();
    const json out = json::parse(text);
    EXPECT_EQ(out["architectures"][0], a->model_type == "qwen3" ? "Qwen3ForCausalLM" : "Qwen2ForCausalLM");
    EXPECT_TRUE(out["rope_scaling"].is_null());
    EXPECT_EQ(out["torch_dtype"], "bfloat16");
    auto b = ModelConfig::Parse(text);
    ASSERT_TRUE(b.ok()) << b.status().message();
    EXPECT_EQ(b->model_type, a->model_type);
    EXPECT_EQ(b->vocab_size, a->vocab_size);
    EXPECT_EQ(b->hidden_size, a->hidden_size);
    EXPECT_EQ(b->intermediate_size, a->intermediate_size);
    EXPECT_EQ(b->num_hidden_layers, a->num_hidden_layers);
    EXPECT_EQ(b->num_attention_heads, a->num_attention_heads);
    EXPECT_EQ(b->num_key_value_heads, a->num_key_value_heads);
    EXPECT_EQ(b->head_dim, a->head_dim);
    EXPECT_EQ(b->rope_theta, a->rope_theta);
    EXPECT_EQ(b->rms_norm_eps, a->rms_norm_eps);
    EXPECT_EQ(b->tie_word_embeddings, a->tie_word_embeddings);
    EXPECT_EQ(b->attention_bias, a->attention_bias);
    EXPECT_EQ(b->qk_norm, a->qk_norm);
    EXPECT_EQ(b->eos_token_id, a->eos_token_id);
    EXPECT_EQ(b->max_position_embeddings, a->max_position_embeddings);
  }
}

}  // namespace
}  // namespace loom::engine
