// End to end sampling on the real `loom serve` (embedded tiny qwen3, CPU,
// fp32): two tenants train a few cross_entropy steps, save unnamed sampler
// snapshots (save_weights_and_get_sampling_client) and sample from them while
// a third tenant keeps training. Each sampled token's logprob must equal the
// trainer's forward_only logprob of the same tokens on the same adapter
// (1e-4). With --sampler-adapters 1 the two snapshots evict each other, and a
// re-sample with the same seed after eviction gives the same tokens. The
// context window W (--context-window) gives 400s for long data and prompts.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "../http/test_client.h"
#include "serve_process.h"
#include "wire/forward_backward.h"
#include "wire/sample.h"

namespace loom {
namespace {

using Json = nlohmann::json;
using namespace std::chrono_literals;

constexpr int kWindow = 40;  // --context-window

// `loom serve` with a one-adapter sampler cache (so tenants evict each other)
// and a small context window.
class SamplingServer : public test::ServeProcess {
 public:
  explicit SamplingServer(const std::string& data_dir)
      : ServeProcess(data_dir, {"--max-adapters", "3", "--max-rank", "8", "--sampler-adapters", "1",
                                "--kv-budget-tokens", "4096", "--context-window", std::to_string(kWindow)}) {}
};

// One tenant's client: its own key, session, model and seq counters.
class Tenant {
 public:
  Tenant(uint16_t port, std::string key) : client_("127.0.0.1", port), key_(std::move(key)) {}

  testing::Reply Post(const std::string& route, const Json& body) {
    return client_.Call("POST", "/api/v1/" + route, body.dump(), {{"X-API-Key", key_}});
  }
  Json PostOk(const std::string& route, const Json& body) {
    auto r = Post(route, body);
    EXPECT_EQ(r.status, 200) << route << ": " << r.body;
    return Json::parse(r.body, nullptr, false);
  }
  testing::Reply Retrieve(const std::string& id, bool proto) {
    return testing::RetrieveFuture(client_, key_, id, proto, /*attempts=*/300);
  }
  Json Result(const Json& submitted) {
    auto r = Retrieve(submitted.value("request_id", ""), false);
    Json j = Json::parse(r.body, nullptr, false);
    EXPECT_FALSE(j.contains("error")) << r.body;
    return j;
  }

  void Start() {
    session_ = PostOk("create_session", {{"tags", Json::array()}, {"user_metadata", Json::object()},
                                         {"sdk_version", "0.26.2"}, {"type", "create_session"}})["session_id"];
    Json m = Result(PostOk("create_model", {{"session_id", session_}, {"model_seq_id", 0},
                                            {"base_model", "loom/tiny-qwen3"},
                                            {"lora_config", {{"rank", 4}, {"train_unembed", true},
                                                             {"train_mlp", true}, {"train_attn", true}}},
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
    return client_.Call("POST", "/api/v1/forward_backward", wire::EncodeForwardBackwardRequest(req),
                        {{"X-API-Key", key_}, {"Content-Type", "application/x-protobuf"}});
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
    Result(PostOk("optim_step", {{"model_id", model_}, {"seq_id", ++seq_},
                                 {"adam_params", {{"learning_rate", 2e-2}, {"beta1", 0.9}, {"beta2", 0.95},
                                                  {"eps", 1e-12}, {"weight_decay", 0.0}, {"grad_clip_norm", 0.0}}},
                                 {"type", "optim_step"}}));
  }
  // save_weights_and_get_sampling_client: an unnamed snapshot + its sampling session.
  std::string SaveForSampling() {
    Json r = Result(PostOk("save_weights_for_sampler", {{"model_id", model_}, {"seq_id", ++seq_},
                                                        {"sampling_session_seq_id", sampling_seq_++},
                                                        {"type", "save_weights_for_sampler"}}));
    return r.value("sampling_session_id", "");
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

TEST(SamplingFlow, TwoTenantsSampleTheirSnapshotsWhileAThirdTrains) {
  const std::string data_dir =
      (std::filesystem::temp_directory_path() / ("loom_sampling_flow_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(data_dir);
  SamplingServer server(data_dir);
  ASSERT_NE(server.port(), 0) << "no listening banner: " << server.banner();

  Tenant a(server.port(), "tml-tenant-a"), b(server.port(), "tml-tenant-b"), c(server.port(), "tml-tenant-c");
  a.Start();
  b.Start();
  c.Start();
  for (int step = 0; step < 3; ++step) {
    a.TrainStep(step);
    b.TrainStep(step + 10);
  }
  const std::string sa = a.SaveForSampling(), sb = b.SaveForSampling();
  ASSERT_EQ(sa, a.session() + ":sample:0");
  ASSERT_EQ(sb, b.session() + ":sample:0");

  // The third tenant trains until the samplers are done.
  std::atomic<bool> done{false};
  std::atomic<int> c_steps{0};
  std::thread trainer([&] {
    while (!done.load()) {
      c.TrainStep(c_steps.load() + 20);
      c_steps.fetch_add(1);
    }
  });

  const std::vector<int32_t> prompt = {5, 17, 42, 9};
  wire::SampleResult ra, rb;
  std::thread ta([&] { ra = a.Sample(sa, prompt, 6, 2, 1234); });
  std::thread tb([&] { rb = b.Sample(sb, prompt, 6, 2, 1234); });
  ta.join();
  tb.join();
  ASSERT_EQ(ra.sequences.size(), 2u);
  ASSERT_EQ(rb.sequences.size(), 2u);
  // Same seed and prompt, different adapters: different distributions.
  bool differ = false;
  for (size_t i = 0; i < 2; ++i) {
    differ |= ra.sequences[i].tokens != rb.sequences[i].tokens || ra.sequences[i].logprobs != rb.sequences[i].logprobs;
  }
  EXPECT_TRUE(differ);

  // B's snapshot evicted A's (one cache slot): A re-samples the same tokens.
  wire::SampleResult ra2 = a.Sample(sa, prompt, 6, 2, 1234);
  ASSERT_EQ(ra2.sequences.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(ra2.sequences[i].tokens, ra.sequences[i].tokens) << "sample " << i;
    for (size_t j = 0; j < ra.sequences[i].logprobs.size() && j < ra2.sequences[i].logprobs.size(); ++j) {
      EXPECT_NEAR(ra2.sequences[i].logprobs[j], ra.sequences[i].logprobs[j], 1e-5);
    }
  }
  done = true;
  trainer.join();
  EXPECT_GE(c_steps.load(), 1);

  // The trainer agrees with the sampler on every sampled token (A and B stopped training at their snapshots).
  a.ExpectConsistent(prompt, ra, "tenant a");
  b.ExpectConsistent(prompt, rb, "tenant b");

  // compute_logprobs: prompt logprobs equal the trainer's on the same adapter.
  Json sub = a.PostOk("asample", [&] {
    Json body = a.SampleBody(sa, prompt, 1, 1, 1);
    body["prompt_logprobs"] = true;
    return body;
  }());
  auto cl = wire::DecodeSampleResponse(a.Retrieve(sub["request_id"], true).body);
  ASSERT_TRUE(cl.ok());
  ASSERT_TRUE(cl->prompt_logprobs.has_value());
  ASSERT_EQ(cl->prompt_logprobs->size(), prompt.size());
  EXPECT_TRUE(std::isnan((*cl->prompt_logprobs)[0]));
  std::vector<float> lp = a.Forward({prompt.begin(), prompt.end() - 1}, {prompt.begin() + 1, prompt.end()}, true);
  ASSERT_EQ(lp.size(), prompt.size() - 1);
  for (size_t t = 1; t < prompt.size(); ++t) EXPECT_NEAR((*cl->prompt_logprobs)[t], lp[t - 1], 1e-4) << t;

  // Tenant isolation: B cannot sample on A's sampling session or open A's snapshot.
  EXPECT_EQ(b.Post("asample", b.SampleBody(sa, prompt, 2, 1, 1)).status, 404);
  auto get = testing::HttpClient("127.0.0.1", server.port())
                 .Call("GET", "/api/v1/samplers/" + sa, "", {{"X-API-Key", "tml-tenant-a"}});
  ASSERT_EQ(get.status, 200) << get.body;
  const std::string path = Json::parse(get.body).value("model_path", "");
  EXPECT_NE(path.find(a.model() + "/sampler_weights/"), std::string::npos) << get.body;
  auto foreign = b.Post("create_sampling_session", {{"session_id", b.session()}, {"sampling_session_seq_id", 5},
                                                    {"model_path", path}});
  EXPECT_EQ(foreign.status, 404) << foreign.body;

  // The context window W: prompt + max_tokens > W and a training datum > W are 400s that say so.
  auto long_prompt = a.Post("asample", a.SampleBody(sa, prompt, kWindow, 1, 1));
  EXPECT_EQ(long_prompt.status, 400) << long_prompt.body;
  EXPECT_NE(long_prompt.body.find("max_tokens"), std::string::npos) << long_prompt.body;
  EXPECT_NE(long_prompt.body.find(std::to_string(kWindow)), std::string::npos) << long_prompt.body;
  std::vector<int32_t> long_tokens(kWindow + 1, 3);
  auto long_datum = a.SubmitForward(long_tokens, std::vector<int64_t>(kWindow + 1, 4), false);
  EXPECT_EQ(long_datum.status, 400) << long_datum.body;
  EXPECT_NE(long_datum.body.find("context window of " + std::to_string(kWindow)), std::string::npos)
      << long_datum.body;
  EXPECT_NE(long_datum.body.find("data[0]"), std::string::npos) << long_datum.body;
  std::filesystem::remove_all(data_dir);
}

}  // namespace
}  // namespace loom
