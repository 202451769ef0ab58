// Shared set-up of the scheduler and fault tests: a Service over a
// FaultEngine (the FakeEngine plus injected faults and a per-slot count of
// accumulated gradient datums, to check that failures leave slots untouched).
//
// Fault tags (the first token of a datum's call):
//   99  late validation failure of that call (FakeEngine's own)
//   98  non-finite loss: that call fails with Invalid, nothing accumulates
//   97  engine exception (out of memory): when packed with others the whole
//       engine call fails with Internal; alone, only this call fails
// Thread-safe like FakeEngine.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <thread>

#include "fake_engine.h"
#include "service/service.h"

namespace loom::testing {

class FaultEngine : public FakeEngine {
 public:
  using FakeEngine::FakeEngine;

  std::vector<Result<engine::ForwardBackwardOutput>> ForwardBackward(
      const std::vector<engine::ForwardBackwardCall>& calls) override {
    auto results = FakeEngine::ForwardBackward(calls);
    std::lock_guard<std::mutex> lock(mu2_);
    std::vector<size_t> datums;
    for (const auto& c : calls) datums.push_back(c.data.size());
    pass_datums_.push_back(datums);
    bool oom = false;
    for (const auto& c : calls) oom = oom || c.data[0].tokens[0] == 97;
    if (oom && calls.size() > 1) {
      return std::vector<Result<engine::ForwardBackwardOutput>>(
          calls.size(), Status::Internal("forward_backward: CUDA out of memory (injected)"));
    }
    for (size_t i = 0; i < calls.size(); ++i) {
      const int32_t tag = calls[i].data[0].tokens[0];
      if (tag == 98) results[i] = Status::Invalid("loss_fn_inputs: the loss is not finite (injected)");
      if (tag == 97) results[i] = Status::Internal("forward_backward: CUDA out of memory (injected)");
      if (results[i].ok() && !calls[i].forward_only) accumulated_[calls[i].slot] += calls[i].data.size();
    }
    return results;
  }

  std::vector<Result<engine::OptimStepOutput>> OptimStep(const std::vector<engine::OptimStepCall>& calls) override {
    {
      std::lock_guard<std::mutex> lock(mu2_);
      for (const auto& c : calls) {
        stepped_[c.slot].push_back(accumulated_[c.slot]);
        accumulated_[c.slot] = 0;
      }
    }
    return FakeEngine::OptimStep(calls);
  }

  // Gradient marks over the datum counts, as the real engine keeps them
  // over the gradient rows.
  void MarkGrad(int slot) override {
    FakeEngine::MarkGrad(slot);
    std::lock_guard<std::mutex> lock(mu2_);
    marks_[slot] = accumulated_[slot];
  }
  void RollbackGrad(int slot) override {
    FakeEngine::RollbackGrad(slot);
    std::lock_guard<std::mutex> lock(mu2_);
    auto it = marks_.find(slot);
    if (it == marks_.end()) return;
    accumulated_[slot] = it->second;
    marks_.erase(it);
  }
  void ForgetGradMark(int slot) override {
    FakeEngine::ForgetGradMark(slot);
    std::lock_guard<std::mutex> lock(mu2_);
    marks_.erase(slot);
  }

  // Datums of gradient accumulated in a slot since its last optim_step.
  size_t accumulated(int slot) const {
    std::lock_guard<std::mutex> lock(mu2_);
    auto it = accumulated_.find(slot);
    return it == accumulated_.end() ? 0 : it->second;
  }
  // Per optim_step of a slot: how many datums its gradient held.
  std::vector<size_t> stepped(int slot) const {
    std::lock_guard<std::mutex> lock(mu2_);
    auto it = stepped_.find(slot);
    return it == stepped_.end() ? std::vector<size_t>{} : it->second;
  }
  // Per engine forward_backward call: the datum count of each of its calls.
  std::vector<std::vector<size_t>> pass_datums() const {
    std::lock_guard<std::mutex> lock(mu2_);
    return pass_datums_;
  }

 private:
  mutable std::mutex mu2_;
  std::map<int, size_t> accumulated_;
  std::map<int, size_t> marks_;
  std::map<int, std::vector<size_t>> stepped_;
  std::vector<std::vector<size_t>> pass_datums_;
};

class SchedFixture : public ::testing::Test {
 protected:
  void Open(int64_t token_budget, int slots = 8,
            std::chrono::milliseconds batch_window = service::ServiceOptions{}.batch_window) {
    service::ServiceOptions options;
    options.token_budget = token_budget;
    options.batch_window = batch_window;
    OpenWith(options, slots);
  }
  // Any options; the base model and a 20 ms janitor period are the fixture's.
  void OpenWith(service::ServiceOptions options, int slots) {
    options.base_model_name = "test/base";
    options.janitor_period = std::chrono::milliseconds(20);
    auto engine = std::make_unique<FaultEngine>(slots);
    engine_ = engine.get();
    auto registry = store::Registry::Open(dir_);
    ASSERT_TRUE(registry.ok()) << registry.status().message();
    service_ = std::make_unique<service::Service>(options, std::move(engine), std::move(*registry));
    service_->Start();
  }
  void TearDown() override {
    service_.reset();
    std::filesystem::remove_all(dir_);
  }

  service::FutureView Wait(const std::string& tenant, const std::string& id) {
    return WaitWhile(tenant, id, [] {});
  }
  // Wait, calling `meanwhile` on every look (e.g. to send heartbeats).
  template <class Meanwhile>
  service::FutureView WaitWhile(const std::string& tenant, const std::string& id, Meanwhile meanwhile) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < deadline) {
      auto v = service_->futures().Get(tenant, id);
      EXPECT_TRUE(v.ok()) << v.status().message();
      if (!v.ok()) return {};
      if (v->state != service::FutureState::kPending) return *v;
      meanwhile();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ADD_FAILURE() << "future " << id << " still pending";
    return {};
  }

  // A session and a trained model for `tenant`; returns the model id.
  std::string NewModel(const std::string& tenant) {
    auto sub = SubmitModel(tenant, NewSession(tenant));
    EXPECT_EQ(Wait(tenant, sub.request_id).state, service::FutureState::kDone);
    return sub.model_id;
  }
  std::string NewSession(const std::string& tenant) {
    auto session = service_->CreateSession({tenant, ""}, {});
    EXPECT_TRUE(session.ok());
    return session.ok() ? *session : "";
  }
  static tinker::CreateModelRequest CreateRequest(const std::string& session, int64_t seq = 0) {
    tinker::CreateModelRequest req;
    req.session_id = session;
    req.model_seq_id = seq;
    req.base_model = "test/base";
    req.lora.rank = 4;
    return req;
  }
  // A create_model submitted (not awaited).
  service::Submitted SubmitModel(const std::string& tenant, const std::string& session, int64_t seq = 0) {
    auto sub = service_->CreateModel({tenant, ""}, CreateRequest(session, seq));
    EXPECT_TRUE(sub.ok()) << sub.status().message();
    return sub.ok() ? *sub : service::Submitted{};
  }
  service::FutureState StateOf(const std::string& tenant, const std::string& id) const {
    auto v = service_->futures().Get(tenant, id);
    EXPECT_TRUE(v.ok()) << v.status().message();
    return v.ok() ? v->state : service::FutureState::kFailed;
  }

  // A forward_backward whose datum i has lengths[i] tokens; the first token
  // of every datum is `tag`, the rest count up (so outputs can be told apart).
  static tinker::ForwardBackwardRequest Fb(const std::string& model, int64_t seq, int32_t tag,
                                         const std::vector<int>& lengths, const std::string& loss = "cross_entropy") {
    tinker::ForwardBackwardRequest r;
    r.model_id = model;
    r.seq_id = seq;
    r.call.loss_fn = loss;
    for (int n : lengths) {
      engine::Datum d;
      d.tokens.push_back(tag);
      for (int t = 1; t < n; ++t) d.tokens.push_back(t % 90);
      r.call.data.push_back(d);
    }
    return r;
  }

  std::string Submit(const std::string& tenant, tinker::ForwardBackwardRequest r) {
    auto sub = service_->ForwardBackward({tenant, ""}, std::move(r));
    EXPECT_TRUE(sub.ok()) << sub.status().message();
    return sub.ok() ? sub->request_id : "";
  }

  std::string Optim(const std::string& tenant, const std::string& model, int64_t seq) {
    tinker::OptimStepRequest o;
    o.model_id = model;
    o.seq_id = seq;
    auto sub = service_->OptimStep({tenant, ""}, o);
    EXPECT_TRUE(sub.ok()) << sub.status().message();
    return sub.ok() ? sub->request_id : "";
  }

  std::string dir_ = [] {
    auto d = std::filesystem::temp_directory_path() /
             ("loom_sched_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
              std::to_string(::getpid()));
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d);
    return d.string();
  }();
  FaultEngine* engine_ = nullptr;
  std::unique_ptr<service::Service> service_;
};

}  // namespace loom::testing
