// The Planner inside the service: a request above --token-budget is split
// over passes and answered once with its datums joined in order; same-key
// requests of many models pack up to the budget; a light tenant is not
// starved by a backlog; optim_steps merge; exclusive ops run alone; and
// /metrics reports what happened.
#include <gtest/gtest.h>

#include <functional>
#include <regex>

#include "sched_fixture.h"

namespace loom::testing {
namespace {

using service::FutureState;

class SchedulerTest : public SchedFixture {
 protected:
  // Six tenants submit one forward_backward each, `gap` apart (as HTTP
  // clients sending "at once" do); returns the engine's pass sizes.
  std::vector<size_t> SixTenantsSpaced(std::chrono::milliseconds window, std::chrono::milliseconds gap) {
    Open(/*token_budget=*/1000, /*slots=*/8, window);
    const char* tenants[] = {"a", "b", "c", "d", "e", "f"};
    std::vector<std::string> models, ids;
    for (const char* t : tenants) models.push_back(NewModel(t));
    for (int i = 0; i < 6; ++i) {
      ids.push_back(Submit(tenants[i], Fb(models[i], 1, 1 + i, {4})));
      std::this_thread::sleep_for(gap);
    }
    for (int i = 0; i < 6; ++i) EXPECT_EQ(Wait(tenants[i], ids[i]).state, FutureState::kDone);
    return engine_->batch_sizes();
  }
  // Tenant w's first pass holds the engine while tenants a-d submit a
  // forward_backward of 6 tokens each, and then `also` submits what else w
  // sends (returning the ids); returns the engine's pass sizes once all are done.
  std::vector<size_t> FourBehindAPass(const std::function<std::vector<std::string>(const std::string&)>& also = {}) {
    const std::string w = NewModel("w");
    std::vector<std::string> models;
    for (const char* t : {"a", "b", "c", "d"}) models.push_back(NewModel(t));
    engine_->Hold();
    const std::string warm = Submit("w", Fb(w, 1, 1, {3}));
    engine_->WaitInForward();
    std::vector<std::string> ids;
    const char* tenants[] = {"a", "b", "c", "d"};
    for (int i = 0; i < 4; ++i) ids.push_back(Submit(tenants[i], Fb(models[i], 1, 2 + i, {6})));
    std::vector<std::string> more = also ? also(w) : std::vector<std::string>{};
    engine_->Release();
    for (int i = 0; i < 4; ++i) EXPECT_EQ(Wait(tenants[i], ids[i]).state, FutureState::kDone);
    EXPECT_EQ(Wait("w", warm).state, FutureState::kDone);
    for (const std::string& id : more) EXPECT_EQ(Wait("w", id).state, FutureState::kDone);
    return engine_->batch_sizes();
  }
};

TEST_F(SchedulerTest, RequestAboveTheBudgetIsSplitAndAnsweredOnceInDatumOrder) {
  Open(/*token_budget=*/8);
  const std::string m = NewModel("a");
  // 1+2+3+4+5 = 15 tokens against a budget of 8.
  const std::string id = Submit("a", Fb(m, 1, 7, {1, 2, 3, 4, 5}));
  auto v = Wait("a", id);
  ASSERT_EQ(v.state, FutureState::kDone) << v.error.message();
  ASSERT_TRUE(v.result && std::holds_alternative<tinker::ForwardBackwardOutput>(*v.result));
  const auto& out = std::get<tinker::ForwardBackwardOutput>(*v.result);
  ASSERT_EQ(out.outputs.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(out.outputs[i].at("logprobs").numel(), static_cast<int64_t>(i + 1)) << i;
  // The fake's loss:sum is the datum count of each call: the pieces' sums add up.
  EXPECT_DOUBLE_EQ(out.metrics.at("loss:sum"), 5.0);
  // Several engine passes, none over the budget, covering all 5 datums once.
  auto passes = engine_->pass_datums();
  ASSERT_GE(passes.size(), 2u);
  size_t datums = 0;
  for (const auto& p : passes) {
    ASSERT_EQ(p.size(), 1u);
    datums += p[0];
  }
  EXPECT_EQ(datums, 5u);
  // The gradient accumulated as one: the next optim_step sees all 5 datums.
  auto o = Wait("a", Optim("a", m, 2));
  ASSERT_EQ(o.state, FutureState::kDone);
  EXPECT_EQ(engine_->stepped(0), (std::vector<size_t>{5}));
}

TEST_F(SchedulerTest, SameKeyPacksAcrossModelsUpToTheBudget) {
  Open(/*token_budget=*/12);
  // A different loss does not join them.
  auto sizes = FourBehindAPass([&](const std::string& w) {
    return std::vector<std::string>{Submit("w", Fb(w, 2, 9, {2}, "importance_sampling"))};
  });
  // warm alone; then 6+6 = 12 tokens per pass; importance_sampling alone.
  ASSERT_EQ(sizes.size(), 4u);
  EXPECT_EQ(sizes[0], 1u);
  std::multiset<size_t> rest(sizes.begin() + 1, sizes.end());
  EXPECT_EQ(rest, (std::multiset<size_t>{2, 2, 1}));
}

// The room the device has free when a pass is planned (Engine::MaxPassTokens,
// smaller than at start-up while snapshots and the sampler hold memory) caps
// the pass below the budget: the requests that do not fit wait for the next
// pass instead of failing this one whole.
TEST_F(SchedulerTest, APassIsPlannedToTheRoomFreeNowBelowTheBudget) {
  Open(/*token_budget=*/1000);
  engine_->max_pass_tokens = 12;  // before any request: the train loop reads it when it plans
  // warm alone; then 12 tokens a pass (the budget of 1000 would take all 24 at once).
  EXPECT_EQ(FourBehindAPass(), (std::vector<size_t>{1, 2, 2}));
}

// The train loop sizes a pass to the room with every layer kept
// (Engine::KeptPassTokens) under PassSizing::kKept, above its floor, and to
// the most that fits with every layer recomputed under kMost (the default).
TEST_F(SchedulerTest, APassIsSizedToTheRoomWithEveryLayerKept) {
  service::ServiceOptions options;
  options.token_budget = 1000;
  options.pass_sizing = service::ServiceOptions::PassSizing::kKept;
  options.min_kept_pass_tokens = 1;
  OpenWith(options, 8);
  engine_->max_pass_tokens = 1000;
  engine_->kept_pass_tokens = 12;
  // warm alone; then 12 tokens a pass, the room with every layer kept.
  EXPECT_EQ(FourBehindAPass(), (std::vector<size_t>{1, 2, 2}));
}

// /metrics carries the engine's count of sized passes, the layers they
// recomputed and the rows they trained, for an operator to see what the
// memory plan costs and what shared prefixes save.
TEST_F(SchedulerTest, MetricsCountThePassesAndTheLayersTheyRecomputed) {
  Open(/*token_budget=*/1000);
  engine_->recompute_stats = {7, 150, 9000};
  const std::string text = service_->MetricsText();
  EXPECT_NE(text.find("\nloom_train_planned_passes_total 7\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nloom_train_recomputed_layers_total 150\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nloom_train_rows_total 9000\n"), std::string::npos) << text;
}

TEST_F(SchedulerTest, APassIsSizedToTheMostThatFitsUnderPassSizingMost) {
  service::ServiceOptions options;
  options.token_budget = 1000;
  OpenWith(options, 8);
  engine_->max_pass_tokens = 1000;
  engine_->kept_pass_tokens = 12;
  EXPECT_EQ(FourBehindAPass(), (std::vector<size_t>{1, 4}));
}

// With the batch window they land in one pass; without it the engine starts
// on the first arrival.
TEST_F(SchedulerTest, BatchWindowGathersRequestsSentTogether) {
  using std::chrono::milliseconds;
  EXPECT_EQ(SixTenantsSpaced(milliseconds(200), milliseconds(2)), (std::vector<size_t>{6}));
}

TEST_F(SchedulerTest, WithoutBatchWindowTheFirstArrivalRunsAlone) {
  using std::chrono::milliseconds;
  EXPECT_GT(SixTenantsSpaced(milliseconds(0), milliseconds(30)).size(), 1u);
}

TEST_F(SchedulerTest, LightTenantIsNotStarvedByABacklog) {
  Open(/*token_budget=*/16);
  const std::string heavy = NewModel("heavy");
  const std::string light = NewModel("light");
  engine_->Hold();
  std::vector<std::string> heavy_ids;
  heavy_ids.push_back(Submit("heavy", Fb(heavy, 1, 1, {8, 8})));
  engine_->WaitInForward();
  for (int s = 2; s <= 20; ++s) heavy_ids.push_back(Submit("heavy", Fb(heavy, s, 1, {8, 8})));
  const std::string light_id = Submit("light", Fb(light, 1, 2, {4}));
  engine_->Release();
  EXPECT_EQ(Wait("light", light_id).state, FutureState::kDone);
  for (const auto& id : heavy_ids) EXPECT_EQ(Wait("heavy", id).state, FutureState::kDone);
  // light's call (tag 2) ran within the first 3 passes, not after 20 of heavy's.
  auto log = engine_->log();
  int pass_of_light = -1, fb_calls = 0;
  for (const auto& e : log) {
    if (e.rfind("fb:", 0) != 0) continue;
    ++fb_calls;
    if (e.ends_with(":2")) pass_of_light = fb_calls;
  }
  ASSERT_GT(pass_of_light, 0);
  EXPECT_LE(pass_of_light, 4) << "light ran as call " << pass_of_light << " of " << fb_calls;
}

TEST_F(SchedulerTest, OptimStepsMergeAndExclusiveOpsRunAlone) {
  Open(/*token_budget=*/64);
  const std::string a = NewModel("a");
  const std::string b = NewModel("b");
  const std::string c = NewModel("c");
  engine_->Hold();
  const std::string warm = Submit("c", Fb(c, 1, 1, {3}));
  engine_->WaitInForward();
  const std::string fa = Submit("a", Fb(a, 1, 2, {3}));
  tinker::SaveWeightsRequest save;
  save.model_id = b;
  save.seq_id = 1;
  save.name = "ckpt";
  auto sb = service_->SaveWeights({"b", ""}, save);
  ASSERT_TRUE(sb.ok()) << sb.status().message();
  const std::string oa = Optim("a", a, 2);
  const std::string ob = Optim("b", b, 2);
  const std::string oc = Optim("c", c, 2);
  engine_->Release();
  for (auto [t, id] : std::vector<std::pair<std::string, std::string>>{
           {"a", fa}, {"a", oa}, {"b", sb->request_id}, {"b", ob}, {"c", oc}}) {
    auto v = Wait(t, id);
    EXPECT_EQ(v.state, FutureState::kDone) << v.error.message();
  }
  // c's optim_step was ready right after the warm pass, but a's and b's only
  // after their fwd/bwd and save: at least the last optim pass merges two.
  auto optim = engine_->optim_batch_sizes();
  size_t total = 0, widest = 0;
  for (size_t n : optim) {
    total += n;
    widest = std::max(widest, n);
  }
  EXPECT_EQ(total, 3u);
  EXPECT_GE(widest, 2u);
  EXPECT_LT(optim.size(), 3u);
  // The save ran in a pass of its own: 3 create_models + 1 save = 4 exclusive passes.
  auto log = engine_->log();
  EXPECT_EQ(std::count(log.begin(), log.end(), "save:1"), 1);
  EXPECT_NE(service_->MetricsText().find("\nloom_passes_total{kind=\"exclusive\"} 4\n"), std::string::npos)
      << service_->MetricsText();
}

TEST_F(SchedulerTest, MetricsReportPassesWaitsFillAndSlots) {
  Open(/*token_budget=*/10);
  const std::string a = NewModel("a");
  const std::string b = NewModel("b");
  EXPECT_EQ(Wait("a", Submit("a", Fb(a, 1, 1, {5}))).state, FutureState::kDone);
  EXPECT_EQ(Wait("b", Submit("b", Fb(b, 1, 2, {4, 4}))).state, FutureState::kDone);
  service_->metrics().CountResponse(200);
  service_->metrics().CountResponse(200);
  service_->metrics().CountResponse(404);
  service_->metrics().AddSamplingTokens(30);
  const std::string text = service_->MetricsText();
  auto value = [&](const std::string& series) -> double {
    std::smatch m;
    std::regex re("\n" + std::regex_replace(series, std::regex(R"([{}"\\])"), R"(\$&)") + " ([0-9.eE+-]+)\n");
    if (!std::regex_search(text, m, re)) {
      ADD_FAILURE() << series << " missing in\n" << text;
      return -1;
    }
    return std::stod(m[1]);
  };
  EXPECT_EQ(value("loom_passes_total{kind=\"forward_backward\"}"), 2);
  EXPECT_EQ(value("loom_passes_total{kind=\"exclusive\"}"), 2);  // two create_models
  EXPECT_EQ(value("loom_training_tokens_total"), 13);
  EXPECT_NEAR(value("loom_batch_fill_ratio"), 0.8, 1e-9);        // b's 8 tokens / 10
  EXPECT_NEAR(value("loom_batch_fill_ratio_mean"), 0.65, 1e-9);  // (0.5 + 0.8) / 2
  EXPECT_EQ(value("loom_queue_wait_seconds_count{model_id=\"" + a + "\"}"), 2);  // create + fwd/bwd
  EXPECT_EQ(value("loom_slots_in_use"), 2);
  EXPECT_EQ(value("loom_slots_total"), 8);
  EXPECT_EQ(value("loom_token_budget"), 10);
  EXPECT_EQ(value("loom_http_responses_total{code=\"200\"}"), 2);
  EXPECT_EQ(value("loom_http_responses_total{code=\"404\"}"), 1);
  EXPECT_EQ(value("loom_sampling_tokens_total"), 30);
  EXPECT_GT(value("loom_training_tokens_per_second"), 0);
  EXPECT_NE(text.find("# TYPE loom_queue_depth gauge"), std::string::npos);
}

}  // namespace
}  // namespace loom::testing
