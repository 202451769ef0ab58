// 8 tenants train at once through the real `loom serve` (its scheduler packs
// their forward_backward and optim_step requests into shared passes); every
// tenant's losses over K steps must equal the losses of the same tenant
// trained alone on the same server (fp32 CPU: packing may only reorder float
// sums, so relative 2e-5). Also scrapes /metrics: packing really happened.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "../http/test_client.h"
#include "serve_process.h"
#include "wire/forward_backward.h"

namespace loom {
namespace {

using Json = nlohmann::json;
using namespace std::chrono_literals;
constexpr int kTenants = 8;
constexpr int kSteps = 3;

// `loom serve` for 16 tenants, with a budget small enough that passes both pack and split.
class Server : public test::ServeProcess {
 public:
  explicit Server(const std::string& data_dir)
      : ServeProcess(data_dir, {"--max-adapters", "16", "--max-rank", "8", "--io-threads", "4", "--token-budget", "256"}) {}
};

// One tenant's training client over HTTP (its own API key = its own tenant).
class TenantClient {
 public:
  TenantClient(uint16_t port, int index) : client_("127.0.0.1", port), key_("tml-mt-" + std::to_string(index)), index_(index) {}

  Json Post(const std::string& route, const Json& body) {
    auto r = client_.Call("POST", "/api/v1/" + route, body.dump(), {{"X-API-Key", key_}});
    EXPECT_EQ(r.status, 200) << route << ": " << r.body;
    return Json::parse(r.body, nullptr, false);
  }
  testing::Reply Retrieve(const std::string& id, bool proto) {
    return testing::RetrieveFuture(client_, key_, id, proto, /*attempts=*/300);
  }

  void Create() {
    Json s = Post("create_session", {{"tags", Json::array()}, {"user_metadata", Json::object()},
                                     {"sdk_version", "0.26.2"}, {"type", "create_session"}});
    Json sub = Post("create_model", {{"session_id", s["session_id"]}, {"model_seq_id", 0},
                                     {"base_model", "loom/tiny-qwen3"},
                                     {"lora_config", {{"rank", 4}, {"seed", 1000 + index_}, {"train_unembed", true},
                                                      {"train_mlp", true}, {"train_attn", true}}},
                                     {"type", "create_model"}});
    auto r = Retrieve(sub["request_id"], false);
    model_ = Json::parse(r.body, nullptr, false).value("model_id", "");
    ASSERT_FALSE(model_.empty()) << r.body;
  }

  // This tenant's datums: lengths and tokens differ per tenant (2 datums).
  tinker::ForwardBackwardInput Data() const {
    tinker::ForwardBackwardInput call;
    for (int k = 0; k < 2; ++k) {
      const int n = 6 + 3 * index_ + 5 * k;
      tinker::Datum d;
      std::vector<int64_t> targets;
      for (int t = 0; t < n; ++t) {
        d.tokens.push_back((index_ * 37 + k * 11 + t * 7) % 200 + 1);
        targets.push_back((index_ * 53 + k * 5 + t * 13) % 200 + 1);
      }
      d.loss_fn_inputs["target_tokens"] = tinker::Array::Ints(targets);
      call.data.push_back(d);
    }
    return call;
  }

  double ForwardBackward(bool forward_only) {
    tinker::ForwardBackwardRequest req;
    req.model_id = model_;
    req.seq_id = static_cast<int32_t>(seq_++);
    req.call = Data();
    req.call.forward_only = forward_only;
    auto sub = client_.Call("POST", "/api/v1/forward_backward", wire::EncodeForwardBackwardRequest(req),
                            {{"X-API-Key", key_}, {"Content-Type", "application/x-protobuf"}});
    EXPECT_EQ(sub.status, 200) << sub.body;
    if (sub.status != 200) return NAN;
    auto res = Retrieve(Json::parse(sub.body)["request_id"], true);
    auto out = wire::DecodeForwardBackwardOutput(res.body);
    EXPECT_TRUE(out.ok()) << res.body;
    return out.ok() ? out->metrics.at("loss:sum") : NAN;
  }

  void OptimStep() {
    Json sub = Post("optim_step", {{"model_id", model_},
                                   {"seq_id", seq_++},
                                   {"adam_params", {{"learning_rate", 1e-2}, {"beta1", 0.9}, {"beta2", 0.95},
                                                    {"eps", 1e-12}, {"weight_decay", 0.0}, {"grad_clip_norm", 0.0}}},
                                   {"type", "optim_step"}});
    auto r = Retrieve(sub["request_id"], false);
    EXPECT_EQ(r.status, 200) << r.body;
  }

  // K training steps then a forward: the loss before each step and after the last.
  std::vector<double> Train() {
    Create();
    std::vector<double> losses;
    for (int s = 0; s < kSteps; ++s) {
      losses.push_back(ForwardBackward(false));
      OptimStep();
    }
    losses.push_back(ForwardBackward(true));
    return losses;
  }

 private:
  testing::HttpClient client_;
  std::string key_;
  int index_;
  std::string model_;
  int64_t seq_ = 1;
};

using test::Metric;

TEST(MultiTenant, EightConcurrentTenantsTrainExactlyAsTheyDoAlone) {
  const std::string data_dir =
      (std::filesystem::temp_directory_path() / ("loom_multitenant_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(data_dir);
  Server server(data_dir);
  ASSERT_NE(server.port(), 0) << "loom serve did not start";

  std::vector<std::vector<double>> together(kTenants);
  std::vector<std::thread> threads;
  for (int i = 0; i < kTenants; ++i) {
    threads.emplace_back([&, i] { together[i] = TenantClient(server.port(), i).Train(); });
  }
  for (auto& t : threads) t.join();
  auto scrape = testing::HttpClient("127.0.0.1", server.port()).Call("GET", "/metrics");
  ASSERT_EQ(scrape.status, 200);
  const double fb_passes = Metric(scrape.body, "loom_passes_total{kind=\"forward_backward\"}");
  const double fwd_passes = Metric(scrape.body, "loom_passes_total{kind=\"forward\"}");
  // 8 x 3 forward_backward + 8 forwards ran in fewer passes than requests.
  EXPECT_GT(fb_passes, 0);
  EXPECT_LT(fb_passes + std::max(0.0, fwd_passes), kTenants * (kSteps + 1)) << scrape.body;
  EXPECT_EQ(Metric(scrape.body, "loom_slots_in_use"), kTenants);
  // Every create_session/create_model/fwd-bwd/optim/retrieve answered 200 was counted.
  EXPECT_GE(Metric(scrape.body, "loom_http_responses_total{code=\"200\"}"), kTenants * (2 + 2 * (2 * kSteps + 1)));
  EXPECT_EQ(scrape.content_type.rfind("text/plain", 0), 0u) << scrape.content_type;

  for (int i = 0; i < kTenants; ++i) {
    std::vector<double> alone = TenantClient(server.port(), i).Train();  // same seed, same data, nobody else
    ASSERT_EQ(alone.size(), together[i].size());
    for (size_t s = 0; s < alone.size(); ++s) {
      EXPECT_TRUE(std::isfinite(alone[s]));
      EXPECT_NEAR(together[i][s], alone[s], 2e-5 * std::max(1.0, std::abs(alone[s])))
          << "tenant " << i << " step " << s;
    }
    EXPECT_LT(alone.back(), alone.front()) << "tenant " << i << ": training should lower its loss";
  }
  std::filesystem::remove_all(data_dir);
}

}  // namespace
}  // namespace loom
