// End to end through the real `loom serve`: with --api-keys, one tenant gets
// at most max(1, slots/4) live models (429 naming the quota), a create_model
// on a full service waits (try_again, queue_state paused_capacity) and gets
// the slot another tenant unloads, and an X-Idempotency-Key is bound to its
// route and body (the router passes both to the service).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "../http/test_client.h"
#include "serve_process.h"

namespace loom {
namespace {

using Json = nlohmann::json;

class Tenant {
 public:
  Tenant(uint16_t port, std::string key) : client_("127.0.0.1", port), key_(std::move(key)) {}
  // One retrieve_future (held for --poll-hold when pending).
  Json PollOnce(const testing::Reply& submitted) {
    auto r = Post("retrieve_future", {{"request_id", Json::parse(submitted.body)["request_id"]}});
    return Json::parse(r.body, nullptr, false);
  }
  // The model id a create_model future ended with.
  std::string ModelOf(const testing::Reply& submitted) {
    auto done = testing::RetrieveFuture(client_, key_, Json::parse(submitted.body)["request_id"], false, 200);
    return Json::parse(done.body, nullptr, false).value("model_id", "");
  }

  testing::Reply Post(const std::string& route, const Json& body, const std::string& idempotency_key = "") {
    std::vector<std::pair<std::string, std::string>> headers{{"X-API-Key", key_}};
    if (!idempotency_key.empty()) headers.emplace_back("X-Idempotency-Key", idempotency_key);
    return client_.Call("POST", "/api/v1/" + route, body.dump(), headers);
  }
  static Json SessionBody(const std::string& tag = "") {
    return {{"tags", tag.empty() ? Json::array() : Json::array({tag})}, {"user_metadata", Json::object()},
            {"sdk_version", "0.26.2"}, {"type", "create_session"}};
  }
  static Json ModelBody(const std::string& session, int seq) {
    return {{"session_id", session},
            {"model_seq_id", seq},
            {"base_model", "loom/tiny-qwen3"},
            {"lora_config", {{"rank", 4}, {"seed", 1}, {"train_unembed", true}, {"train_mlp", true}, {"train_attn", true}}},
            {"type", "create_model"}};
  }
  std::string Session() {
    auto r = Post("create_session", SessionBody());
    EXPECT_EQ(r.status, 200) << r.body;
    return Json::parse(r.body, nullptr, false).value("session_id", "");
  }
  testing::Reply CreateModel(const std::string& session, int seq) { return Post("create_model", ModelBody(session, seq)); }
  // Whether a submitted create_model's future ends with a model_id.
  bool Created(const testing::Reply& submitted) {
    if (submitted.status != 200) return false;
    auto done = testing::RetrieveFuture(client_, key_, Json::parse(submitted.body)["request_id"], false, 200);
    return Json::parse(done.body, nullptr, false).contains("model_id");
  }

 private:
  testing::HttpClient client_;
  std::string key_;
};

void ExpectJsonError(const testing::Reply& r, int status, const std::string& needle) {
  EXPECT_EQ(r.status, status) << r.body;
  Json j = Json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j.contains("error")) << r.body;
  EXPECT_NE(j["error"].get<std::string>().find(needle), std::string::npos) << r.body;
}

TEST(Quota, DefaultTenantQuotaIs429AndAFullServiceQueuesCreateModel) {
  const std::string data_dir =
      (std::filesystem::temp_directory_path() / ("loom_integration_quota_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(data_dir);
  std::filesystem::create_directories(data_dir);
  const std::string keys = data_dir + "/keys.txt";
  std::ofstream(keys) << "tml-a alice\ntml-b bob\ntml-c carol\ntml-d dave\n";
  // 3 slots: the default quota with --api-keys is max(1, 3/4) = 1.
  test::ServeProcess server(data_dir, {"--max-adapters", "3", "--max-rank", "8", "--api-keys", keys});
  ASSERT_NE(server.port(), 0) << server.banner();
  EXPECT_NE(server.banner().find("models_per_tenant=1"), std::string::npos) << server.banner();

  Tenant alice(server.port(), "tml-a");
  const std::string sa = alice.Session();
  ASSERT_TRUE(alice.Created(alice.CreateModel(sa, 0)));
  ExpectJsonError(alice.CreateModel(sa, 1), 429, "--max-models-per-tenant 1");

  Tenant bob(server.port(), "tml-b"), carol(server.port(), "tml-c"), dave(server.port(), "tml-d");
  ASSERT_TRUE(bob.Created(bob.CreateModel(bob.Session(), 0)));
  const std::string carols = carol.ModelOf(carol.CreateModel(carol.Session(), 0));
  ASSERT_FALSE(carols.empty());
  // All 3 slots are bound: dave's create_model waits, paused for capacity...
  const testing::Reply daves = dave.CreateModel(dave.Session(), 0);
  ASSERT_EQ(daves.status, 200) << daves.body;
  const Json pending = dave.PollOnce(daves);
  EXPECT_EQ(pending.value("type", ""), "try_again") << pending.dump();
  EXPECT_EQ(pending.value("queue_state", ""), "paused_capacity") << pending.dump();
  // ...until carol unloads hers.
  ASSERT_EQ(carol.Post("unload_model", {{"model_id", carols}, {"type", "unload_model"}}).status, 200);
  EXPECT_TRUE(dave.Created(daves));

  // Idempotency: the same key, route and body answer the first result...
  auto first = alice.Post("create_session", Tenant::SessionBody("x"), "key-1");
  auto again = alice.Post("create_session", Tenant::SessionBody("x"), "key-1");
  ASSERT_EQ(first.status, 200) << first.body;
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(Json::parse(first.body)["session_id"], Json::parse(again.body)["session_id"]);
  // ...another body or another route with it is a 400 naming the header.
  ExpectJsonError(alice.Post("create_session", Tenant::SessionBody("y"), "key-1"), 400, "X-Idempotency-Key");
  ExpectJsonError(alice.Post("create_model", Tenant::ModelBody(sa, 1), "key-1"), 400, "X-Idempotency-Key");
  // Another tenant's equal key is independent.
  auto theirs = bob.Post("create_session", Tenant::SessionBody("x"), "key-1");
  ASSERT_EQ(theirs.status, 200) << theirs.body;
  EXPECT_NE(Json::parse(theirs.body)["session_id"], Json::parse(first.body)["session_id"]);

  EXPECT_EQ(server.Terminate(), 0);
  std::filesystem::remove_all(data_dir);
}

// Without --max-adapters and --max-rank: rank 128 (a dense model) and the
// slots planned from memory (on the CPU, the host's RAM; at most 32).
TEST(Quota, DefaultsAreRank128AndSlotsPlannedFromMemory) {
  const std::string data_dir =
      (std::filesystem::temp_directory_path() / ("loom_integration_defaults_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(data_dir);
  test::ServeProcess server(data_dir, {});
  ASSERT_NE(server.port(), 0) << server.banner();
  EXPECT_NE(server.banner().find(" max_rank=128 "), std::string::npos) << server.banner();
  EXPECT_NE(server.banner().find(" slots=32 "), std::string::npos) << server.banner();  // the tiny model's slots are small
  EXPECT_NE(server.banner().find(" capacity_wait_s=600 "), std::string::npos) << server.banner();
  EXPECT_EQ(server.Terminate(), 0);
  std::filesystem::remove_all(data_dir);
}

}  // namespace
}  // namespace loom
