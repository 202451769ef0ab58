// The gateway over real loopback HTTP, in-process, on a FakeEngine: auth,
// bad input of every kind (each a 4xx with a JSON body, the server stays up),
// tenant isolation, long-poll behaviour, protobuf results, REST checkpoints.
#include <gtest/gtest.h>

#include <thread>

#include "gateway_fixture.h"
#include "wire/forward_backward.h"
#include "wire/zstd.h"

namespace loom::http {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using testing::Reply;

using testing::kAlice;
using testing::kBob;

class GatewayTest : public testing::GatewayFixture {
 protected:
  void SetUp() override { StartGateway("loom_http_", /*with_sampler=*/false, /*max_body_bytes=*/64 * 1024); }
  void ExpectAlive() { EXPECT_EQ(client_->Call("GET", "/api/v1/healthz").status, 200); }

};

TEST_F(GatewayTest, HealthAndClientConfigAnswerAsTheSdkNeeds) {
  Reply h = client_->Call("GET", "/api/v1/healthz");
  EXPECT_EQ(h.status, 200);
  EXPECT_EQ(Json::parse(h.body)["status"], "ok");
  Json cfg = PostOk("client/config", {{"sdk_version", "0.26.2"}});
  EXPECT_EQ(cfg["pjwt_auth_enabled"], false);
  EXPECT_EQ(PostOk("telemetry", {{"events", Json::array()}, {"sdk_version", "0.26.2"}})["status"], "accepted");
  Reply caps = client_->Call("GET", "/api/v1/get_server_capabilities", "", {{"X-API-Key", kAlice}});
  EXPECT_EQ(Json::parse(caps.body)["supported_models"][0]["model_name"], "test/base");
}

TEST_F(GatewayTest, MissingOrMalformedKeyIs401WithJson) {
  ExpectJsonError(client_->Call("POST", "/api/v1/create_session", "{}"), 401, "X-API-Key");
  ExpectJsonError(Post("create_session", Json::object(), "not-a-tinker-key"), 401, "tml-");
  ExpectAlive();
}

TEST_F(GatewayTest, KeysFileRestrictsTenants) {
  auto keys = ApiKeys::Parse("# comment\nsecret-1 team-a\nsecret-2 team-b\n");
  ASSERT_TRUE(keys.ok());
  EXPECT_EQ(*keys->Authenticate("secret-1"), "team-a");
  EXPECT_EQ(keys->Authenticate("tml-anything").status().code(), Code::kUnauthenticated);
  EXPECT_TRUE(keys->AllowedOn("0.0.0.0").ok());
  EXPECT_FALSE(ApiKeys().AllowedOn("0.0.0.0").ok());
  EXPECT_TRUE(ApiKeys().AllowedOn("127.0.0.1").ok());
  EXPECT_EQ(ApiKeys::Parse("only-one-word\n").status().code(), Code::kInvalidArgument);
}

TEST_F(GatewayTest, BadBodiesGet4xxJsonNamingTheProblem) {
  ExpectJsonError(client_->Call("POST", "/api/v1/create_session", "{not json", {{"X-API-Key", kAlice}}), 400);
  ExpectJsonError(client_->Call("POST", "/api/v1/create_session", "[1,2]", {{"X-API-Key", kAlice}}), 400);
  Json s = PostOk("create_session", Json::object());
  ExpectJsonError(Post("create_model", {{"session_id", s["session_id"]}, {"model_seq_id", 0},
                                        {"base_model", "test/base"}, {"lora_config", {{"rank", "big"}}}}),
                  400, "rank");
  ExpectJsonError(Post("optim_step", {{"model_id", "x"}, {"seq_id", 1}}), 400, "adam_params");
  // Malformed protobuf.
  ExpectJsonError(PostFb("\xff\xff\xff garbage"), 400);
  // JSON where protobuf is required.
  ExpectJsonError(client_->Call("POST", "/api/v1/forward_backward", "{}", {{"X-API-Key", kAlice}}), 400, "protobuf");
  // Corrupt zstd.
  ExpectJsonError(client_->Call("POST", "/api/v1/forward_backward", "not zstd",
                                {{"X-API-Key", kAlice}, {"Content-Encoding", "zstd"},
                                 {"Content-Type", "application/x-protobuf"}}),
                  400, "zstd");
  ExpectJsonError(client_->Call("GET", "/api/v1/no_such_thing", "", {{"X-API-Key", kAlice}}), 404);
  ExpectAlive();
}

TEST_F(GatewayTest, OversizedBodiesAre413AndTheServerStaysUp) {
  std::string big(100 * 1024, 'x');  // limit is 64 KiB
  ExpectJsonError(client_->Call("POST", "/api/v1/create_session", big, {{"X-API-Key", kAlice}}), 413, "65536");
  // A small zstd body that expands past the limit.
  std::string bomb = wire::ZstdCompress(std::string(1 << 20, '\0'));
  ASSERT_LT(bomb.size(), 64u * 1024);
  ExpectJsonError(client_->Call("POST", "/api/v1/forward_backward", bomb,
                                {{"X-API-Key", kAlice}, {"Content-Encoding", "zstd"},
                                 {"Content-Type", "application/x-protobuf"}}),
                  413);
  ExpectAlive();
}

TEST_F(GatewayTest, TrainingFlowWithProtobufResults) {
  std::string model = CreateModel();
  // zstd-compressed like the SDK with proto_compress_fwdbwd.
  Reply sub = PostFb(FbBody(model, 1), kAlice, /*zstd=*/true);
  ASSERT_EQ(sub.status, 200) << sub.body;
  std::string rid = Json::parse(sub.body)["request_id"];
  Reply res = Retrieve(rid, kAlice, /*proto=*/true);
  ASSERT_EQ(res.status, 200);
  EXPECT_EQ(res.content_type, "application/x-protobuf");
  auto out = wire::DecodeForwardBackwardOutput(res.body);
  ASSERT_TRUE(out.ok()) << out.status().message();
  ASSERT_EQ(out->outputs.size(), 1u);
  EXPECT_EQ(out->outputs[0].at("logprobs").f32.size(), 3u);
  EXPECT_EQ(out->metrics.at("loss:sum"), 1.0);
  // Without the protobuf Accept header: the legacy JSON shape.
  Reply legacy = Retrieve(rid, kAlice, /*proto=*/false);
  EXPECT_EQ(Json::parse(legacy.body)["metrics"]["loss:sum"], 1.0);

  Json opt = PostOk("optim_step", {{"model_id", model}, {"seq_id", 2},
                                   {"adam_params", {{"learning_rate", 1e-4}, {"beta1", 0.9}, {"beta2", 0.95},
                                                    {"eps", 1e-12}, {"weight_decay", 0.0}, {"grad_clip_norm", 0.0}}},
                                   {"type", "optim_step"}});
  Json opt_res = Json::parse(Retrieve(opt["request_id"]).body);
  EXPECT_EQ(opt_res["metrics"]["grad_norm"], 0.5);
  Json info = PostOk("get_info", {{"model_id", model}, {"type", "get_info"}});
  EXPECT_EQ(info["model_data"]["model_name"], "test/base");
  EXPECT_EQ(info["lora_rank"], 4);
}

TEST_F(GatewayTest, LongPollHoldsThenTryAgainAndWakesOnCompletion) {
  std::string model = CreateModel();
  engine_->Hold();
  Reply sub = PostFb(FbBody(model, 1));
  std::string rid = Json::parse(sub.body)["request_id"];
  engine_->WaitInForward();
  auto t0 = std::chrono::steady_clock::now();
  Reply r = client_->Call("POST", "/api/v1/retrieve_future", Json{{"request_id", rid}}.dump(), {{"X-API-Key", kAlice}});
  auto held = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(r.status, 200);
  Json j = Json::parse(r.body);
  EXPECT_EQ(j["type"], "try_again");
  EXPECT_EQ(j["request_id"], rid);
  EXPECT_EQ(j["queue_state"], "active");
  EXPECT_GE(held, 900ms);
  // Other requests are served while a poll is parked.
  std::thread poller([&] {
    t0 = std::chrono::steady_clock::now();
    r = client_->Call("POST", "/api/v1/retrieve_future", Json{{"request_id", rid}}.dump(),
                      {{"X-API-Key", kAlice}, {"Accept", "application/x-protobuf"}});
    held = std::chrono::steady_clock::now() - t0;
  });
  std::this_thread::sleep_for(100ms);
  ExpectAlive();
  engine_->Release();
  poller.join();
  EXPECT_LT(held, 800ms);  // woken by completion, not by the 1 s hold
  EXPECT_EQ(r.content_type, "application/x-protobuf");
}

TEST_F(GatewayTest, OtherTenantsGet404AndOldIdsGet410) {
  std::string model = CreateModel(kAlice);
  Reply sub = PostFb(FbBody(model, 1));
  std::string rid = Json::parse(sub.body)["request_id"];
  ExpectJsonError(client_->Call("POST", "/api/v1/retrieve_future", Json{{"request_id", rid}}.dump(),
                                {{"X-API-Key", kBob}}),
                  404);
  ExpectJsonError(Post("get_info", {{"model_id", model}}, kBob), 404);
  ExpectJsonError(PostFb(FbBody(model, 2), kBob), 404);
  ExpectJsonError(client_->Call("GET", "/api/v1/training_runs/" + model, "", {{"X-API-Key", kBob}}), 404);
  ExpectJsonError(client_->Call("POST", "/api/v1/retrieve_future", Json{{"request_id", "req-0ld0ld-1"}}.dump(),
                                {{"X-API-Key", kAlice}}),
                  410);
  // Alice's training carried on regardless.
  EXPECT_EQ(Retrieve(rid, kAlice, true).status, 200);
}

TEST_F(GatewayTest, SamplingRoutesAnswerJsonErrorsForUnknownIds) {
  // Served now (tests/http/sampling_http_test.cpp covers the flow); unknown ids are 404 JSON.
  ExpectJsonError(Post("create_sampling_session", {{"session_id", "s"}, {"sampling_session_seq_id", 0},
                                                   {"base_model", "test/base"}}), 404, "session_id");
  ExpectJsonError(Post("asample", Json::object()), 400);
  ExpectJsonError(client_->Call("GET", "/api/v1/samplers/x:sample:0", "", {{"X-API-Key", kAlice}}), 404);
}

TEST_F(GatewayTest, CheckpointRestListArchiveTtlPublishDelete) {
  std::string model = CreateModel();
  Json save = PostOk("save_weights", {{"model_id", model}, {"path", "step1"}, {"seq_id", 1}, {"overwrite", false},
                                      {"type", "save_weights"}});
  Json saved = Json::parse(Retrieve(save["request_id"]).body);
  EXPECT_EQ(saved["path"], "tinker://" + model + "/weights/step1");
  // A second save under the same name: a 200 future error with category user (not 409).
  Json again = PostOk("save_weights", {{"model_id", model}, {"path", "step1"}, {"seq_id", 2}, {"overwrite", false}});
  Json failed = Json::parse(Retrieve(again["request_id"]).body);
  EXPECT_EQ(failed["category"], "user");
  EXPECT_NE(failed["error"].get<std::string>().find("already exists"), std::string::npos);

  auto get = [&](const std::string& t, const char* key = kAlice) { return client_->Call("GET", t, "", {{"X-API-Key", key}}); };
  Json runs = Json::parse(get("/api/v1/training_runs?limit=10&offset=0&access_scope=owned").body);
  ASSERT_EQ(runs["training_runs"].size(), 1u);
  EXPECT_EQ(runs["training_runs"][0]["last_checkpoint"]["checkpoint_id"], "weights/step1");
  EXPECT_EQ(runs["cursor"]["total_count"], 1);
  Json list = Json::parse(get("/api/v1/training_runs/" + model + "/checkpoints").body);
  ASSERT_EQ(list["checkpoints"].size(), 1u);
  EXPECT_EQ(list["checkpoints"][0]["tinker_path"], "tinker://" + model + "/weights/step1");

  const std::string base = "/api/v1/training_runs/" + model + "/checkpoints/weights/step1";
  Reply ttl = client_->Call("PUT", base + "/ttl", Json{{"ttl_seconds", 3600}}.dump(), {{"X-API-Key", kAlice}});
  EXPECT_EQ(ttl.status, 200) << ttl.body;
  EXPECT_EQ(client_->Call("POST", base + "/publish", "", {{"X-API-Key", kAlice}}).status, 200);
  Json pub = Json::parse(get("/api/v1/checkpoints?limit=100&offset=0").body);
  EXPECT_EQ(pub["checkpoints"][0]["public"], true);
  EXPECT_TRUE(pub["checkpoints"][0].contains("expires_at"));

  Reply archive = get(base + "/archive");
  ASSERT_EQ(archive.status, 200) << archive.body;
  std::string url = Json::parse(archive.body)["url"];
  const std::string prefix = "http://127.0.0.1:" + std::to_string(server_->port());
  ASSERT_EQ(url.rfind(prefix, 0), 0u) << url;
  Reply tar = client_->Call("GET", url.substr(prefix.size()));  // no key: the token is the credential
  ASSERT_EQ(tar.status, 200);
  EXPECT_EQ(tar.content_type, "application/x-tar");
  EXPECT_NE(tar.body.find("checkpoint_complete"), std::string::npos);
  ExpectJsonError(get(base + "/archive", kBob), 404);
  ExpectJsonError(client_->Call("DELETE", base, "", {{"X-API-Key", kBob}}), 404);

  EXPECT_EQ(client_->Call("DELETE", base, "", {{"X-API-Key", kAlice}}).status, 200);
  EXPECT_EQ(Json::parse(get("/api/v1/training_runs/" + model + "/checkpoints").body)["checkpoints"].size(), 0u);
  ExpectJsonError(client_->Call("DELETE", base, "", {{"X-API-Key", kAlice}}), 404);
}

}  // namespace
}  // namespace loom::http
