// Several base models in one Service (BaseModel bundles over FakeEngines and
// FakeSamplers): create_model and sampling sessions route by base_model, each
// base model has its own slots, an unknown base_model is a 400 naming the
// field and the served names, model ids stay unique across base models, and
// another tenant's model on any base model is "not found".
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <thread>

#include "fake_engine.h"
#include "fake_sampler.h"
#include "wait_future.h"
#include "service/service.h"

namespace loom::service {
namespace {

using namespace std::chrono_literals;

class BaseModelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            ("loom_base_models_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
             std::to_string(::getpid())))
               .string();
    std::filesystem::remove_all(dir_);
    auto registry = store::Registry::Open(dir_);
    ASSERT_TRUE(registry.ok());
    ServiceOptions so;
    so.janitor_period = 20ms;
    so.capacity_wait = 0ms;  // a full base model refuses at once: its slots are its own
    std::vector<BaseModelSpec> bases;
    bases.push_back({"teacher", std::make_unique<testing::FakeEngine>(/*slots=*/2), 0});
    bases.push_back({"student", std::make_unique<testing::FakeEngine>(/*slots=*/1), 0});
    service_ = std::make_unique<Service>(so, std::move(bases), std::move(*registry));
    auto teacher = std::make_unique<testing::FakeSampler>(100, 32);
    auto student = std::make_unique<testing::FakeSampler>(100, 32);
    teacher_sampler_ = teacher.get();
    student_sampler_ = student.get();
    ASSERT_TRUE(service_->AttachSampler(std::move(teacher), "teacher").ok());
    ASSERT_TRUE(service_->AttachSampler(std::move(student), "student").ok());
    EXPECT_FALSE(service_->AttachSampler(std::make_unique<testing::FakeSampler>(), "nobody").ok());
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
  Result<Submitted> Create(const std::string& tenant, const std::string& session, const std::string& base, int seq) {
    tinker::CreateModelRequest req;
    req.session_id = session;
    req.model_seq_id = seq;
    req.base_model = base;
    req.lora.rank = 4;
    return service_->CreateModel({tenant, ""}, req);
  }
  std::string Model(const std::string& tenant, const std::string& session, const std::string& base, int seq) {
    auto sub = Create(tenant, session, base, seq);
    EXPECT_TRUE(sub.ok()) << sub.status().message();
    if (!sub.ok()) return "";
    EXPECT_EQ(Wait(tenant, sub->request_id).state, FutureState::kDone);
    return sub->model_id;
  }

  std::string dir_;
  std::unique_ptr<Service> service_;
  testing::FakeSampler* teacher_sampler_ = nullptr;
  testing::FakeSampler* student_sampler_ = nullptr;
};

TEST_F(BaseModelsTest, ListsEveryBaseModelInOrder) {
  ASSERT_EQ(service_->bases().size(), 2u);
  EXPECT_EQ(service_->bases()[0]->name, "teacher");
  EXPECT_EQ(service_->bases()[1]->name, "student");
  EXPECT_EQ(service_->bases()[0]->options.base_model_name, "teacher");
  EXPECT_EQ(service_->bases()[1]->options.base_model_name, "student");
}

TEST_F(BaseModelsTest, EachBaseModelHasItsOwnSlots) {
  const std::string s = Session("alice");
  const std::string on_student = Model("alice", s, "student", 0);
  // The student's one slot is taken: refused there (capacity_wait 0) ...
  auto full = Create("alice", s, "student", 1);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), Code::kUnavailable);
  EXPECT_NE(full.status().message().find("all 1 are bound"), std::string::npos) << full.status().message();
  // ... while the teacher still has both of its own.
  Model("alice", s, "teacher", 2);
  Model("alice", s, "teacher", 3);
  EXPECT_EQ(service_->slots_in_use(), 3);
  auto info = service_->GetInfo({"alice", ""}, on_student);
  ASSERT_TRUE(info.ok()) << info.status().message();
  EXPECT_EQ(info->model_data.model_name, "student");
  EXPECT_EQ(info->model_data.tokenizer_id, "student");
  // Unloading the student's model frees the student's slot for the next one.
  ASSERT_TRUE(service_->UnloadModel({"alice", ""}, on_student).ok());
  Model("alice", s, "student", 4);
}

TEST_F(BaseModelsTest, UnknownBaseModelIsA400ListingTheServedNames) {
  const std::string s = Session("alice");
  auto bad = Create("alice", s, "other/base", 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(bad.status().message(),
            "create_model.base_model: 'other/base' is not served here; this server serves 'teacher', 'student'");
  tinker::CreateSamplingSessionRequest sreq;
  sreq.session_id = s;
  sreq.base_model = "other/base";
  auto sampling = service_->CreateSamplingSession({"alice", ""}, sreq);
  ASSERT_FALSE(sampling.ok());
  EXPECT_EQ(sampling.status().code(), Code::kInvalidArgument);
  EXPECT_NE(sampling.status().message().find("create_sampling_session.base_model: 'other/base' is not served here"),
            std::string::npos)
      << sampling.status().message();
  EXPECT_EQ(service_->slots_in_use(), 0);
}

TEST_F(BaseModelsTest, AModelIdNamesOneModelAcrossBaseModels) {
  const std::string s = Session("alice");
  Model("alice", s, "teacher", 0);
  auto again = Create("alice", s, "student", 0);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), Code::kInvalidArgument);
  EXPECT_NE(again.status().message().find("create_model.model_seq_id: 0 already names model"), std::string::npos)
      << again.status().message();
  EXPECT_EQ(service_->slots_in_use(), 1);
}

TEST_F(BaseModelsTest, AnotherTenantsModelOnAnyBaseIsNotFound) {
  const std::string s = Session("alice");
  const std::string teacher = Model("alice", s, "teacher", 0);
  const std::string student = Model("alice", s, "student", 1);
  for (const std::string& id : {teacher, student}) {
    EXPECT_TRUE(service_->GetInfo({"alice", ""}, id).ok()) << id;
    auto theirs = service_->GetInfo({"bob", ""}, id);
    ASSERT_FALSE(theirs.ok());
    EXPECT_EQ(theirs.status().code(), Code::kNotFound);
    tinker::OptimStepRequest step;
    step.model_id = id;
    step.seq_id = 1;
    auto optim = service_->OptimStep({"bob", ""}, step);
    ASSERT_FALSE(optim.ok());
    EXPECT_EQ(optim.status().code(), Code::kNotFound);
  }
  // Alice's own steps run on each model's base model.
  for (const std::string& id : {teacher, student}) {
    tinker::OptimStepRequest step;
    step.model_id = id;
    step.seq_id = 1;
    auto optim = service_->OptimStep({"alice", ""}, step);
    ASSERT_TRUE(optim.ok()) << optim.status().message();
    EXPECT_EQ(Wait("alice", optim->request_id).state, FutureState::kDone);
  }
}

TEST_F(BaseModelsTest, SamplesGoToTheSamplingSessionsBaseModel) {
  const std::string s = Session("alice");
  std::map<std::string, std::string> sessions;
  int n = 0;
  for (const std::string base : {"teacher", "student"}) {
    tinker::CreateSamplingSessionRequest req;
    req.session_id = s;
    req.sampling_session_seq_id = n++;
    req.base_model = base;
    auto id = service_->CreateSamplingSession({"alice", ""}, req);
    ASSERT_TRUE(id.ok()) << id.status().message();
    auto info = service_->GetSampler({"alice", ""}, *id);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->base_model, base);
    sessions[base] = *id;
  }
  auto sample = [&](const std::string& base, int64_t seq) {
    tinker::SampleRequest req;
    req.sampling_session_id = sessions[base];
    req.seq_id = seq;
    req.num_samples = 1;
    req.prompt = {1, 2, 3};
    req.sampling_params.max_tokens = 2;
    auto sub = service_->Sample({"alice", ""}, req);
    ASSERT_TRUE(sub.ok()) << sub.status().message();
    EXPECT_EQ(Wait("alice", sub->request_id).state, FutureState::kDone);
  };
  sample("student", 0);
  sample("student", 1);
  sample("teacher", 0);
  ASSERT_EQ(student_sampler_->calls().size(), 2u);
  ASSERT_EQ(teacher_sampler_->calls().size(), 1u);
  EXPECT_EQ(student_sampler_->calls()[0].session, sessions["student"]);
  EXPECT_EQ(teacher_sampler_->calls()[0].session, sessions["teacher"]);
}

}  // namespace
}  // namespace loom::service
