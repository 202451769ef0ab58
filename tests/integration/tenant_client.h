// TenantClient: one tenant of a real `loom serve` as an SDK client drives it,
// over HTTP (JSON, and protobuf for forward_backward and samples): its own
// key, session, model and seq counters, and helpers for training steps,
// sampler snapshots and samples. For the integration tests.
//
// Threading: one object per thread.
#pragma once
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../http/test_client.h"
#include "wire/forward_backward.h"
#include "wire/sample.h"

namespace loom::test {

class TenantClient {
 public:
  using Json = nlohmann::json;

  TenantClient(uint16_t port, std::string key) : client_("127.0.0.1", port), key_(std::move(key)) {}

  testing::Reply Post(const std::string& route, const Json& body) {
    return client_.Call("POST", "/api/v1/" + route, body.dump(), {{"X-API-Key", key_}});
  }
  Json PostOk(const std::string& route, const Json& body) {
    auto r = Post(route, body);
    EXPECT_EQ(r.status, 200) << route << ": " << r.body;
    return Json::parse(r.body, nullptr, false);
  }
  // A protobuf body to a POST route (forward_backward).
  testing::Reply PostProto(const std::string& route, const std::string& body) {
    return client_.Call("POST", "/api/v1/" + route, body,
                        {{"X-API-Key", key_}, {"Content-Type", "application/x-protobuf"}});
  }
  testing::Reply Get(const std::string& target) { return client_.Call("GET", target, "", {{"X-API-Key", key_}}); }
  testing::Reply Delete(const std::string& target) { return client_.Call("DELETE", target, "", {{"X-API-Key", key_}}); }
  testing::Reply Retrieve(const std::string& id, bool proto = false) {
    return testing::RetrieveFuture(client_, key_, id, proto, /*attempts=*/300);
  }
  Json Result(const Json& submitted) {
    auto r = Retrieve(submitted.value("request_id", ""), false);
    EXPECT_EQ(r.status, 200) << r.body;
    Json j = Json::parse(r.body, nullptr, false);
    EXPECT_FALSE(j.contains("error")) << r.body;
    return j;
  }

  // A session and one model of base_model (the served model's name).
  // lora_seed >= 0: the adapter's seed (else the server picks one).
  void Start(const std::string& base_model = "loom/tiny-qwen3", int64_t lora_seed = -1) {
    session_ = PostOk("create_session", {{"tags", Json::array()}, {"user_metadata", Json::object()},
                                         {"sdk_version", "0.26.2"}, {"type", "create_session"}})["session_id"];
    StartIn(session_, base_model, 0, lora_seed);
  }
  // One model of base_model in an existing session of this tenant (as a
  // second TrainingClient of one ServiceClient); its sampling sessions are
  // numbered from 1000 x model_seq_id, so two such clients never share one.
  void StartIn(const std::string& session, const std::string& base_model, int model_seq_id, int64_t lora_seed = -1) {
    session_ = session;
    sampling_seq_ = 1000 * static_cast<int64_t>(model_seq_id);
    Json lora = {{"rank", 4}, {"train_unembed", true}, {"train_mlp", true}, {"train_attn", true}};
    if (lora_seed >= 0) lora["seed"] = lora_seed;
    Json m = Result(PostOk("create_model", {{"session_id", session_}, {"model_seq_id", model_seq_id},
                                            {"base_model", base_model}, {"lora_config", lora},
                                            {"type", "create_model"}}));
    model_ = m.value("model_id", "");
    ASSERT_FALSE(model_.empty());
  }

  // forward_backward (or forward) of one datum: next-token targets, all weights 1.
  testing::Reply SubmitForward(std::vector<int32_t> tokens, std::vector<int64_t> targets, bool forward_only) {
    tinker::ForwardBackwardRequest req;
    req.model_id = model_;
    req.seq_id = ++seq_;
    tinker::Datum d;
    d.tokens = std::move(tokens);
    d.loss_fn_inputs["weights"] = tinker::Array::Floats(std::vector<float>(targets.size(), 1.0f));
    d.loss_fn_inputs["target_tokens"] = tinker::Array::Ints(std::move(targets));
    req.call.data.push_back(d);
    req.call.loss_fn = "cross_entropy";
    req.call.forward_only = forward_only;
    return PostProto("forward_backward", wire::EncodeForwardBackwardRequest(req));
  }
  std::vector<float> Forward(std::vector<int32_t> tokens, std::vector<int64_t> targets, bool forward_only) {
    auto sub = SubmitForward(std::move(tokens), std::move(targets), forward_only);
    EXPECT_EQ(sub.status, 200) << sub.body;
    if (sub.status != 200) return {};
    auto out = wire::DecodeForwardBackwardOutput(Retrieve(Json::parse(sub.body)["request_id"], true).body);
    EXPECT_TRUE(out.ok()) << out.status().message();
    if (!out.ok() || out->outputs.empty()) return {};
    return out->outputs[0].at("logprobs").f32;
  }
  void TrainStep(int salt) {
    std::vector<int32_t> tokens;
    std::vector<int64_t> targets;
    for (int i = 0; i < 8; ++i) {
      tokens.push_back((salt * 7 + i * 3) % 97 + 1);
      targets.push_back((salt * 7 + (i + 1) * 3) % 97 + 1);
    }
    Forward(tokens, targets, false);
    OptimStep();
  }
  void OptimStep(double learning_rate = 2e-2) {
    Result(PostOk("optim_step", {{"model_id", model_}, {"seq_id", ++seq_},
                                 {"adam_params", {{"learning_rate", learning_rate}, {"beta1", 0.9}, {"beta2", 0.95},
                                                  {"eps", 1e-12}, {"weight_decay", 0.0}, {"grad_clip_norm", 0.0}}},
                                 {"type", "optim_step"}}));
  }
  // One RL step's training: importance_sampling forward_backward on the
  // group's completions of prompt (the sampler's logprobs, advantage =
  // reward - the group's mean, zero on prompt positions), then optim_step.
  void TrainImportanceSampling(const std::vector<int32_t>& prompt, const wire::SampleResult& group,
                               const std::vector<double>& rewards) {
    double mean = 0;
    for (double r : rewards) mean += r / static_cast<double>(rewards.size());
    tinker::ForwardBackwardRequest req;
    req.model_id = model_;
    req.seq_id = ++seq_;
    req.call.loss_fn = "importance_sampling";
    for (size_t i = 0; i < group.sequences.size(); ++i) {
      const auto& s = group.sequences[i];
      tinker::Datum d;
      d.tokens = prompt;
      d.tokens.insert(d.tokens.end(), s.tokens.begin(), s.tokens.end() - 1);
      std::vector<int64_t> targets(prompt.begin() + 1, prompt.end());
      targets.insert(targets.end(), s.tokens.begin(), s.tokens.end());
      std::vector<float> logprobs(targets.size(), 0.0f), advantages(targets.size(), 0.0f);
      for (size_t j = 0; j < s.tokens.size(); ++j) {
        logprobs[prompt.size() - 1 + j] = s.logprobs[j];
        advantages[prompt.size() - 1 + j] = static_cast<float>(rewards[i] - mean);
      }
      d.loss_fn_inputs["target_tokens"] = tinker::Array::Ints(std::move(targets));
      d.loss_fn_inputs["logprobs"] = tinker::Array::Floats(std::move(logprobs));
      d.loss_fn_inputs["advantages"] = tinker::Array::Floats(std::move(advantages));
      req.call.data.push_back(std::move(d));
    }
    auto sub = PostProto("forward_backward", wire::EncodeForwardBackwardRequest(req));
    ASSERT_EQ(sub.status, 200) << sub.body;
    EXPECT_EQ(Retrieve(Json::parse(sub.body)["request_id"], true).status, 200);
    OptimStep();
  }
  // load_state (optimizer false) or load_state_with_optimizer of a weights/ path into the model.
  Json LoadState(const std::string& path, bool optimizer) {
    return Result(PostOk("load_weights", {{"model_id", model_}, {"seq_id", ++seq_}, {"path", path},
                                          {"optimizer", optimizer}, {"type", "load_weights"}}));
  }
  // save_weights_and_get_sampling_client: an unnamed snapshot + its sampling session.
  std::string SaveForSampling() {
    Json r = Result(PostOk("save_weights_for_sampler", {{"model_id", model_}, {"seq_id", ++seq_},
                                                        {"sampling_session_seq_id", sampling_seq_++},
                                                        {"type", "save_weights_for_sampler"}}));
    return r.value("sampling_session_id", "");
  }
  // save_weights_for_sampler as `name`, submitted (Result() waits for its path).
  Json SubmitSave(const std::string& name) {
    return PostOk("save_weights_for_sampler",
                  {{"model_id", model_}, {"seq_id", ++seq_}, {"path", name}, {"type", "save_weights_for_sampler"}});
  }
  // A sampling session on a snapshot's tinker:// path.
  std::string SamplingOn(const std::string& path) {
    return PostOk("create_sampling_session", {{"session_id", session_}, {"sampling_session_seq_id", sampling_seq_++},
                                              {"model_path", path}, {"type", "create_sampling_session"}})
        .value("sampling_session_id", "");
  }
  // The sampler's logprobs of every token of prompt but the first (one
  // sampled token, greedy), on a sampling session.
  std::vector<float> PromptLogprobs(const std::string& sampling, const std::vector<int32_t>& prompt) {
    Json body = SampleBody(sampling, prompt, 1, 1, 0);
    body["prompt_logprobs"] = true;
    body["sampling_params"]["temperature"] = 0.0;
    Json sub = PostOk("asample", body);
    auto out = wire::DecodeSampleResponse(Retrieve(sub.value("request_id", ""), true).body);
    EXPECT_TRUE(out.ok() && out->prompt_logprobs) << (out.ok() ? "no prompt_logprobs" : out.status().message());
    if (!out.ok() || !out->prompt_logprobs) return {};
    return std::vector<float>(out->prompt_logprobs->begin() + 1, out->prompt_logprobs->end());
  }
  Json SampleBody(const std::string& sampling, const std::vector<int32_t>& prompt, int max_tokens, int n,
                  uint64_t seed) {
    return {{"sampling_session_id", sampling}, {"seq_id", sample_seq_++}, {"num_samples", n},
            {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", prompt}}}}}},
            {"sampling_params", {{"max_tokens", max_tokens}, {"temperature", 1.0}, {"seed", seed}}},
            {"prompt_logprobs", false}, {"topk_prompt_logprobs", 0}, {"type", "sample"}};
  }
  wire::SampleResult Sample(const std::string& sampling, const std::vector<int32_t>& prompt, int max_tokens, int n,
                            uint64_t seed) {
    Json sub = PostOk("asample", SampleBody(sampling, prompt, max_tokens, n, seed));
    EXPECT_EQ(sub["sample_sequence_ids"].size(), static_cast<size_t>(n)) << sub.dump();
    auto res = Retrieve(sub.value("request_id", ""), true);
    EXPECT_EQ(res.content_type, "application/x-protobuf") << res.body;
    auto out = wire::DecodeSampleResponse(res.body);
    EXPECT_TRUE(out.ok()) << out.status().message() << " " << res.body;
    return out.ok() ? *out : wire::SampleResult{};
  }
  // Each sampled token's logprob equals the trainer's forward logprob of it.
  void ExpectConsistent(const std::vector<int32_t>& prompt, const wire::SampleResult& r, const std::string& who) {
    ASSERT_FALSE(r.sequences.empty()) << who;
    for (const auto& s : r.sequences) {
      ASSERT_FALSE(s.tokens.empty()) << who;
      std::vector<int32_t> tokens = prompt;
      tokens.insert(tokens.end(), s.tokens.begin(), s.tokens.end() - 1);
      std::vector<int64_t> targets(prompt.begin() + 1, prompt.end());
      targets.insert(targets.end(), s.tokens.begin(), s.tokens.end());
      std::vector<float> lp = Forward(tokens, targets, /*forward_only=*/true);
      ASSERT_EQ(lp.size(), tokens.size()) << who;
      for (size_t j = 0; j < s.tokens.size(); ++j) {
        EXPECT_NEAR(s.logprobs[j], lp[prompt.size() - 1 + j], 1e-4) << who << " token " << j;
      }
    }
  }
  const std::string& model() const { return model_; }
  const std::string& session() const { return session_; }

 private:
  testing::HttpClient client_;
  std::string key_;
  std::string session_, model_;
  int64_t seq_ = 0;
  int64_t sampling_seq_ = 0;
  int64_t sample_seq_ = 0;
};

}  // namespace loom::test
