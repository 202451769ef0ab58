// Usage per tenant and capacity over HTTP (a Service over a FakeEngine and a
// FakeSampler behind a real server): two tenants train and sample known token
// counts; GET /api/v1/usage shows each exactly its own figures, the admin key
// every tenant's, and they add up to the server's totals; with --admin-key,
// /metrics is the admin's (401 without a key, 403 with a tenant's) and
// carries the loom_tenant_* series. A create_model waiting for a slot is
// answered try_again with queue_state paused_capacity.
#include <gtest/gtest.h>

#include "gateway_fixture.h"

namespace loom::http {
namespace {

using testing::kAlice;
using testing::kBob;
using testing::Reply;
constexpr const char* kAdmin = "admin-secret-key";

class UsageHttpTest : public testing::GatewayFixture {
 protected:
  Json Usage(const char* key) { return GetOk("/api/v1/usage", key); }
  // forward_backward calls of FbBody's one 3-token datum.
  // One asample of a 3-token prompt, n samples of m tokens each.
  void Sample(const char* key, int n, int m) {
    const std::string sampling =
        PostOk("create_sampling_session", {{"session_id", Session(key)}, {"sampling_session_seq_id", 0},
                                           {"base_model", "test/base"}, {"type", "create_sampling_session"}},
               key)["sampling_session_id"];
    Json sub = PostOk("asample", {{"sampling_session_id", sampling}, {"seq_id", 0}, {"num_samples", n},
                                  {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {4, 5, 6}}}}}}},
                                  {"sampling_params", {{"max_tokens", m}}}, {"prompt_logprobs", false},
                                  {"topk_prompt_logprobs", 0}, {"type", "sample"}},
                      key);
    Json done = Json::parse(Retrieve(sub["request_id"], key).body, nullptr, false);
    EXPECT_FALSE(done.contains("error")) << done.dump();
  }
  static const Json* Find(const Json& all, const std::string& tenant) {
    for (const Json& t : all["tenants"]) {
      if (t["tenant"] == tenant) return &t;
    }
    return nullptr;
  }
  // The value of one sample line of a Prometheus text, or -1.
  static double Series(const std::string& text, const std::string& name_and_labels) {
    const std::string prefix = "\n" + name_and_labels + " ";
    const size_t at = text.find(prefix);
    return at == std::string::npos ? -1 : std::stod(text.substr(at + prefix.size()));
  }
};

TEST_F(UsageHttpTest, EachTenantSeesItsOwnUsageTheAdminAllAndTheyAddUp) {
  router_opt_.admin_key = kAdmin;
  StartGateway("loom_http_usage_", /*with_sampler=*/true);
  const std::string a = CreateModel(kAlice);
  const std::string b = CreateModel(kBob);
  Train(a, 2, kAlice);  // 2 x 3 tokens
  Train(b, 3, kBob);    // 3 x 3 tokens
  Sample(kAlice, 2, 4);  // 8 tokens generated, 3 prompt tokens
  Json save = PostOk("save_weights", {{"model_id", a}, {"path", "s1"}, {"seq_id", 3}, {"overwrite", false},
                                      {"type", "save_weights"}});
  ASSERT_FALSE(Json::parse(Retrieve(save["request_id"]).body).contains("error"));

  const Json alice = Usage(kAlice);
  const Json bob = Usage(kBob);
  EXPECT_EQ(alice["tokens_trained"], 6) << alice.dump();
  EXPECT_EQ(bob["tokens_trained"], 9) << bob.dump();
  EXPECT_EQ(alice["tokens_sampled"], 8);
  EXPECT_EQ(alice["prompt_tokens"], 3);
  EXPECT_EQ(bob["tokens_sampled"], 0);
  // Passes run one at a time here: create, each forward_backward, the save.
  EXPECT_EQ(alice["passes"], 1 + 2 + 1);
  EXPECT_EQ(bob["passes"], 1 + 3);
  EXPECT_EQ(alice["live_models"], 1);
  EXPECT_GT(alice["slot_seconds"].get<double>(), 0.0);
  // Stored bytes are the registry's sizes of her checkpoints; bob has none.
  Reply listed = Get("/api/v1/checkpoints", kAlice);
  const Json checkpoints = Json::parse(listed.body)["checkpoints"];
  ASSERT_EQ(checkpoints.size(), 1u) << listed.body;
  EXPECT_EQ(alice["checkpoints"], 1);
  EXPECT_EQ(alice["bytes_stored"], checkpoints[0]["size_bytes"]);
  EXPECT_GT(alice["bytes_stored"].get<int64_t>(), 0);
  EXPECT_EQ(bob["bytes_stored"], 0);
  EXPECT_NE(alice["tenant"], bob["tenant"]);

  // The admin key: every tenant, the same figures, adding up to the server's totals.
  const Json all = Usage(kAdmin);
  ASSERT_EQ(all["tenants"].size(), 2u) << all.dump();
  const Json* admin_alice = Find(all, alice["tenant"]);
  const Json* admin_bob = Find(all, bob["tenant"]);
  ASSERT_TRUE(admin_alice && admin_bob) << all.dump();
  for (const char* field : {"tokens_trained", "tokens_sampled", "passes", "bytes_stored", "checkpoints"}) {
    EXPECT_EQ((*admin_alice)[field], alice[field]) << field;
    EXPECT_EQ((*admin_bob)[field], bob[field]) << field;
  }
  Reply metrics = Get("/metrics", kAdmin);
  ASSERT_EQ(metrics.status, 200) << metrics.body;
  EXPECT_EQ(Series(metrics.body, "loom_training_tokens_total"), 6 + 9) << metrics.body;
  EXPECT_EQ(Series(metrics.body, "loom_sampling_tokens_total"), 8);
  const std::string alice_label = "{tenant=\"" + alice["tenant"].get<std::string>() + "\"}";
  const std::string bob_label = "{tenant=\"" + bob["tenant"].get<std::string>() + "\"}";
  EXPECT_EQ(Series(metrics.body, "loom_tenant_tokens_trained_total" + alice_label), 6) << metrics.body;
  EXPECT_EQ(Series(metrics.body, "loom_tenant_tokens_trained_total" + bob_label), 9);
  EXPECT_EQ(Series(metrics.body, "loom_tenant_tokens_sampled_total" + alice_label), 8);
  EXPECT_EQ(Series(metrics.body, "loom_tenant_bytes_stored" + alice_label), alice["bytes_stored"].get<double>());
  EXPECT_NE(metrics.body.find("model_id=\"" + a + "\""), std::string::npos);  // and every model's series
}

TEST_F(UsageHttpTest, WithAnAdminKeyMetricsAreTheAdminsOnly) {
  router_opt_.admin_key = kAdmin;
  StartGateway("loom_http_usage_", /*with_sampler=*/false);
  CreateModel(kAlice);
  EXPECT_EQ(Get("/metrics", nullptr).status, 401);
  Reply tenant = Get("/metrics", kAlice);
  ExpectJsonError(tenant, 403, "/api/v1/usage");
  EXPECT_EQ(Get("/metrics", "admin-secret-kez").status, 401);  // neither admin nor a tenant's key
  EXPECT_EQ(Get("/metrics", kAdmin).status, 200);
  // A tenant's usage route answers its own figures only, never the list.
  const Json mine = Usage(kAlice);
  EXPECT_FALSE(mine.contains("tenants")) << mine.dump();
  EXPECT_EQ(mine["live_models"], 1);
  EXPECT_EQ(Get("/api/v1/usage", nullptr).status, 401);
}

TEST_F(UsageHttpTest, WithoutAnAdminKeyMetricsCarryNoTenantUsage) {
  StartGateway("loom_http_usage_", /*with_sampler=*/false);
  CreateModel(kAlice);
  for (const char* key : {static_cast<const char*>(nullptr), kAlice}) {
    Reply r = Get("/metrics", key);
    ASSERT_EQ(r.status, 200);
    EXPECT_EQ(r.body.find("loom_tenant_"), std::string::npos) << r.body;
  }
}

TEST_F(UsageHttpTest, ACreateModelWaitingForASlotIsAnsweredPausedCapacity) {
  make_engine_ = [] { return std::make_unique<testing::FakeEngine>(1); };
  StartGateway("loom_http_usage_", /*with_sampler=*/false);
  const std::string a = CreateModel(kAlice);
  Json sub = PostOk("create_model", {{"session_id", Session(kBob)}, {"model_seq_id", 0}, {"base_model", "test/base"},
                                     {"lora_config", {{"rank", 4}}}, {"type", "create_model"}},
                    kBob);
  // One poll: held for the poll hold, then try_again with the queue state.
  Reply poll = client_->Call("POST", "/api/v1/retrieve_future",
                             Json{{"request_id", sub["request_id"]}, {"allow_metadata_only", true}}.dump(),
                             {{"X-API-Key", kBob}});
  ASSERT_EQ(poll.status, 200) << poll.body;
  const Json pending = Json::parse(poll.body);
  EXPECT_EQ(pending["type"], "try_again");
  EXPECT_EQ(pending["queue_state"], "paused_capacity") << poll.body;
  EXPECT_NE(pending["queue_state_reason"].get<std::string>().find("--max-adapters"), std::string::npos);
  EXPECT_EQ(Usage(kBob)["waiting_models"], 1);
  PostOk("unload_model", {{"model_id", a}, {"type", "unload_model"}});
  const Json done = Json::parse(Retrieve(sub["request_id"], kBob).body);
  EXPECT_EQ(done["type"], "create_model") << done.dump();
  EXPECT_EQ(Usage(kBob)["live_models"], 1);
  EXPECT_EQ(Usage(kBob)["waiting_models"], 0);
}

}  // namespace
}  // namespace loom::http
