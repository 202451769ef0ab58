// Service semantics over a FakeEngine: seq_id ordering with out-of-order
// chunks, dedup, gap timeout, tenant isolation, lease expiry, packing,
// checkpoint name collisions, and a restart on the same data dir.
#include "service/service.h"
#include "wire/future_result.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <thread>

#include "fake_engine.h"
#include "wire_json.h"

namespace loom::service {
namespace {

using namespace std::chrono_literals;
using testing::FakeEngine;

std::string TempDir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("loom_service_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

class ServiceTest : public ::testing::Test {
 protected:
  static tinker::SaveWeightsRequest SaveRequest(const std::string& model, int64_t seq, const std::string& name) {
    tinker::SaveWeightsRequest r;
    r.model_id = model;
    r.seq_id = seq;
    r.name = name;
    return r;
  }
  void Open(ServiceOptions options = {}, int slots = 4) {
    options.base_model_name = "test/base";
    if (options.janitor_period == ServiceOptions{}.janitor_period) options.janitor_period = 20ms;
    auto engine = std::make_unique<FakeEngine>(slots);
    engine_ = engine.get();
    auto registry = store::Registry::Open(dir_);
    ASSERT_TRUE(registry.ok()) << registry.status().message();
    service_ = std::make_unique<Service>(options, std::move(engine), std::move(*registry));
    service_->Start();
  }
  void TearDown() override { service_.reset(); }

  // Waits until the future is finished; returns it.
  FutureView Wait(const std::string& tenant, const std::string& id, std::chrono::milliseconds limit = 5s) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      auto v = service_->futures().Get(tenant, id);
      EXPECT_TRUE(v.ok()) << v.status().message();
      if (!v.ok()) return {};
      if (v->state != FutureState::kPending) return *v;
      std::this_thread::sleep_for(2ms);
    }
    ADD_FAILURE() << "future " << id << " still pending";
    return {};
  }

  std::string NewSession(const std::string& tenant) {
    auto s = service_->CreateSession({tenant, ""}, {});
    EXPECT_TRUE(s.ok());
    return *s;
  }

  std::string NewModel(const std::string& tenant, const std::string& session, int64_t seq = 0, int rank = 4) {
    tinker::CreateModelRequest req;
    req.session_id = session;
    req.model_seq_id = seq;
    req.base_model = "test/base";
    req.lora.rank = rank;
    auto sub = service_->CreateModel({tenant, ""}, req);
    EXPECT_TRUE(sub.ok()) << sub.status().message();
    auto done = Wait(tenant, sub->request_id);
    EXPECT_EQ(done.state, FutureState::kDone) << done.error.message();
    return sub->model_id;
  }

  static tinker::CreateModelRequest CreateRequest(const std::string& session, int64_t seq) {
    tinker::CreateModelRequest req;
    req.session_id = session;
    req.model_seq_id = seq;
    req.base_model = "test/base";
    req.lora.rank = 4;
    return req;
  }

  static tinker::ForwardBackwardRequest Fb(const std::string& model, int32_t seq, int32_t tag,
                                         const std::string& loss = "cross_entropy") {
    return testing::TaggedForwardBackward(model, seq, tag, loss);
  }

  std::vector<std::string> FbLog() const {
    std::vector<std::string> out;
    for (const auto& e : engine_->log()) {
      if (e.rfind("fb:", 0) == 0) out.push_back(e);
    }
    return out;
  }

  std::string dir_ = TempDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
  FakeEngine* engine_ = nullptr;
  std::unique_ptr<Service> service_;
};

TEST_F(ServiceTest, ModelIdFollowsTinkerConventionAndBindsASlot) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s, 3, 8);
  EXPECT_EQ(m, s + ":train:3");
  EXPECT_EQ(service_->slots_in_use(), 1);
  auto log = engine_->log();
  EXPECT_NE(std::find(log.begin(), log.end(), "bind:0:r8"), log.end());
}

TEST_F(ServiceTest, ChunksArrivingOutOfOrderRunInSeqIdOrder) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  // The SDK sends the first chunk last.
  std::vector<std::string> ids;
  for (int seq : {3, 4, 2, 1}) {
    auto sub = service_->ForwardBackward({"alice", ""}, Fb(m, seq, seq * 10));
    ASSERT_TRUE(sub.ok()) << sub.status().message();
    ids.push_back(sub->request_id);
  }
  for (const auto& id : ids) EXPECT_EQ(Wait("alice", id).state, FutureState::kDone);
  EXPECT_EQ(FbLog(), (std::vector<std::string>{"fb:0:10", "fb:0:20", "fb:0:30", "fb:0:40"}));
}

TEST_F(ServiceTest, RepeatedSeqIdOrIdempotencyKeyReturnsTheOriginalFuture) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  auto a = service_->ForwardBackward({"alice", "k1"}, Fb(m, 1, 5));
  ASSERT_TRUE(a.ok());
  Wait("alice", a->request_id);
  // A retry after completion, with a new idempotency key (execute_with_retries).
  auto b = service_->ForwardBackward({"alice", "k2"}, Fb(m, 1, 5));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->request_id, b->request_id);
  // The same idempotency key on another endpoint is not that call's retry.
  tinker::OptimStepRequest o;
  o.model_id = m;
  o.seq_id = 2;
  auto c = service_->OptimStep({"alice", "k1"}, o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
  EXPECT_NE(c.status().message().find("X-Idempotency-Key"), std::string::npos) << c.status().message();
  EXPECT_EQ(FbLog().size(), 1u);  // ran once
}

TEST_F(ServiceTest, SeqIdGapFailsWaitingRequestsAfterTimeout) {
  ServiceOptions o;
  o.seq_gap_timeout = 150ms;
  Open(o);
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  auto late = service_->ForwardBackward({"alice", ""}, Fb(m, 2, 7));
  ASSERT_TRUE(late.ok());
  auto t0 = std::chrono::steady_clock::now();
  FutureView v = Wait("alice", late->request_id);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 140ms);
  ASSERT_EQ(v.state, FutureState::kFailed);
  EXPECT_NE(v.error.message().find("seq_id 1"), std::string::npos) << v.error.message();
  EXPECT_NE(v.error.message().find("never arrived"), std::string::npos);
  EXPECT_TRUE(FbLog().empty());
  // The model continues after the skipped ids; the missing one is now stale.
  auto next = service_->ForwardBackward({"alice", ""}, Fb(m, 3, 8));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(Wait("alice", next->request_id).state, FutureState::kDone);
  auto stale = service_->ForwardBackward({"alice", ""}, Fb(m, 1, 9));
  EXPECT_EQ(stale.status().code(), Code::kInvalidArgument);
}

TEST_F(ServiceTest, OtherTenantsSeeNotFoundForEverything) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  tinker::SaveWeightsRequest save = SaveRequest(m, 1, "c1");
  auto saved = service_->SaveWeights({"alice", ""}, save);
  ASSERT_TRUE(saved.ok());
  ASSERT_EQ(Wait("alice", saved->request_id).state, FutureState::kDone);

  Caller bob{"bob", ""};
  EXPECT_EQ(service_->futures().Get("bob", saved->request_id).status().code(), Code::kNotFound);
  EXPECT_EQ(service_->GetInfo(bob, m).status().code(), Code::kNotFound);
  EXPECT_EQ(service_->ForwardBackward(bob, Fb(m, 2, 1)).status().code(), Code::kNotFound);
  EXPECT_EQ(service_->Heartbeat(bob, s).code(), Code::kNotFound);
  EXPECT_EQ(service_->checkpoints().GetTrainingRun(bob, m).status().code(), Code::kNotFound);
  EXPECT_EQ(service_->checkpoints().ListRunCheckpoints(bob, m).status().code(), Code::kNotFound);
  EXPECT_EQ(service_->checkpoints().DeleteCheckpoint(bob, m, "weights/c1").code(), Code::kNotFound);
  EXPECT_EQ(service_->GetSession(bob, s).status().code(), Code::kNotFound);
  auto path = tinker::ParseTinkerPath("tinker://" + m + "/weights/c1");
  ASSERT_TRUE(path.ok());
  EXPECT_EQ(service_->checkpoints().WeightsInfo(bob, *path).status().code(), Code::kNotFound);
  // The unknown and the foreign answer alike (no existence leak).
  std::string foreign = service_->GetInfo(bob, m).status().message();
  std::string unknown = service_->GetInfo(bob, "nobody:train:0").status().message();
  unknown.replace(unknown.find("nobody:train:0"), 14, m);
  EXPECT_EQ(foreign, unknown);
  // Bob's lists are empty; alice's are not.
  auto runs = testing::AsJson(service_->checkpoints().ListTrainingRuns(bob, {}), wire::TrainingRunsJson);
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ((*runs)["training_runs"].size(), 0u);
  auto mine = testing::AsJson(service_->checkpoints().ListTrainingRuns({"alice", ""}, {}), wire::TrainingRunsJson);
  ASSERT_TRUE(mine.ok());
  EXPECT_EQ((*mine)["training_runs"].size(), 1u);
}

TEST_F(ServiceTest, LeaseExpiryReleasesTheSlotAndLaterCallsSayExpired) {
  ServiceOptions o;
  o.session_ttl = 200ms;
  Open(o, /*slots=*/1);
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  EXPECT_EQ(service_->slots_in_use(), 1);
  // Heartbeats keep it alive past the ttl.
  for (int i = 0; i < 4; ++i) {
    std::this_thread::sleep_for(100ms);
    ASSERT_TRUE(service_->Heartbeat({"alice", ""}, s).ok());
  }
  EXPECT_EQ(service_->slots_in_use(), 1);
  // Then silence.
  const auto deadline = std::chrono::steady_clock::now() + 3s;
  while (service_->slots_in_use() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(service_->slots_in_use(), 0);
  auto log = engine_->log();
  EXPECT_NE(std::find(log.begin(), log.end(), "release:0"), log.end());
  auto fb = service_->ForwardBackward({"alice", ""}, Fb(m, 1, 1));
  ASSERT_FALSE(fb.ok());
  EXPECT_EQ(fb.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(fb.status().message().find("expired"), std::string::npos) << fb.status().message();
  EXPECT_EQ(service_->Heartbeat({"alice", ""}, s).code(), Code::kFailedPrecondition);
  // The freed slot serves a new client.
  std::string s2 = NewSession("bob");
  NewModel("bob", s2);
  EXPECT_EQ(service_->slots_in_use(), 1);
}

TEST_F(ServiceTest, NoFreeSlotFailsCreateWithRetryableErrorWhenItMayNotWait) {
  ServiceOptions o;
  o.capacity_wait = 0ms;  // capacity_test.cpp: the queue for a slot
  Open(o, /*slots=*/1);
  std::string s = NewSession("alice");
  NewModel("alice", s, 0);
  const tinker::CreateModelRequest req = CreateRequest(s, 1);
  // Refused up front with 503 (the SDK's base client retries it), not as a
  // failed future (a final RequestFailedError), and nothing is recorded.
  auto sub = service_->CreateModel({"alice", ""}, req);
  ASSERT_FALSE(sub.ok());
  EXPECT_EQ(sub.status().code(), Code::kUnavailable);
  EXPECT_NE(sub.status().message().find("no free adapter slot"), std::string::npos);
  EXPECT_NE(sub.status().message().find("retry"), std::string::npos);
  EXPECT_EQ((*testing::AsJson(service_->checkpoints().ListTrainingRuns({"alice", ""}, {}), wire::TrainingRunsJson))["training_runs"].size(), 1u);
  // Once the slot is free the same request succeeds.
  ASSERT_TRUE(service_->UnloadModel({"alice", ""}, s + ":train:0").ok());
  auto retried = service_->CreateModel({"alice", ""}, req);
  ASSERT_TRUE(retried.ok()) << retried.status().message();
  EXPECT_EQ(Wait("alice", retried->request_id).state, FutureState::kDone);
}

TEST_F(ServiceTest, TenantQuotaRefusesCreateWith429AndSparesOtherTenants) {
  ServiceOptions o;
  o.max_models_per_tenant = 2;
  Open(o, /*slots=*/4);
  std::string s = NewSession("alice");
  NewModel("alice", s, 0);
  NewModel("alice", s, 1);
  const tinker::CreateModelRequest req = CreateRequest(s, 2);
  auto third = service_->CreateModel({"alice", ""}, req);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), Code::kResourceExhausted);  // 429
  EXPECT_NE(third.status().message().find("--max-models-per-tenant 2"), std::string::npos)
      << third.status().message();
  EXPECT_EQ((*testing::AsJson(service_->checkpoints().ListTrainingRuns({"alice", ""}, {}), wire::TrainingRunsJson))["training_runs"].size(), 2u);
  // Via load_weights (create_training_client_from_state) the quota holds too.
  ASSERT_EQ(Wait("alice", service_->SaveWeights({"alice", ""}, SaveRequest(s + ":train:0", 1, "c"))->request_id).state,
            FutureState::kDone);
  tinker::LoadWeightsRequest load;
  load.mode = tinker::LoadWeightsRequest::Mode::kCreateModel;
  load.session_id = s;
  load.model_seq_id = 2;
  load.path = *tinker::ParseTinkerPath("tinker://" + s + ":train:0/weights/c");
  EXPECT_EQ(service_->LoadWeights({"alice", ""}, load).status().code(), Code::kResourceExhausted);
  // Another tenant still gets the free slots.
  std::string b = NewSession("bob");
  NewModel("bob", b, 0);
  NewModel("bob", b, 1);
  EXPECT_EQ(service_->slots_in_use(), 4);
  // A retry of alice's existing model is not a new model.
  EXPECT_TRUE(service_->CreateModel({"alice", ""}, CreateRequest(s, 1)).ok());
  // Unloading one of hers makes room for her again.
  ASSERT_TRUE(service_->UnloadModel({"alice", ""}, s + ":train:1").ok());
  auto retried = service_->CreateModel({"alice", ""}, req);
  ASSERT_TRUE(retried.ok()) << retried.status().message();
  EXPECT_EQ(Wait("alice", retried->request_id).state, FutureState::kDone);
}

TEST_F(ServiceTest, IdempotencyKeyIsScopedByRouteAndBody) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  const Caller first{"alice", "k", "POST forward_backward", BodyDigest("body-1")};
  auto a = service_->ForwardBackward(first, Fb(m, 1, 5));
  ASSERT_TRUE(a.ok());
  // The base client's retry: same key, route and body -> the first future.
  auto retry = service_->ForwardBackward(first, Fb(m, 1, 5));
  ASSERT_TRUE(retry.ok());
  EXPECT_EQ(retry->request_id, a->request_id);
  // Same key, another body (a new seq_id) or another route: a 400 naming the header.
  Caller other_body = first;
  other_body.body_digest = BodyDigest("body-2");
  auto b = service_->ForwardBackward(other_body, Fb(m, 2, 6));
  EXPECT_EQ(b.status().code(), Code::kInvalidArgument);
  EXPECT_NE(b.status().message().find("X-Idempotency-Key: 'k'"), std::string::npos) << b.status().message();
  Caller other_route = first;
  other_route.route = "POST forward";
  EXPECT_EQ(service_->ForwardBackward(other_route, Fb(m, 2, 6)).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(service_->CreateModel(first, CreateRequest(s, 1)).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(service_->UnloadModel(first, m).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(service_->CreateSession(first, {}).status().code(), Code::kInvalidArgument);
  // Another tenant's equal key is its own.
  std::string bs = NewSession("bob");
  std::string bm = NewModel("bob", bs);
  auto theirs = service_->ForwardBackward({"bob", "k", "POST forward_backward", BodyDigest("body-1")}, Fb(bm, 1, 7));
  ASSERT_TRUE(theirs.ok());
  EXPECT_NE(theirs->request_id, a->request_id);
  EXPECT_EQ(Wait("alice", a->request_id).state, FutureState::kDone);
  EXPECT_EQ(Wait("bob", theirs->request_id).state, FutureState::kDone);
  // Nothing that was refused reached the engine.
  EXPECT_EQ(FbLog().size(), 2u);
}

TEST_F(ServiceTest, OverwriteKeepsTheCheckpointLoadableAndItsArchiveLinkWorking) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  const Caller alice{"alice", ""};
  ASSERT_EQ(Wait("alice", service_->SaveWeights(alice, SaveRequest(m, 1, "ck"))->request_id).state,
            FutureState::kDone);
  int64_t expires = 0;
  auto token = service_->checkpoints().CreateArchiveToken(alice, m, "weights/ck", &expires);
  ASSERT_TRUE(token.ok());
  // save_state(overwrite=true) publishes a new version of the files elsewhere.
  tinker::SaveWeightsRequest over = SaveRequest(m, 2, "ck");
  over.overwrite = true;
  ASSERT_EQ(Wait("alice", service_->SaveWeights(alice, over)->request_id).state, FutureState::kDone);
  auto tar = service_->checkpoints().ReadArchive(*token);
  ASSERT_TRUE(tar.ok()) << tar.status().message();
  EXPECT_NE(tar->find("state.txt"), std::string::npos);
  tinker::LoadWeightsRequest load;
  load.model_id = m;
  load.seq_id = 3;
  load.path = *tinker::ParseTinkerPath("tinker://" + m + "/weights/ck");
  EXPECT_EQ(Wait("alice", service_->LoadWeights(alice, load)->request_id).state, FutureState::kDone);
  EXPECT_EQ((*testing::AsJson(service_->checkpoints().ListRunCheckpoints(alice, m), wire::CheckpointsListJson))["checkpoints"].size(), 1u);
}

TEST_F(ServiceTest, HugeTtlNeverExpiresTheCheckpoint) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  const Caller alice{"alice", ""};
  tinker::SaveWeightsRequest save = SaveRequest(m, 1, "forever");
  save.ttl_seconds = std::numeric_limits<int64_t>::max();
  ASSERT_EQ(Wait("alice", service_->SaveWeights(alice, save)->request_id).state, FutureState::kDone);
  tinker::SaveWeightsForSamplerRequest sampler;
  sampler.model_id = m;
  sampler.seq_id = 2;
  sampler.name = "sampler";
  sampler.ttl_seconds = std::numeric_limits<int64_t>::max() / 1000;  // ttl * 1000 fits, + now does not
  ASSERT_EQ(Wait("alice", service_->SaveWeightsForSampler(alice, sampler)->request_id).state, FutureState::kDone);
  ASSERT_EQ(Wait("alice", service_->SaveWeights(alice, SaveRequest(m, 3, "put"))->request_id).state,
            FutureState::kDone);
  // PUT .../ttl computes its expiry the same way.
  ASSERT_TRUE(service_->checkpoints().SetCheckpointTtl(alice, m, "weights/put", std::numeric_limits<int64_t>::max()).ok());
  // A restart sweeps expired TTLs (Start()): all three stay, due in year 9999.
  service_.reset();
  Open();
  auto list = testing::AsJson(service_->checkpoints().ListRunCheckpoints(alice, m), wire::CheckpointsListJson);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ((*list)["checkpoints"].size(), 3u) << list->dump();
  for (const auto& c : (*list)["checkpoints"]) EXPECT_EQ(c["expires_at"], "9999-12-31T23:59:59Z") << c.dump();
}

TEST_F(ServiceTest, ForwardBackwardsOfSeveralModelsPackIntoOnePass) {
  Open();
  std::vector<std::string> models;
  for (const char* t : {"a", "b", "c"}) models.push_back(NewModel(t, NewSession(t)));
  engine_->Hold();
  auto first = service_->ForwardBackward({"a", ""}, Fb(models[0], 1, 1));
  engine_->WaitInForward();  // the engine thread is busy with a's pass
  auto b = service_->ForwardBackward({"b", ""}, Fb(models[1], 1, 2));
  auto c = service_->ForwardBackward({"c", ""}, Fb(models[2], 1, 3));
  auto other_loss = service_->ForwardBackward({"a", ""}, Fb(models[0], 2, 4, "importance_sampling"));
  engine_->Release();
  for (auto* r : {&first, &b, &c, &other_loss}) {
    ASSERT_TRUE(r->ok());
  }
  EXPECT_EQ(Wait("a", first->request_id).state, FutureState::kDone);
  EXPECT_EQ(Wait("b", b->request_id).state, FutureState::kDone);
  EXPECT_EQ(Wait("c", c->request_id).state, FutureState::kDone);
  EXPECT_EQ(Wait("a", other_loss->request_id).state, FutureState::kDone);
  // a alone, then b+c together (same loss); a's importance_sampling separately.
  EXPECT_EQ(engine_->batch_sizes(), (std::vector<size_t>{1, 2, 1}));
}

TEST_F(ServiceTest, FailureOfOneCallDoesNotFailItsBatchNeighbours) {
  Open();
  std::string ma = NewModel("a", NewSession("a"));
  std::string mb = NewModel("b", NewSession("b"));
  engine_->Hold();
  auto warm = service_->ForwardBackward({"a", ""}, Fb(ma, 1, 1));
  engine_->WaitInForward();
  auto bad = service_->ForwardBackward({"a", ""}, Fb(ma, 2, 99));  // token 99: injected failure
  auto good = service_->ForwardBackward({"b", ""}, Fb(mb, 1, 5));
  engine_->Release();
  EXPECT_EQ(Wait("a", bad->request_id).state, FutureState::kFailed);
  FutureView g = Wait("b", good->request_id);
  ASSERT_EQ(g.state, FutureState::kDone);
  ASSERT_TRUE(g.result && std::holds_alternative<tinker::ForwardBackwardOutput>(*g.result));
  EXPECT_EQ(std::get<tinker::ForwardBackwardOutput>(*g.result).metrics.at("loss:sum"), 1.0);
}

TEST_F(ServiceTest, OptimStepsOfSeveralModelsMerge) {
  Open();
  std::string ma = NewModel("a", NewSession("a"));
  std::string mb = NewModel("b", NewSession("b"));
  engine_->Hold();
  auto warm = service_->ForwardBackward({"a", ""}, Fb(ma, 1, 1));
  engine_->WaitInForward();
  tinker::OptimStepRequest o;
  o.model_id = ma;
  o.seq_id = 2;
  auto oa = service_->OptimStep({"a", ""}, o);
  o.model_id = mb;
  o.seq_id = 1;
  auto ob = service_->OptimStep({"b", ""}, o);
  engine_->Release();
  FutureView va = Wait("a", oa->request_id);
  ASSERT_EQ(va.state, FutureState::kDone);
  EXPECT_EQ(wire::FutureResultJson(*va.result)["metrics"]["grad_norm"], 0.5);
  Wait("b", ob->request_id);
  EXPECT_EQ(engine_->optim_batch_sizes(), (std::vector<size_t>{2}));
}

TEST_F(ServiceTest, CheckpointNameCollisionIsAUserErrorNotAConflict) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  tinker::SaveWeightsRequest save = SaveRequest(m, 1, "same");
  auto first = service_->SaveWeights({"alice", ""}, save);
  ASSERT_EQ(Wait("alice", first->request_id).state, FutureState::kDone);
  EXPECT_EQ(first.ok() ? wire::FutureResultJson(*Wait("alice", first->request_id).result)["path"] : "",
            "tinker://" + m + "/weights/same");
  save.seq_id = 2;
  auto second = service_->SaveWeights({"alice", ""}, save);
  FutureView v = Wait("alice", second->request_id);
  ASSERT_EQ(v.state, FutureState::kFailed);
  EXPECT_EQ(v.error.code(), Code::kInvalidArgument);
  EXPECT_NE(v.error.message().find("already exists"), std::string::npos);
  save.seq_id = 3;
  save.overwrite = true;
  auto third = service_->SaveWeights({"alice", ""}, save);
  EXPECT_EQ(Wait("alice", third->request_id).state, FutureState::kDone);
}

TEST_F(ServiceTest, SaveLoadSamplerSaveAndRestartKeepsCheckpoints) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  Caller alice{"alice", ""};
  tinker::SaveWeightsRequest save = SaveRequest(m, 1, "step1");
  ASSERT_EQ(Wait("alice", service_->SaveWeights(alice, save)->request_id).state, FutureState::kDone);

  tinker::LoadWeightsRequest load;
  load.model_id = m;
  load.seq_id = 2;
  load.path = *tinker::ParseTinkerPath("tinker://" + m + "/weights/step1");
  load.optimizer = true;
  FutureView lv = Wait("alice", service_->LoadWeights(alice, load)->request_id);
  ASSERT_EQ(lv.state, FutureState::kDone) << lv.error.message();
  EXPECT_EQ(wire::FutureResultJson(*lv.result)["model_id"], m);

  tinker::SaveWeightsForSamplerRequest unnamed;
  unnamed.model_id = m;
  unnamed.seq_id = 3;
  unnamed.sampling_session_seq_id = 0;
  FutureView uv = Wait("alice", service_->SaveWeightsForSampler(alice, unnamed)->request_id);
  ASSERT_EQ(uv.state, FutureState::kDone) << uv.error.message();
  EXPECT_EQ(wire::FutureResultJson(*uv.result)["sampling_session_id"], s + ":sample:0");

  auto info = testing::AsJson(service_->checkpoints().WeightsInfo(alice, load.path), wire::WeightsInfoJson);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ((*info)["lora_rank"], 4);
  EXPECT_EQ((*info)["base_model"], "test/base");

  // Restart on the same data dir.
  service_.reset();
  Open();
  auto list = testing::AsJson(service_->checkpoints().ListUserCheckpoints(alice, {}), wire::CheckpointsListJson);
  ASSERT_TRUE(list.ok());
  EXPECT_EQ((*list)["checkpoints"].size(), 2u);
  EXPECT_EQ((*list)["cursor"]["total_count"], 2);
  // create_training_client_from_state: a new session's model loads it.
  std::string s2 = NewSession("alice");
  std::string m2 = NewModel("alice", s2);
  load.model_id = m2;
  load.seq_id = 1;
  FutureView rv = Wait("alice", service_->LoadWeights(alice, load)->request_id);
  EXPECT_EQ(rv.state, FutureState::kDone) << rv.error.message();
  // Archive, then delete.
  int64_t expires = 0;
  auto token = service_->checkpoints().CreateArchiveToken(alice, m, "weights/step1", &expires);
  ASSERT_TRUE(token.ok()) << token.status().message();
  auto tar = service_->checkpoints().ReadArchive(*token);
  ASSERT_TRUE(tar.ok()) << tar.status().message();
  EXPECT_NE(tar->find("state.txt"), std::string::npos);
  EXPECT_NE(tar->find("checkpoint_complete"), std::string::npos);
  EXPECT_EQ(service_->checkpoints().ReadArchive("bogus").status().code(), Code::kNotFound);
  EXPECT_TRUE(service_->checkpoints().DeleteCheckpoint(alice, m, "weights/step1").ok());
  auto after = testing::AsJson(service_->checkpoints().ListRunCheckpoints(alice, m), wire::CheckpointsListJson);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ((*after)["checkpoints"].size(), 1u);
}

TEST_F(ServiceTest, CreateFromStateViaLoadWeightsUsesTheCheckpointsLoraConfig) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s, 0, 8);
  Caller alice{"alice", ""};
  tinker::SaveWeightsRequest save = SaveRequest(m, 1, "ck");
  ASSERT_EQ(Wait("alice", service_->SaveWeights(alice, save)->request_id).state, FutureState::kDone);
  tinker::LoadWeightsRequest load;
  load.mode = tinker::LoadWeightsRequest::Mode::kCreateModel;
  load.session_id = s;
  load.model_seq_id = 1;
  load.path = *tinker::ParseTinkerPath("tinker://" + m + "/weights/ck");
  auto sub = service_->LoadWeights(alice, load);
  ASSERT_TRUE(sub.ok()) << sub.status().message();
  EXPECT_EQ(sub->model_id, s + ":train:1");
  EXPECT_EQ(Wait("alice", sub->request_id).state, FutureState::kDone);
  auto log = engine_->log();
  EXPECT_NE(std::find(log.begin(), log.end(), "bind:1:r8"), log.end());
  EXPECT_NE(std::find(log.begin(), log.end(), "load:1"), log.end());
}

TEST_F(ServiceTest, InvalidInputIsRejectedBeforeTheEngine) {
  Open();
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  tinker::ForwardBackwardRequest empty;
  empty.model_id = m;
  empty.seq_id = 1;
  EXPECT_EQ(service_->ForwardBackward({"alice", ""}, empty).status().code(), Code::kInvalidArgument);
  tinker::CreateModelRequest big;
  big.session_id = s;
  big.model_seq_id = 1;
  big.base_model = "test/base";
  big.lora.rank = 64;
  auto r = service_->CreateModel({"alice", ""}, big);
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("rank"), std::string::npos);
  big.lora.rank = 4;
  big.base_model = "other/model";
  EXPECT_EQ(service_->CreateModel({"alice", ""}, big).status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(FbLog().empty());
}

TEST_F(ServiceTest, UnloadReleasesTheSlot) {
  Open({}, 1);
  std::string s = NewSession("alice");
  std::string m = NewModel("alice", s);
  auto u = service_->UnloadModel({"alice", ""}, m);
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(wire::FutureResultJson(*Wait("alice", u->request_id).result)["model_id"], m);
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (service_->slots_in_use() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(service_->slots_in_use(), 0);
  EXPECT_EQ(service_->ForwardBackward({"alice", ""}, Fb(m, 1, 1)).status().code(), Code::kFailedPrecondition);
}

}  // namespace
}  // namespace loom::service
