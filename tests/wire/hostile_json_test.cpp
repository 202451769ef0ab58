// JSON bodies built to hurt the server (issue 15): nesting 100,000 deep,
// hyperparameters that turn an adapter into inf/NaN, TTLs and seq_ids that
// overflow later arithmetic. Each is refused at decode time with a 400 naming
// the field and the limit, before anything recursive or numeric runs on it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "wire/json_api.h"

namespace loom::wire {
namespace {

using namespace loom::tinker;  // the vocabulary wire/ encodes

void ExpectInvalid(const Status& s, const std::string& prefix) {
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.message();
  EXPECT_EQ(s.message().rfind(prefix, 0), 0u) << "want prefix '" << prefix << "', got '" << s.message() << "'";
}

// --------------------------------------------------------- JSON nesting depth

std::string Nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(HostileJson, DeepNestingIsRefusedBeforeAnythingRecursesOnIt) {
  // 100,000 levels, a 200 KB body: OptStringMap's dump() of it overflowed the stack.
  const std::string meta = R"("user_metadata":{"k":)" + Nested(100000) + "}";
  struct Case {
    const char* endpoint;
    std::string body;
    Status (*parse)(const Json&);
  };
  const Case cases[] = {
      {"create_session", "{" + meta + "}", [](const Json& j) { return ParseCreateSessionRequest(j).status(); }},
      {"create_model", R"({"session_id":"s","model_seq_id":0,"base_model":"b",)" + meta + "}",
       [](const Json& j) { return ParseCreateModelRequest(j).status(); }},
      {"load_weights", R"({"session_id":"s","model_seq_id":1,"path":"tinker://r/weights/w",)" + meta + "}",
       [](const Json& j) { return ParseLoadWeightsRequest(j).status(); }},
  };
  for (const Case& c : cases) {
    ASSERT_GT(c.body.size(), 200000u);
    auto j = ParseJsonObject(c.body, c.endpoint);
    if (j.ok()) (void)c.parse(*j);  // as the router does: without the bound this crashes
    ExpectInvalid(j.status(), std::string(c.endpoint) + ": body is JSON nested deeper than 64 levels");
  }
}

TEST(HostileJson, DepthLimitIsExactAndIgnoresBracketsInStrings) {
  // The body object is level 1, so 63 more levels fit and 64 do not.
  EXPECT_TRUE(ParseJsonObject(R"({"a":)" + Nested(63) + "}", "x").ok());
  ExpectInvalid(ParseJsonObject(R"({"a":)" + Nested(64) + "}", "x").status(),
                "x: body is JSON nested deeper than 64 levels");
  ExpectInvalid(ParseJsonObject(R"({"a":)" + std::string(100000, '{'), "x").status(),
                "x: body is JSON nested deeper than 64 levels");
  // Brackets inside strings (escaped quotes too) are text, not nesting.
  const std::string text = R"({"a":"\")" + std::string(1000, '[') + R"(\"{{{"})";
  auto j = ParseJsonObject(text, "x");
  ASSERT_TRUE(j.ok()) << j.status().message();
  EXPECT_EQ((*j)["a"].get<std::string>().size(), 1000u + 5);
  // Still-valid metadata nested a little keeps its JSON text.
  auto cs = ParseJsonObject(R"({"user_metadata":{"k":{"a":[1,{"b":2}]}}})", "create_session");
  ASSERT_TRUE(cs.ok());
  auto req = ParseCreateSessionRequest(*cs);
  ASSERT_TRUE(req.ok()) << req.status().message();
  EXPECT_EQ(req->user_metadata.at("k"), R"({"a":[1,{"b":2}]})");
}

// ------------------------------------------------------ optim_step ranges

const char* kAdam =
    R"({"adam_params":{"learning_rate":0.0001,"beta1":0.9,"beta2":0.95,"eps":1e-12,"weight_decay":0.01,
        "grad_clip_norm":1.0},"model_id":"s:train:0","seq_id":3})";

Status Optim(const char* key, double v) {
  Json j = Json::parse(kAdam);
  j["adam_params"][key] = v;
  return ParseOptimStepRequest(j).status();
}

TEST(HostileOptimStep, HyperparametersThatPoisonTheAdapterAreRefused) {
  const std::string ap = "optim_step.adam_params.";
  ExpectInvalid(Optim("learning_rate", 1e300), ap + "learning_rate: must be >= 0 and <= 10, got 1e+300");
  ExpectInvalid(Optim("weight_decay", 1e300), ap + "weight_decay: must be >= 0 and <= 10, got 1e+300");
  ExpectInvalid(Optim("eps", 0.0), ap + "eps: must be >= 1e-30 and <= 1, got 0");
  ExpectInvalid(Optim("eps", 1e-45), ap + "eps: must be >= 1e-30 and <= 1");  // 0 in float32
  ExpectInvalid(Optim("eps", 2.0), ap + "eps: must be >= 1e-30 and <= 1");
  ExpectInvalid(Optim("beta2", 1.0), ap + "beta2: must be in [0, 1), got 1");
  ExpectInvalid(Optim("beta1", -0.1), ap + "beta1: must be in [0, 1)");
  ExpectInvalid(Optim("grad_clip_norm", -1.0), ap + "grad_clip_norm: must be >= 0");
  ExpectInvalid(Optim("grad_clip_norm", std::numeric_limits<double>::infinity()), ap + "grad_clip_norm: must be finite");
  ExpectInvalid(Optim("learning_rate", std::nan("")), ap + "learning_rate: must be finite");
  // Decoupled decay multiplies the weights by 1 - lr x wd: above 1 it flips and grows them.
  Json j = Json::parse(kAdam);
  j["adam_params"]["learning_rate"] = 2.0;
  j["adam_params"]["weight_decay"] = 0.75;
  ExpectInvalid(ParseOptimStepRequest(j).status(), ap + "weight_decay: learning_rate x weight_decay must be <= 1, got 1.5");
  // The edges a demanding user may pick stay valid.
  for (auto [key, v] : std::initializer_list<std::pair<const char*, double>>{
           {"learning_rate", 10.0}, {"learning_rate", 0.0}, {"weight_decay", 10.0}, {"eps", 1.0}, {"eps", 1e-30},
           {"beta1", 0.0}, {"beta2", 0.999999}, {"grad_clip_norm", 0.0}, {"grad_clip_norm", 1e6}}) {
    EXPECT_TRUE(Optim(key, v).ok()) << key << "=" << v << ": " << Optim(key, v).message();
  }
}

// --------------------------------------------------------------- TTL bound

TEST(HostileJson, TtlIsBoundedToAHundredYears) {
  const int64_t max_ttl = int64_t{100} * 365 * 24 * 3600;
  const std::string big = std::to_string(std::numeric_limits<int64_t>::max());
  ExpectInvalid(ParseSaveWeightsRequest(Json::parse(R"({"model_id":"m","path":"x","seq_id":5,"ttl_seconds":)" + big + "}"))
                    .status(),
                "save_weights.ttl_seconds: must be <= 3153600000 (100 years), got " + big);
  ExpectInvalid(
      ParseSaveWeightsForSamplerRequest(Json::parse(R"({"model_id":"m","path":"x","seq_id":5,"ttl_seconds":)" + big + "}"))
          .status(),
      "save_weights_for_sampler.ttl_seconds: must be <= 3153600000 (100 years)");
  ExpectInvalid(ParseCheckpointTtlRequest(Json::parse(R"({"ttl_seconds":)" + std::to_string(max_ttl + 1) + "}")).status(),
                "checkpoint_ttl.ttl_seconds: must be <= 3153600000 (100 years)");
  auto at_limit = ParseCheckpointTtlRequest(Json::parse(R"({"ttl_seconds":)" + std::to_string(max_ttl) + "}"));
  ASSERT_TRUE(at_limit.ok()) << at_limit.status().message();
  EXPECT_EQ(at_limit->ttl_seconds.value_or(0), max_ttl);
}

// ---------------------------------------------------------- training seq_id

TEST(HostileJson, TrainingSeqIdsFitTheInt32OfForwardBackward) {
  const std::string big = std::to_string(std::numeric_limits<int64_t>::max());
  Json j = Json::parse(kAdam);
  j["seq_id"] = std::numeric_limits<int64_t>::max();
  ExpectInvalid(ParseOptimStepRequest(j).status(), "optim_step.seq_id: must be <= 2147483647");
  ExpectInvalid(ParseSaveWeightsRequest(Json::parse(R"({"model_id":"m","seq_id":)" + big + "}")).status(),
                "save_weights.seq_id: must be <= 2147483647");
  ExpectInvalid(ParseLoadWeightsRequest(
                    Json::parse(R"({"model_id":"m","path":"tinker://r/weights/w","seq_id":)" + big + "}"))
                    .status(),
                "load_weights.seq_id: must be <= 2147483647");
  ExpectInvalid(ParseSaveWeightsForSamplerRequest(Json::parse(R"({"model_id":"m","path":"x","seq_id":)" + big + "}"))
                    .status(),
                "save_weights_for_sampler.seq_id: must be <= 2147483647");
  j["seq_id"] = 2147483647;
  EXPECT_TRUE(ParseOptimStepRequest(j).ok());
}

}  // namespace
}  // namespace loom::wire
