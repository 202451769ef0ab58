// The dashboard over HTTP (a Service over a FakeEngine behind a real
// server): GET /dashboard is the static page, served without a key and
// holding no data; GET /api/v1/dashboard answers each tenant only its own
// models and one loss point per forward_backward (forward-only calls add
// none), a missing or unknown key 401, and the admin key the operator's view (every
// tenant, slots, pass fill); a tenant's key never gets the admin view, and an
// unloaded model's history is gone.
#include <gtest/gtest.h>

#include "gateway_fixture.h"

namespace loom::http {
namespace {

using testing::kAlice;
using testing::kBob;
using testing::Reply;
constexpr const char* kAdmin = "admin-secret-key";

class DashboardHttpTest : public testing::GatewayFixture {
 protected:
  Json Dashboard(const char* key) { return GetOk("/api/v1/dashboard", key); }
  // With the admin key set: alice's and bob's models, trained `a` and `b` times.
  std::pair<std::string, std::string> TwoTenantsTrained(int a, int b) {
    router_opt_.admin_key = kAdmin;
    StartGateway("loom_http_dash_", /*with_sampler=*/false);
    std::pair<std::string, std::string> models{CreateModel(kAlice), CreateModel(kBob)};
    Train(models.first, a, kAlice);
    Train(models.second, b, kBob);
    return models;
  }
};

TEST_F(DashboardHttpTest, ThePageIsStaticAndNeedsNoKey) {
  StartGateway("loom_http_dash_", /*with_sampler=*/false);
  Reply page = Get("/dashboard", nullptr);
  ASSERT_EQ(page.status, 200);
  EXPECT_NE(page.content_type.find("text/html"), std::string::npos);
  EXPECT_NE(page.body.find("polyline"), std::string::npos);  // the loss curve is drawn by the page itself
  EXPECT_NE(page.body.find("/api/v1/dashboard"), std::string::npos);
  // Nothing loaded from elsewhere: no script or style file, no stylesheet link.
  EXPECT_EQ(page.body.find("<script src"), std::string::npos);
  EXPECT_EQ(page.body.find("<link"), std::string::npos);
  EXPECT_EQ(page.body.find("https://"), std::string::npos);
  EXPECT_EQ(client_->Call("POST", "/dashboard", "", {}).status, 405);
}

TEST_F(DashboardHttpTest, EachTenantSeesOnlyItsOwnModelsAndLosses) {
  const auto [a, b] = TwoTenantsTrained(3, 1);

  const Json alice = Dashboard(kAlice);
  EXPECT_EQ(alice["view"], "tenant");
  ASSERT_EQ(alice["models"].size(), 1u) << alice.dump();
  const Json& m = alice["models"][0];
  EXPECT_EQ(m["model_id"], a);
  EXPECT_EQ(m["base_model"], "test/base");
  EXPECT_EQ(m["rank"], 4);
  EXPECT_EQ(m["queue_state"], "active");
  ASSERT_EQ(m["passes"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const Json& p = m["passes"][i];
    EXPECT_EQ(p["index"], i + 1);
    EXPECT_EQ(p["loss_sum"], 1.0);  // the FakeEngine: one per datum
    EXPECT_EQ(p["tokens"], 3);      // FbBody's one 3-token datum
    EXPECT_DOUBLE_EQ(p["loss_mean"].get<double>(), 1.0 / 3.0);
  }
  EXPECT_EQ(alice.dump().find(b), std::string::npos) << "bob's model leaks into alice's view";
  const Json bob = Dashboard(kBob);
  ASSERT_EQ(bob["models"].size(), 1u);
  EXPECT_EQ(bob["models"][0]["passes"].size(), 1u);
  EXPECT_EQ(bob.dump().find(a), std::string::npos);

  EXPECT_EQ(Get("/api/v1/dashboard", nullptr).status, 401);
  EXPECT_EQ(Get("/api/v1/dashboard", "admin-secret-kez").status, 401);  // neither admin nor a tenant's key
}

TEST_F(DashboardHttpTest, TheAdminKeySeesEveryTenantSlotsAndFill) {
  const auto [a, b] = TwoTenantsTrained(2, 1);
  const Json admin = Dashboard(kAdmin);
  EXPECT_EQ(admin["view"], "admin");
  EXPECT_EQ(admin["tenants"].size(), 2u) << admin.dump();
  EXPECT_EQ(admin["slots"]["in_use"], 2);
  EXPECT_GE(admin["slots"]["total"].get<int>(), 2);
  EXPECT_EQ(admin["pass_fill"]["passes"], 3);  // one pass per forward_backward here
  EXPECT_EQ(admin["pass_fill"]["last_tokens"], 3);
  EXPECT_GT(admin["pass_fill"]["token_budget"].get<int64_t>(), 0);
  EXPECT_TRUE(admin["queued_by_model"].contains(a));
  EXPECT_TRUE(admin["queued_by_model"].contains(b));
  EXPECT_EQ(admin["sampler"]["attached"], false);
  // A tenant's key never gets the operator's view.
  EXPECT_EQ(Dashboard(kAlice)["view"], "tenant");
  EXPECT_FALSE(Dashboard(kAlice).contains("tenants"));
}

TEST_F(DashboardHttpTest, ForwardOnlyAddsNoPointAndUnloadForgetsTheHistory) {
  StartGateway("loom_http_dash_", /*with_sampler=*/false);
  const std::string a = CreateModel(kAlice);
  Train(a, 1, kAlice);
  tinker::ForwardBackwardRequest fwd;
  fwd.model_id = a;
  fwd.seq_id = 2;
  fwd.call.forward_only = true;
  engine::Datum d;
  d.tokens = {1, 2, 3};
  d.loss_fn_inputs["target_tokens"] = engine::Array::Ints({2, 3, 4});
  fwd.call.data.push_back(d);
  Reply sub = PostFb(wire::EncodeForwardBackwardRequest(fwd), kAlice);
  ASSERT_EQ(sub.status, 200) << sub.body;
  Retrieve(Json::parse(sub.body)["request_id"], kAlice);
  EXPECT_EQ(Dashboard(kAlice)["models"][0]["passes"].size(), 1u);
  PostOk("unload_model", {{"model_id", a}, {"type", "unload_model"}});
  EXPECT_EQ(Dashboard(kAlice)["models"].size(), 0u);
  EXPECT_TRUE(service_->metrics().pass_history().Of(Dashboard(kAlice)["tenant"]).empty());
}

}  // namespace
}  // namespace loom::http
