// GatewayFixture: a Service over a FakeEngine (and, when asked, a
// FakeSampler) behind a real HttpServer on a loopback port, with the JSON
// helpers the gateway tests share. Open mode keys (any `tml-` key on
// loopback); each test gets its own data directory.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "../service/fake_engine.h"
#include "../service/fake_sampler.h"
#include "http/router.h"
#include "http/server.h"
#include "test_client.h"

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
    auto engine = std::make_unique<FakeEngine>(4);
    engine_ = engine.get();
    auto registry = store::Registry::Open(dir_);
    ASSERT_TRUE(registry.ok());
    service::ServiceOptions so;
    so.base_model_name = "test/base";
    so.janitor_period = 20ms;
    service_ = std::make_unique<service::Service>(so, std::move(engine), std::move(*registry));
    if (with_sampler) service_->AttachSampler(std::make_unique<FakeSampler>(100, 32));
    service_->Start();
    http::RouterOptions ro;
    ro.max_body_bytes = max_body_bytes;
    router_ = std::make_unique<http::Router>(*service_, keys_, ro);
    http::ServerOptions opt;
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
  // Polls retrieve_future until the answer is not try_again.
  Reply Retrieve(const std::string& request_id, const char* key = kAlice, bool proto = false) {
    return RetrieveFuture(*client_, key, request_id, proto, /*attempts=*/20, /*allow_metadata_only=*/true);
  }
  std::string Session(const char* key = kAlice) {
    return PostOk("create_session", {{"tags", Json::array()}, {"user_metadata", Json::object()},
                                     {"sdk_version", "0.26.2"}, {"type", "create_session"}}, key)["session_id"];
  }

  std::string dir_;
  FakeEngine* engine_ = nullptr;
  http::ApiKeys keys_;  // open mode
  std::unique_ptr<service::Service> service_;
  std::unique_ptr<http::Router> router_;
  std::unique_ptr<http::HttpServer> server_;
  std::unique_ptr<HttpClient> client_;
};

}  // namespace loom::testing
