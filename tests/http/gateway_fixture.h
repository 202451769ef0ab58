// GatewayFixture: a Service over a FakeEngine (and, when asked, a
// FakeSampler) behind a real HttpServer on a loopback port, with the JSON
// helpers the gateway tests share. Open mode keys (any `tml-` key on
// loopback); each test gets its own data directory. A test may set
// server_opt_, router_opt_, sample_queue_ and make_engine_ before StartGateway.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "../service/fake_engine.h"
#include "../service/fake_sampler.h"
#include "http/router.h"
#include "http/server.h"
#include "test_client.h"
#include "wire/forward_backward.h"
#include "wire/zstd.h"

namespace loom::testing {

constexpr const char* kAlice = "tml-alice-key";
constexpr const char* kBob = "tml-bob-key";

class GatewayFixture : public ::testing::Test {
 protected:
  using Json = nlohmann::json;

  // Call from SetUp. max_body_bytes limits both the router and the server.
  void StartGateway(const std::string& prefix, bool with_sampler,
                    size_t max_body_bytes = http::RouterOptions{}.max_body_bytes) {
    using namespace std::chrono_literals;
    dir_ = (std::filesystem::temp_directory_path() /
            (prefix + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
             std::to_string(::getpid())))
               .string();
    std::filesystem::remove_all(dir_);
    auto engine = make_engine_ ? make_engine_() : std::make_unique<FakeEngine>(4);
    engine_ = engine.get();
    auto registry = store::Registry::Open(dir_);
    ASSERT_TRUE(registry.ok());
    service::ServiceOptions so;
    so.base_model_name = "test/base";
    so.janitor_period = 20ms;
    so.sample_queue = sample_queue_;
    service_ = std::make_unique<service::Service>(so, std::move(engine), std::move(*registry));
    if (with_sampler) {
      auto sampler = std::make_unique<FakeSampler>(100, 32);
      sampler_ = sampler.get();
      service_->AttachSampler(std::move(sampler));
    }
    service_->Start();
    http::RouterOptions ro = router_opt_;
    ro.max_body_bytes = max_body_bytes;
    router_ = std::make_unique<http::Router>(*service_, keys_, ro);
    http::ServerOptions opt = server_opt_;
    opt.port = 0;
    opt.max_body_bytes = max_body_bytes;
    opt.poll_hold = 1s;
    server_ = std::make_unique<http::HttpServer>(*router_, service_->futures(), opt);
    ASSERT_TRUE(server_->Start().ok());
    client_ = std::make_unique<HttpClient>("127.0.0.1", server_->port());
  }
  void TearDown() override {
    using namespace std::chrono_literals;
    if (engine_) engine_->Release();
    if (server_) server_->Stop(0ms);
    if (service_) service_->Stop();
    std::filesystem::remove_all(dir_);
  }

  Reply Post(const std::string& route, const Json& body, const char* key = kAlice) {
    return client_->Call("POST", "/api/v1/" + route, body.dump(), {{"X-API-Key", key}});
  }
  Json PostOk(const std::string& route, const Json& body, const char* key = kAlice) {
    Reply r = Post(route, body, key);
    EXPECT_EQ(r.status, 200) << route << ": " << r.body;
    return Json::parse(r.body, nullptr, false);
  }
  // A GET with the key (none: nullptr).
  Reply Get(const std::string& path, const char* key) {
    std::vector<std::pair<std::string, std::string>> h;
    if (key) h.emplace_back("X-API-Key", key);
    return client_->Call("GET", path, "", h);
  }
  Json GetOk(const std::string& path, const char* key) {
    Reply r = Get(path, key);
    EXPECT_EQ(r.status, 200) << path << ": " << r.body;
    return Json::parse(r.body, nullptr, false);
  }
  // Polls retrieve_future until the answer is not try_again.
  Reply Retrieve(const std::string& request_id, const char* key = kAlice, bool proto = false) {
    return RetrieveFuture(*client_, key, request_id, proto, /*attempts=*/20, /*allow_metadata_only=*/true);
  }
  std::string Session(const char* key = kAlice) {
    return PostOk("create_session", {{"tags", Json::array()}, {"user_metadata", Json::object()},
                                     {"sdk_version", "0.26.2"}, {"type", "create_session"}}, key)["session_id"];
  }

  std::string CreateModel(const char* key = kAlice) {
    Json sub = PostOk("create_model", {{"session_id", Session(key)}, {"model_seq_id", 0},
                                       {"base_model", "test/base"},
                                       {"lora_config", {{"rank", 4}, {"train_unembed", true}, {"train_mlp", true},
                                                        {"train_attn", true}}},
                                       {"type", "create_model"}}, key);
    Reply r = Retrieve(sub["request_id"], key);
    Json j = Json::parse(r.body);
    EXPECT_EQ(j["type"], "create_model");
    return j["model_id"];
  }
  std::string FbBody(const std::string& model, int seq, int first_token = 1) {
    tinker::ForwardBackwardRequest req;
    req.model_id = model;
    req.seq_id = seq;
    engine::Datum d;
    d.tokens = {first_token, 2, 3};
    d.loss_fn_inputs["target_tokens"] = engine::Array::Ints({2, 3, 4});
    d.loss_fn_inputs["weights"] = engine::Array::Floats({0, 1, 1});
    req.call.data.push_back(d);
    return wire::EncodeForwardBackwardRequest(req);
  }
  Reply PostFb(const std::string& body, const char* key = kAlice, bool zstd = false) {
    std::vector<std::pair<std::string, std::string>> h{{"X-API-Key", key},
                                                       {"Content-Type", "application/x-protobuf"}};
    if (zstd) h.emplace_back("Content-Encoding", "zstd");
    return client_->Call("POST", "/api/v1/forward_backward", zstd ? wire::ZstdCompress(body) : body, h);
  }  // forward_backward calls of FbBody's one 3-token datum, seq 1..calls, each waited for.
  void Train(const std::string& model, int calls, const char* key) {
    for (int seq = 1; seq <= calls; ++seq) {
      Reply sub = PostFb(FbBody(model, seq), key);
      ASSERT_EQ(sub.status, 200) << sub.body;
      Json done = Json::parse(Retrieve(Json::parse(sub.body)["request_id"], key).body, nullptr, false);
      EXPECT_FALSE(done.contains("error")) << done.dump();
    }
  }

  // Every error is JSON with a non-empty "error".
  static void ExpectJsonError(const Reply& r, int status, const std::string& fragment = "") {
    EXPECT_EQ(r.status, status) << r.body;
    EXPECT_NE(r.content_type.find("json"), std::string::npos);
    Json j = Json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.body;
    ASSERT_TRUE(j.contains("error")) << r.body;
    EXPECT_FALSE(j["error"].get<std::string>().empty());
    if (!fragment.empty()) EXPECT_NE(r.body.find(fragment), std::string::npos) << r.body;
  }

  http::ServerOptions server_opt_;
  http::RouterOptions router_opt_;
  int sample_queue_ = service::ServiceOptions{}.sample_queue;
  FakeSampler* sampler_ = nullptr;  // with_sampler: owned by service_
  std::function<std::unique_ptr<FakeEngine>()> make_engine_;
  std::string dir_;
  FakeEngine* engine_ = nullptr;
  http::ApiKeys keys_;  // open mode
  std::unique_ptr<service::Service> service_;
  std::unique_ptr<http::Router> router_;
  std::unique_ptr<http::HttpServer> server_;
  std::unique_ptr<HttpClient> client_;
};

}  // namespace loom::testing
