// Sampling sessions and asample on the Service over a FakeEngine and a
// FakeSampler: ids and idempotency, base_model / model_path checks, snapshot
// ownership and publishing, (session, seq_id) dedup, validation before
// queueing, results through the future table, tenant isolation, the
// sampler's fair-share names, cancellation on session expiry, and the
// --sample-queue bound (429); publishing off the engine thread (training
// goes on while a snapshot is written, a failed write fails only its save,
// one model's saves commit in order, Stop() writes what was taken).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <thread>

#include "fake_engine.h"
#include "wire_json.h"
#include "fake_sampler.h"
#include "wait_future.h"
#include "service/service.h"
#include "wire/future_result.h"

namespace loom::service {
namespace {

using namespace std::chrono_literals;

class SamplingServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { Open(ServiceOptions{}); }
  // A fresh service with these options (base_model_name and janitor_period set here).
  void Open(ServiceOptions so) {
    service_.reset();
    dir_ = (std::filesystem::temp_directory_path() /
            ("loom_sampling_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
             std::to_string(::getpid())))
               .string();
    std::filesystem::remove_all(dir_);
    auto registry = store::Registry::Open(dir_);
    ASSERT_TRUE(registry.ok());
    so.base_model_name = "test/base";
    so.janitor_period = 20ms;
    auto engine = std::make_unique<testing::FakeEngine>(4);
    engine_ = engine.get();
    service_ = std::make_unique<Service>(so, std::move(engine), std::move(*registry));
    auto sampler = std::make_unique<testing::FakeSampler>(100, 32);
    sampler_ = sampler.get();
    service_->AttachSampler(std::move(sampler));
    service_->Start();
  }
  void TearDown() override {
    service_.reset();
    std::filesystem::remove_all(dir_);
  }

  FutureView Wait(const std::string& tenant, const std::string& id) {
    return testing::WaitFuture(*service_, tenant, id);
  }
  std::string Session(const std::string& tenant) { return *service_->CreateSession({tenant, ""}, {}); }
  std::string Model(const std::string& tenant, const std::string& session) {
    tinker::CreateModelRequest req;
    req.session_id = session;
    req.base_model = "test/base";
    req.lora.rank = 4;
    auto sub = service_->CreateModel({tenant, ""}, req);
    EXPECT_TRUE(sub.ok()) << sub.status().message();
    EXPECT_EQ(Wait(tenant, sub->request_id).state, FutureState::kDone);
    return sub->model_id;
  }
  // Saves a named sampler snapshot of model (seq 1) and returns its tinker path.
  std::string Snapshot(const std::string& tenant, const std::string& model, const std::string& name,
                       int64_t seq = 1) {
    tinker::SaveWeightsForSamplerRequest req;
    req.model_id = model;
    req.seq_id = seq;
    req.name = name;
    auto sub = service_->SaveWeightsForSampler({tenant, ""}, req);
    EXPECT_TRUE(sub.ok()) << sub.status().message();
    FutureView v = Wait(tenant, sub->request_id);
    EXPECT_EQ(v.state, FutureState::kDone) << v.error.message();
    return wire::FutureResultJson(*v.result).value("path", "");
  }
  Result<std::string> CreateSampling(const std::string& tenant, const std::string& session, int64_t seq,
                                     std::optional<std::string> base, std::optional<std::string> path) {
    tinker::CreateSamplingSessionRequest req;
    req.session_id = session;
    req.sampling_session_seq_id = seq;
    req.base_model = std::move(base);
    req.model_path = std::move(path);
    return service_->CreateSamplingSession({tenant, ""}, req);
  }
  static tinker::SampleRequest Req(const std::string& sampling_session, int64_t seq, std::vector<int32_t> prompt,
                                 int32_t max_tokens = 3, int32_t num_samples = 1) {
    tinker::SampleRequest r;
    r.sampling_session_id = sampling_session;
    r.seq_id = seq;
    r.prompt = std::move(prompt);
    r.num_samples = num_samples;
    r.sampling_params.max_tokens = max_tokens;
    return r;
  }

  // save_weights_for_sampler of model as `name` (unnamed when empty), not waited for.
  std::string SubmitSave(const std::string& tenant, const std::string& model, int64_t seq, const std::string& name) {
    tinker::SaveWeightsForSamplerRequest req;
    req.model_id = model;
    req.seq_id = seq;
    if (name.empty()) req.sampling_session_seq_id = seq;
    else req.name = name;
    auto sub = service_->SaveWeightsForSampler({tenant, ""}, req);
    EXPECT_TRUE(sub.ok()) << sub.status().message();
    return sub.ok() ? sub->request_id : "";
  }
  // forward_backward (tagged by its first token) then optim_step on model, not waited for.
  std::vector<std::string> SubmitTrain(const std::string& tenant, const std::string& model, int64_t seq, int tag) {
    const tinker::ForwardBackwardRequest fb = testing::TaggedForwardBackward(model, seq, tag);
    tinker::OptimStepRequest optim;
    optim.model_id = model;
    optim.seq_id = seq + 1;
    auto a = service_->ForwardBackward({tenant, ""}, fb);
    auto b = service_->OptimStep({tenant, ""}, optim);
    EXPECT_TRUE(a.ok() && b.ok());
    return {a.ok() ? a->request_id : "", b.ok() ? b->request_id : ""};
  }
  FutureState State(const std::string& tenant, const std::string& id) {
    auto v = service_->futures().Get(tenant, id);
    return v.ok() ? v->state : FutureState::kFailed;
  }

  std::string dir_;
  std::unique_ptr<Service> service_;
  testing::FakeEngine* engine_ = nullptr;
  testing::FakeSampler* sampler_ = nullptr;
};

TEST_F(SamplingServiceTest, BaseModelSessionIdIsSessionSampleSeqAndIdempotent) {
  const std::string s = Session("alice");
  auto id = CreateSampling("alice", s, 0, "test/base", std::nullopt);
  ASSERT_TRUE(id.ok()) << id.status().message();
  EXPECT_EQ(*id, s + ":sample:0");
  auto again = CreateSampling("alice", s, 0, "test/base", std::nullopt);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *id);
  auto next = CreateSampling("alice", s, 1, "test/base", std::nullopt);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next, s + ":sample:1");

  auto info = testing::AsJson(service_->GetSampler({"alice", ""}, *id), wire::GetSamplerJson);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ((*info)["sampler_id"], *id);
  EXPECT_EQ((*info)["base_model"], "test/base");
  EXPECT_FALSE(info->contains("model_path"));
}

TEST_F(SamplingServiceTest, WrongBaseModelIs400NamingIt) {
  const std::string s = Session("alice");
  auto id = CreateSampling("alice", s, 0, "other/model", std::nullopt);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), Code::kInvalidArgument);
  EXPECT_NE(id.status().message().find("base_model"), std::string::npos) << id.status().message();
  EXPECT_NE(id.status().message().find("test/base"), std::string::npos);
}

TEST_F(SamplingServiceTest, ForeignOrUnknownSessionIs404) {
  const std::string s = Session("alice");
  auto foreign = CreateSampling("bob", s, 0, "test/base", std::nullopt);
  ASSERT_FALSE(foreign.ok());
  EXPECT_EQ(foreign.status().code(), Code::kNotFound);
  auto unknown = CreateSampling("alice", "nope", 0, "test/base", std::nullopt);
  EXPECT_EQ(unknown.status().code(), Code::kNotFound);
}

TEST_F(SamplingServiceTest, ModelPathMustBeOwnOrPublishedSamplerWeights) {
  const std::string sa = Session("alice");
  const std::string model = Model("alice", sa);
  const std::string path = Snapshot("alice", model, "snap");
  ASSERT_EQ(path, "tinker://" + model + "/sampler_weights/snap");

  auto own = CreateSampling("alice", sa, 0, std::nullopt, path);
  ASSERT_TRUE(own.ok()) << own.status().message();
  auto info = testing::AsJson(service_->GetSampler({"alice", ""}, *own), wire::GetSamplerJson);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ((*info)["model_path"], path);
  EXPECT_EQ((*info)["base_model"], "test/base");

  const std::string sb = Session("bob");
  auto foreign = CreateSampling("bob", sb, 0, std::nullopt, path);
  ASSERT_FALSE(foreign.ok());
  EXPECT_EQ(foreign.status().code(), Code::kNotFound);
  EXPECT_NE(foreign.status().message().find("model_path"), std::string::npos);

  ASSERT_TRUE(service_->checkpoints().SetCheckpointPublic({"alice", ""}, model, "sampler_weights/snap", true).ok());
  auto published = CreateSampling("bob", sb, 1, std::nullopt, path);
  ASSERT_TRUE(published.ok()) << published.status().message();
  EXPECT_EQ(*published, sb + ":sample:1");
  // Bob's session is Bob's: Alice cannot see it.
  EXPECT_EQ(service_->GetSampler({"alice", ""}, *published).status().code(), Code::kNotFound);

  auto missing = CreateSampling("alice", sa, 2, std::nullopt, "tinker://" + model + "/sampler_weights/none");
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  auto training = CreateSampling("alice", sa, 3, std::nullopt, "tinker://" + model + "/weights/snap");
  EXPECT_EQ(training.status().code(), Code::kInvalidArgument);
  auto garbage = CreateSampling("alice", sa, 4, std::nullopt, "tinker://only-one-part");
  EXPECT_EQ(garbage.status().code(), Code::kInvalidArgument);
}

TEST_F(SamplingServiceTest, SampleCompletesWithSequenceIdsAndSnapshotDir) {
  const std::string s = Session("alice");
  const std::string model = Model("alice", s);
  const std::string path = Snapshot("alice", model, "snap");
  auto sampling = CreateSampling("alice", s, 0, std::nullopt, path);
  ASSERT_TRUE(sampling.ok());
  auto sub = service_->Sample({"alice", ""}, Req(*sampling, 0, {5, 6, 7}, 4, 3));
  ASSERT_TRUE(sub.ok()) << sub.status().message();
  ASSERT_EQ(sub->sample_sequence_ids.size(), 3u);
  std::set<std::string> distinct(sub->sample_sequence_ids.begin(), sub->sample_sequence_ids.end());
  EXPECT_EQ(distinct.size(), 3u);

  FutureView v = Wait("alice", sub->request_id);
  ASSERT_EQ(v.state, FutureState::kDone) << v.error.message();
  ASSERT_TRUE(std::holds_alternative<tinker::SampleOutput>(*v.result));
  const wire::SampleResult r = wire::SampleResultOf(std::get<tinker::SampleOutput>(*v.result));
  ASSERT_EQ(r.sequences.size(), 3u);
  EXPECT_EQ(r.sequences[1].tokens, (std::vector<int32_t>{9, 10, 11, 12}));  // (7 + 1 + 1 + j) % 100
  EXPECT_EQ(r.sequences[1].stop_reason, wire::StopReason::kLength);
  EXPECT_FLOAT_EQ(r.sequences[0].logprobs[3], -0.4f);
  EXPECT_FALSE(r.prompt_logprobs.has_value());

  auto calls = sampler_->calls();
  ASSERT_EQ(calls.size(), 1u);
  auto ckpt = std::filesystem::path(calls[0].adapter_dir);
  EXPECT_TRUE(std::filesystem::exists(ckpt / "adapter_config.json")) << calls[0].adapter_dir;
  EXPECT_EQ(calls[0].num_samples, 3);
  EXPECT_EQ(calls[0].params.max_tokens, 4);

  // The other tenant cannot read the future or use the session.
  EXPECT_EQ(service_->futures().Get("bob", sub->request_id).status().code(), Code::kNotFound);
  auto foreign = service_->Sample({"bob", ""}, Req(*sampling, 1, {1}));
  EXPECT_EQ(foreign.status().code(), Code::kNotFound);
}

TEST_F(SamplingServiceTest, BaseSessionSamplesTheBaseAndPromptLogprobsArrive) {
  const std::string s = Session("alice");
  auto sampling = CreateSampling("alice", s, 0, "test/base", std::nullopt);
  ASSERT_TRUE(sampling.ok());
  tinker::SampleRequest req = Req(*sampling, 0, {3, 4, 5}, 1);  // compute_logprobs' shape
  req.prompt_logprobs = true;
  req.topk_prompt_logprobs = 2;
  auto sub = service_->Sample({"alice", ""}, req);
  ASSERT_TRUE(sub.ok()) << sub.status().message();
  FutureView v = Wait("alice", sub->request_id);
  ASSERT_EQ(v.state, FutureState::kDone);
  const wire::SampleResult r = wire::SampleResultOf(std::get<tinker::SampleOutput>(*v.result));
  ASSERT_TRUE(r.prompt_logprobs.has_value());
  ASSERT_EQ(r.prompt_logprobs->size(), 3u);
  EXPECT_TRUE(std::isnan((*r.prompt_logprobs)[0]));
  EXPECT_FLOAT_EQ((*r.prompt_logprobs)[2], -0.5f);
  ASSERT_TRUE(r.topk_prompt_logprobs.has_value());
  EXPECT_EQ(r.topk_prompt_logprobs->k, 2u);
  EXPECT_EQ(r.topk_prompt_logprobs->prompt_length, 3u);
  EXPECT_EQ(sampler_->calls().at(0).adapter_dir, "");
}

TEST_F(SamplingServiceTest, RepeatedSeqIdAnswersTheFirstFuture) {
  const std::string s = Session("alice");
  auto sampling = CreateSampling("alice", s, 0, "test/base", std::nullopt);
  ASSERT_TRUE(sampling.ok());
  sampler_->Hold();
  auto first = service_->Sample({"alice", ""}, Req(*sampling, 7, {1, 2}, 2, 2));
  auto again = service_->Sample({"alice", ""}, Req(*sampling, 7, {1, 2}, 2, 2));
  auto other = service_->Sample({"alice", ""}, Req(*sampling, 8, {1, 2}, 2, 2));
  ASSERT_TRUE(first.ok() && again.ok() && other.ok());
  EXPECT_EQ(again->request_id, first->request_id);
  EXPECT_EQ(again->sample_sequence_ids, first->sample_sequence_ids);
  EXPECT_NE(other->request_id, first->request_id);
  sampler_->Release();
  EXPECT_EQ(Wait("alice", first->request_id).state, FutureState::kDone);
  EXPECT_EQ(Wait("alice", other->request_id).state, FutureState::kDone);
  EXPECT_EQ(sampler_->calls().size(), 2u);  // the repeat never reached the sampler
}

TEST_F(SamplingServiceTest, InvalidRequestsAre400BeforeQueueing) {
  const std::string s = Session("alice");
  auto sampling = CreateSampling("alice", s, 0, "test/base", std::nullopt);
  ASSERT_TRUE(sampling.ok());
  const size_t futures_before = service_->futures().size();
  auto window = service_->Sample({"alice", ""}, Req(*sampling, 0, {1, 2, 3, 4}, 29));  // 4 + 29 > 32
  ASSERT_FALSE(window.ok());
  EXPECT_EQ(window.status().code(), Code::kInvalidArgument);
  EXPECT_NE(window.status().message().find("max_tokens"), std::string::npos) << window.status().message();
  EXPECT_NE(window.status().message().find("32"), std::string::npos);
  EXPECT_TRUE(service_->Sample({"alice", ""}, Req(*sampling, 1, {1, 2, 3, 4}, 28)).ok());  // 4 + 28 = 32 fits

  tinker::SampleRequest stop = Req(*sampling, 2, {1}, 2);
  stop.sampling_params.stop_strings = {"\n"};
  auto st = service_->Sample({"alice", ""}, stop);
  EXPECT_EQ(st.status().code(), Code::kInvalidArgument);
  EXPECT_NE(st.status().message().find("tokenizer.json"), std::string::npos);
  EXPECT_EQ(service_->futures().size(), futures_before + 1);  // only the valid one made a future
  // A rejected seq_id is not remembered: fixed, it is admitted.
  EXPECT_TRUE(service_->Sample({"alice", ""}, Req(*sampling, 0, {1, 2, 3, 4}, 3)).ok());
}

TEST_F(SamplingServiceTest, UnnamedSaveForSamplerSessionIsSampleable) {
  const std::string s = Session("alice");
  const std::string model = Model("alice", s);
  tinker::SaveWeightsForSamplerRequest req;
  req.model_id = model;
  req.seq_id = 1;
  req.sampling_session_seq_id = 5;
  auto sub = service_->SaveWeightsForSampler({"alice", ""}, req);
  ASSERT_TRUE(sub.ok());
  FutureView v = Wait("alice", sub->request_id);
  ASSERT_EQ(v.state, FutureState::kDone) << v.error.message();
  const std::string sampling = wire::FutureResultJson(*v.result)["sampling_session_id"];
  EXPECT_EQ(sampling, s + ":sample:5");
  auto info = testing::AsJson(service_->GetSampler({"alice", ""}, sampling), wire::GetSamplerJson);
  ASSERT_TRUE(info.ok());
  EXPECT_NE((*info)["model_path"].get<std::string>().find("/sampler_weights/"), std::string::npos);
  auto sample = service_->Sample({"alice", ""}, Req(sampling, 0, {1, 2}));
  ASSERT_TRUE(sample.ok()) << sample.status().message();
  EXPECT_EQ(Wait("alice", sample->request_id).state, FutureState::kDone);
  EXPECT_FALSE(sampler_->calls().at(0).adapter_dir.empty());
  EXPECT_EQ(service_->GetSampler({"bob", ""}, sampling).status().code(), Code::kNotFound);
}

// Where the sampler samples from memory, an unnamed save (the wire's
// ephemeral sampler) is answered before its write: no path, a sampling
// session whose calls carry the snapshot itself; once the write commits,
// the session samples the committed directory and the checkpoint is listed.
TEST_F(SamplingServiceTest, AnEphemeralSamplerIsAnsweredBeforeItsWriteAndSamplesFromMemory) {
  sampler_->set_samples_from_memory(true);
  const std::string s = Session("alice");
  const std::string model = Model("alice", s);
  engine_->HoldWrites();
  const std::string save = SubmitSave("alice", model, 1, "");
  FutureView v = Wait("alice", save);  // while the write is held
  ASSERT_EQ(v.state, FutureState::kDone) << v.error.message();
  const nlohmann::json result = wire::FutureResultJson(*v.result);
  const std::string sampling = result.value("sampling_session_id", "");
  EXPECT_EQ(sampling, s + ":sample:1");
  EXPECT_TRUE(!result.contains("path") || result["path"].is_null()) << result.dump();
  auto info = testing::AsJson(service_->GetSampler({"alice", ""}, sampling), wire::GetSamplerJson);
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(!info->contains("model_path") || (*info)["model_path"].is_null()) << info->dump();
  auto first = service_->Sample({"alice", ""}, Req(sampling, 0, {1, 2}));
  ASSERT_TRUE(first.ok()) << first.status().message();
  EXPECT_EQ(Wait("alice", first->request_id).state, FutureState::kDone);
  const engine::SampleCall from_memory = sampler_->calls().back();
  EXPECT_EQ(from_memory.adapter_dir.rfind("snapshot:", 0), 0u) << from_memory.adapter_dir;
  EXPECT_TRUE(from_memory.snapshot != nullptr);
  EXPECT_EQ(service_->Sample({"bob", ""}, Req(sampling, 1, {1})).status().code(), Code::kNotFound);

  engine_->ReleaseWrites();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::string committed;
  while (committed.empty() && std::chrono::steady_clock::now() < deadline) {
    auto now = testing::AsJson(service_->GetSampler({"alice", ""}, sampling), wire::GetSamplerJson);
    if (now.ok() && now->contains("model_path") && (*now)["model_path"].is_string()) committed = (*now)["model_path"];
    else std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_NE(committed.find("/sampler_weights/"), std::string::npos) << committed;
  auto second = service_->Sample({"alice", ""}, Req(sampling, 2, {1, 2}));
  ASSERT_TRUE(second.ok()) << second.status().message();
  EXPECT_EQ(Wait("alice", second->request_id).state, FutureState::kDone);
  const engine::SampleCall from_disk = sampler_->calls().back();
  EXPECT_EQ(from_disk.snapshot, nullptr);
  EXPECT_EQ(from_disk.adapter_dir.rfind("snapshot:", 0), std::string::npos) << from_disk.adapter_dir;
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(from_disk.adapter_dir)));
  EXPECT_TRUE(sampler_->offered_dirs().empty());  // the samples took the snapshot itself
}

TEST_F(SamplingServiceTest, DeletedSnapshotIs404AtSampleTime) {
  const std::string s = Session("alice");
  const std::string model = Model("alice", s);
  const std::string path = Snapshot("alice", model, "gone");
  auto sampling = CreateSampling("alice", s, 0, std::nullopt, path);
  ASSERT_TRUE(sampling.ok());
  ASSERT_TRUE(service_->checkpoints().DeleteCheckpoint({"alice", ""}, model, "sampler_weights/gone").ok());
  auto sub = service_->Sample({"alice", ""}, Req(*sampling, 0, {1}));
  EXPECT_EQ(sub.status().code(), Code::kNotFound);
  EXPECT_NE(sub.status().message().find("gone"), std::string::npos);
}

TEST_F(SamplingServiceTest, CallsCarryTheTenantAndSamplingSessionForFairShare) {
  const std::string s = Session("alice");
  auto sampling = CreateSampling("alice", s, 0, "test/base", std::nullopt);
  ASSERT_TRUE(sampling.ok());
  auto sub = service_->Sample({"alice", ""}, Req(*sampling, 0, {1, 2}));
  ASSERT_TRUE(sub.ok());
  EXPECT_EQ(Wait("alice", sub->request_id).state, FutureState::kDone);
  EXPECT_EQ(sampler_->calls().at(0).tenant, "alice");
  EXPECT_EQ(sampler_->calls().at(0).session, *sampling);
}

TEST_F(SamplingServiceTest, ExpiredSessionsSamplesAreCancelledAndItTakesNoMore) {
  ServiceOptions so;
  so.session_ttl = 200ms;
  Open(so);
  const std::string a = Session("alice"), b = Session("bob");
  auto alice = CreateSampling("alice", a, 0, "test/base", std::nullopt);
  auto bob = CreateSampling("bob", b, 0, "test/base", std::nullopt);
  ASSERT_TRUE(alice.ok() && bob.ok());
  sampler_->Hold();  // every call stays queued
  std::vector<std::string> doomed;
  for (int64_t seq = 0; seq < 3; ++seq) {
    auto sub = service_->Sample({"alice", ""}, Req(*alice, seq, {1, 2}));
    ASSERT_TRUE(sub.ok()) << sub.status().message();
    doomed.push_back(sub->request_id);
  }
  auto kept = service_->Sample({"bob", ""}, Req(*bob, 0, {1, 2}));
  ASSERT_TRUE(kept.ok());
  // Alice goes silent; bob heartbeats until alice's session has expired.
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (service_->futures().Get("alice", doomed[0])->state == FutureState::kPending &&
         std::chrono::steady_clock::now() < deadline) {
    ASSERT_TRUE(service_->Heartbeat({"bob", ""}, b).ok());
    std::this_thread::sleep_for(10ms);
  }
  for (const std::string& id : doomed) {
    FutureView v = Wait("alice", id);
    ASSERT_EQ(v.state, FutureState::kFailed);
    EXPECT_EQ(v.error.code(), Code::kFailedPrecondition);
    EXPECT_NE(v.error.message().find("sample cancelled: session '" + a + "' sent no heartbeat"), std::string::npos)
        << v.error.message();
  }
  EXPECT_EQ(service_->futures().Get("bob", kept->request_id)->state, FutureState::kPending);
  auto late = service_->Sample({"alice", ""}, Req(*alice, 3, {1, 2}));
  EXPECT_EQ(late.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(late.status().message().find("expired"), std::string::npos) << late.status().message();
  sampler_->Release();
  EXPECT_EQ(Wait("bob", kept->request_id).state, FutureState::kDone);
}

TEST_F(SamplingServiceTest, SampleQueueBoundRefusesWith429ButRepeatsStillAnswer) {
  ServiceOptions so;
  so.sample_queue = 3;  // one tenant may hold 1
  Open(so);
  std::map<std::string, std::string> sampling;
  for (const char* t : {"alice", "bob", "carol", "dave"}) {
    auto id = CreateSampling(t, Session(t), 0, "test/base", std::nullopt);
    ASSERT_TRUE(id.ok());
    sampling[t] = *id;
  }
  sampler_->Hold();
  auto first = service_->Sample({"alice", ""}, Req(sampling["alice"], 0, {1}));
  ASSERT_TRUE(first.ok());
  auto over = service_->Sample({"alice", ""}, Req(sampling["alice"], 1, {1}));
  EXPECT_EQ(over.status().code(), Code::kResourceExhausted);
  EXPECT_NE(over.status().message().find("half of --sample-queue 3"), std::string::npos) << over.status().message();
  // A repeat of an admitted seq_id answers the first future, bound or not.
  auto repeat = service_->Sample({"alice", ""}, Req(sampling["alice"], 0, {1}));
  ASSERT_TRUE(repeat.ok());
  EXPECT_EQ(repeat->request_id, first->request_id);
  ASSERT_TRUE(service_->Sample({"bob", ""}, Req(sampling["bob"], 0, {1})).ok());
  ASSERT_TRUE(service_->Sample({"carol", ""}, Req(sampling["carol"], 0, {1})).ok());
  auto full = service_->Sample({"dave", ""}, Req(sampling["dave"], 0, {1}));
  EXPECT_EQ(full.status().code(), Code::kResourceExhausted);
  EXPECT_NE(full.status().message().find("already holds 3 samples"), std::string::npos) << full.status().message();
  EXPECT_EQ(sampler_->calls().size(), 3u);  // the refused ones never reached the sampler
  sampler_->Release();
  EXPECT_EQ(Wait("alice", first->request_id).state, FutureState::kDone);
  for (int i = 0; i < 1000 && sampler_->stats().requests_done < 3; ++i) std::this_thread::sleep_for(2ms);
  EXPECT_TRUE(service_->Sample({"dave", ""}, Req(sampling["dave"], 0, {1})).ok());
}

TEST(SamplingServiceNoSampler, AsampleIsUnavailableWithoutASampler) {
  const std::string dir = (std::filesystem::temp_directory_path() / ("loom_nosampler_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  auto registry = store::Registry::Open(dir);
  ASSERT_TRUE(registry.ok());
  ServiceOptions so;
  so.base_model_name = "test/base";
  Service service(so, std::make_unique<testing::FakeEngine>(2), std::move(*registry));
  service.Start();
  auto s = service.CreateSession({"alice", ""}, {});
  tinker::CreateSamplingSessionRequest cr;
  cr.session_id = *s;
  cr.base_model = "test/base";
  auto id = service.CreateSamplingSession({"alice", ""}, cr);
  ASSERT_TRUE(id.ok());
  tinker::SampleRequest r;
  r.sampling_session_id = *id;
  r.prompt = {1};
  EXPECT_EQ(service.Sample({"alice", ""}, r).status().code(), Code::kUnavailable);
  service.Stop();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace loom::service

namespace loom::service {
namespace {

// The engine thread only takes the snapshot: while a writer thread is still
// writing it, the same model's later training and another tenant's run; the
// save answers once the snapshot is committed, after it was offered to the
// sampler under the committed directory, which a sample of the path names.
TEST_F(SamplingServiceTest, TrainingRunsWhileTheSnapshotIsWrittenAndTheSampleFindsTheOffer) {
  const std::string sa = Session("alice"), sb = Session("bob");
  const std::string ma = Model("alice", sa), mb = Model("bob", sb);
  engine_->HoldWrites();
  const std::string save = SubmitSave("alice", ma, 1, "v1");
  engine_->WaitWriting(1);  // the snapshot was taken and its write began
  const std::vector<std::string> mine = SubmitTrain("alice", ma, 2, 11);
  const std::vector<std::string> theirs = SubmitTrain("bob", mb, 1, 22);
  for (const std::string& id : mine) EXPECT_EQ(Wait("alice", id).state, FutureState::kDone);
  for (const std::string& id : theirs) EXPECT_EQ(Wait("bob", id).state, FutureState::kDone);
  EXPECT_EQ(State("alice", save), FutureState::kPending);  // not durable yet, so not answered
  EXPECT_TRUE(sampler_->offered_dirs().empty());
  // The path exists once it is committed, just before the answer: until then
  // naming it is a 404, as for a save still queued.
  EXPECT_EQ(CreateSampling("alice", sa, 1, std::nullopt, "tinker://" + ma + "/sampler_weights/v1").status().code(),
            Code::kNotFound);
  const std::vector<std::string> log = engine_->log();
  const auto at = [&](const std::string& entry) { return std::find(log.begin(), log.end(), entry) - log.begin(); };
  EXPECT_LT(at("sampler:0"), at("fb:0:11"));  // the snapshot precedes the later training, in seq order
  engine_->ReleaseWrites();
  FutureView v = Wait("alice", save);
  ASSERT_EQ(v.state, FutureState::kDone) << v.error.message();
  const std::string path = wire::FutureResultJson(*v.result).value("path", "");
  auto sampling = CreateSampling("alice", sa, 0, std::nullopt, path);
  ASSERT_TRUE(sampling.ok()) << sampling.status().message();
  auto sub = service_->Sample({"alice", ""}, Req(*sampling, 0, {1, 2}));
  ASSERT_TRUE(sub.ok()) << sub.status().message();
  EXPECT_EQ(Wait("alice", sub->request_id).state, FutureState::kDone);
  ASSERT_EQ(sampler_->offered_dirs().size(), 1u);
  EXPECT_EQ(sampler_->calls().at(0).adapter_dir, sampler_->offered_dirs()[0]);
  EXPECT_TRUE(std::filesystem::exists(sampler_->offered_dirs()[0] + "/adapter_model.safetensors"));
}

// A write that fails fails its own save, naming the cause; nothing is
// committed or offered, the writers go on, and another tenant's save (and
// the same tenant's training) are unaffected.
TEST_F(SamplingServiceTest, AFailedSnapshotWriteFailsOnlyItsOwnSave) {
  const std::string sa = Session("alice"), sb = Session("bob");
  const std::string ma = Model("alice", sa), mb = Model("bob", sb);  // slots 0 and 1
  engine_->FailWritesOf(0);
  const std::string bad = SubmitSave("alice", ma, 1, "v1");
  const std::string good = SubmitSave("bob", mb, 1, "v1");
  FutureView failed = Wait("alice", bad);
  ASSERT_EQ(failed.state, FutureState::kFailed);
  EXPECT_NE(failed.error.message().find("writing checkpoint 'tinker://" + ma + "/sampler_weights/v1' to disk failed"),
            std::string::npos)
      << failed.error.message();
  EXPECT_NE(failed.error.message().find("Read-only file system"), std::string::npos) << failed.error.message();
  FutureView ok = Wait("bob", good);
  ASSERT_EQ(ok.state, FutureState::kDone) << ok.error.message();
  EXPECT_EQ(CreateSampling("alice", sa, 0, std::nullopt, "tinker://" + ma + "/sampler_weights/v1").status().code(),
            Code::kNotFound);
  EXPECT_EQ(sampler_->offered_dirs().size(), 1u);  // bob's only
  for (const std::string& id : SubmitTrain("alice", ma, 2, 11)) EXPECT_EQ(Wait("alice", id).state, FutureState::kDone);
  EXPECT_EQ(engine_->write_log(), (std::vector<std::string>{"write:1:0"}));
  EXPECT_NE(service_->MetricsText().find("loom_publishes_total{result=\"failed\"} 1"), std::string::npos);
}

// With --publish-staging ahead, every writer is readied before the
// service takes requests (Engine::PrepareSnapshotWriter: on CUDA, its
// pinned staging memory), so no snapshot is written on a thread that would
// take it mid-loop.
TEST_F(SamplingServiceTest, WritersAreReadiedBeforeTheFirstSave) {
  ServiceOptions so;
  so.publish_threads = 3;
  so.publish_staging_ahead = true;
  Open(so);
  EXPECT_EQ(engine_->prepared_writers(), 3u);  // Start() returned after all three
  const std::string sa = Session("alice"), sb = Session("bob");
  const std::string ma = Model("alice", sa), mb = Model("bob", sb);
  std::vector<std::pair<std::string, std::string>> saves;
  for (int i = 0; i < 3; ++i) {
    saves.emplace_back("alice", SubmitSave("alice", ma, 1 + i, "a" + std::to_string(i)));
    saves.emplace_back("bob", SubmitSave("bob", mb, 1 + i, "b" + std::to_string(i)));
  }
  for (const auto& [tenant, id] : saves) EXPECT_EQ(Wait(tenant, id).state, FutureState::kDone);
  EXPECT_EQ(engine_->write_log().size(), 6u);
  EXPECT_EQ(engine_->unprepared_writes(), 0);
  EXPECT_EQ(engine_->prepared_writers(), 3u);
  EXPECT_EQ(engine_->released_unprepared(), 0);
  // Each writer gives its staging back itself before it ends (not left to
  // its thread's exit, where CUDA's per-thread state may be gone).
  const auto released = engine_->released_writers();
  service_.reset();
  engine_ = nullptr;
  EXPECT_EQ(released->size(), 3u);
}

// By default (--publish-staging per-write) no writer takes staging ahead:
// each write takes its own, and nothing is given back at the end.
TEST_F(SamplingServiceTest, WritersStagePerWriteByDefault) {
  const std::string sa = Session("alice");
  const std::string ma = Model("alice", sa);
  const std::string id = SubmitSave("alice", ma, 1, "a0");
  EXPECT_EQ(Wait("alice", id).state, FutureState::kDone);
  EXPECT_EQ(engine_->prepared_writers(), 0u);
  EXPECT_EQ(engine_->unprepared_writes(), 1);
  const auto released = engine_->released_writers();
  service_.reset();
  engine_ = nullptr;
  EXPECT_TRUE(released->empty());
}

// One model's saves are written and committed in seq_id order: of two saves
// of one name in flight, the first one wins and the second is refused.
TEST_F(SamplingServiceTest, OneModelsSavesCommitInSeqOrder) {
  const std::string s = Session("alice");
  const std::string m = Model("alice", s);
  engine_->HoldWrites();
  const std::string first = SubmitSave("alice", m, 1, "same");
  const std::string second = SubmitSave("alice", m, 2, "same");
  const std::string third = SubmitSave("alice", m, 3, "");
  engine_->WaitWriting(1);
  engine_->ReleaseWrites();
  EXPECT_EQ(Wait("alice", first).state, FutureState::kDone);
  FutureView refused = Wait("alice", second);
  ASSERT_EQ(refused.state, FutureState::kFailed);
  EXPECT_EQ(refused.error.code(), Code::kInvalidArgument);
  EXPECT_NE(refused.error.message().find("save_weights_for_sampler.path"), std::string::npos)
      << refused.error.message();
  FutureView unnamed = Wait("alice", third);
  ASSERT_EQ(unnamed.state, FutureState::kDone) << unnamed.error.message();
  EXPECT_EQ(wire::FutureResultJson(*unnamed.result).value("sampling_session_id", ""), s + ":sample:3");
  // The second was checked after the first was committed, so it was never written.
  EXPECT_EQ(engine_->write_log(), (std::vector<std::string>{"write:0:0", "write:0:2"}));
}

// Stop() writes and answers the saves already taken.
TEST_F(SamplingServiceTest, StopWritesTheSavesAlreadyTaken) {
  const std::string s = Session("alice");
  const std::string m = Model("alice", s);
  engine_->HoldWrites();
  const std::string save = SubmitSave("alice", m, 1, "v1");
  engine_->WaitWriting(1);
  std::thread stop([&] { service_->Stop(); });
  engine_->ReleaseWrites();
  stop.join();
  EXPECT_EQ(State("alice", save), FutureState::kDone);
}

}  // namespace
}  // namespace loom::service
