// Tests of the SQLite registry: CRUD, pagination, ownership, TTL sweeps,
// checkpoint files, name validation, restart, and kill -9 at every step of a
// save (in a forked child) followed by the start-up reconciliation.
#include "store/registry.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <limits>
#include <set>
#include <thread>

#include "store/dir_names.h"
#include "store/sqlite.h"
#include "store_test_util.h"

namespace loom::store {
namespace {

namespace fs = std::filesystem;
using testing::Bytes;
using testing::ReadFile;
using testing::TempDir;
using testing::WriteFile;
using tinker::kSamplerWeightsKind;
using tinker::kWeightsKind;
using tinker::TinkerPath;
constexpr TinkerPath::Kind kTraining = TinkerPath::Kind::kTraining;
constexpr TinkerPath::Kind kSampler = TinkerPath::Kind::kSampler;

TrainingRun MakeRun(const std::string& owner, const std::string& model_id, int64_t created_ms) {
  TrainingRun r;
  r.owner = owner;
  r.model_id = model_id;
  r.base_model = "Qwen/Qwen3-0.6B";
  r.lora_rank = 8;
  r.train_unembed = false;
  r.created_ms = created_ms;
  r.last_request_ms = created_ms;
  r.user_metadata = R"({"task":"t"})";
  return r;
}

std::unique_ptr<Registry> OpenOrDie(const std::string& dir) {
  auto r = Registry::Open(dir);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r.value()) : nullptr;
}

// Writes PEFT-like files into a fresh staging dir and commits them.
Result<Checkpoint> Save(Registry& reg, const std::string& owner, const std::string& model_id,
                        const std::string& kind, const std::string& name, int64_t created_ms,
                        size_t weight_bytes = 1000, std::optional<int64_t> expires_ms = {},
                        bool overwrite = false) {
  auto staging = reg.NewStagingDir();
  if (!staging.ok()) return staging.status();
  WriteFile(fs::path(staging.value()) / "adapter_model.safetensors", Bytes(weight_bytes, 7));
  WriteFile(fs::path(staging.value()) / "adapter_config.json", R"({"r":8})");
  CheckpointSpec spec;
  spec.owner = owner;
  spec.model_id = model_id;
  spec.kind = kind;
  spec.name = name;
  spec.created_ms = created_ms;
  spec.expires_ms = expires_ms;
  spec.overwrite = overwrite;
  return reg.CommitCheckpoint(staging.value(), spec);
}

TEST(RegistryTest, RunCrud) {
  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  ASSERT_TRUE(reg->UpsertRun(MakeRun("alice", "s1:train:0", 1000)).ok());
  auto got = reg->GetRun("s1:train:0");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->owner, "alice");
  EXPECT_EQ(got->base_model, "Qwen/Qwen3-0.6B");
  EXPECT_EQ(got->lora_rank, 8);
  EXPECT_TRUE(got->train_attn);
  EXPECT_FALSE(got->train_unembed);
  EXPECT_EQ(got->user_metadata, R"({"task":"t"})");

  TrainingRun changed = MakeRun("alice", "s1:train:0", 1000);
  changed.lora_rank = 16;
  ASSERT_TRUE(reg->UpsertRun(changed).ok());
  EXPECT_EQ(reg->GetRun("s1:train:0")->lora_rank, 16);
  ASSERT_TRUE(reg->TouchRun("s1:train:0", 5000).ok());
  EXPECT_EQ(reg->GetRun("s1:train:0")->last_request_ms, 5000);
  EXPECT_EQ(reg->TouchRun("nope", 1).code(), Code::kNotFound);
  EXPECT_EQ(reg->GetRun("nope").status().code(), Code::kNotFound);

  EXPECT_EQ(reg->UpsertRun(MakeRun("", "m", 1)).code(), Code::kInvalidArgument);
  EXPECT_EQ(reg->UpsertRun(MakeRun("a", "bad/id", 1)).code(), Code::kInvalidArgument);
  TrainingRun rank0 = MakeRun("a", "m", 1);
  rank0.lora_rank = 0;
  Status s = reg->UpsertRun(rank0);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("lora_rank"), std::string::npos);
}

TEST(RegistryTest, ListRunsPaginatesNewestFirstPerOwner) {
  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  for (int i = 1; i <= 5; ++i) ASSERT_TRUE(reg->UpsertRun(MakeRun("alice", "a" + std::to_string(i), i)).ok());
  for (int i = 1; i <= 2; ++i) ASSERT_TRUE(reg->UpsertRun(MakeRun("bob", "b" + std::to_string(i), i)).ok());

  auto page = reg->ListRuns("alice", {2, 0});
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(page->total, 5);
  ASSERT_EQ(page->items.size(), 2u);
  EXPECT_EQ(page->items[0].model_id, "a5");
  EXPECT_EQ(page->items[1].model_id, "a4");
  auto tail = reg->ListRuns("alice", {2, 4});
  ASSERT_TRUE(tail.ok());
  ASSERT_EQ(tail->items.size(), 1u);
  EXPECT_EQ(tail->items[0].model_id, "a1");
  EXPECT_EQ(tail->total, 5);
  EXPECT_EQ(reg->ListRuns("alice", {-1, 0})->items.size(), 5u);
  auto bob = reg->ListRuns("bob", {20, 0});
  EXPECT_EQ(bob->total, 2);
  for (const auto& r : bob->items) EXPECT_EQ(r.owner, "bob");
  EXPECT_EQ(reg->ListRuns("carol", {20, 0})->total, 0);
  EXPECT_EQ(reg->ListRuns("alice", {20, -1}).status().code(), Code::kInvalidArgument);
}

TEST(RegistryTest, CommitPublishesFilesAtomicallyAndRecordsSize) {
  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  auto c = Save(*reg, "alice", "s1:train:0", kWeightsKind, "step_1", 100, 1000);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->tinker_path, "tinker://s1:train:0/weights/step_1");
  EXPECT_EQ(c->checkpoint_id(), "weights/step_1");
  EXPECT_EQ(c->dir, (fs::path(reg->data_dir()) / "runs" / "s1_3Atrain_3A0" / "weights" / "step_1").string());
  EXPECT_EQ(c->dir, reg->CheckpointDir("s1:train:0", kWeightsKind, "step_1").value());
  EXPECT_EQ(c->size_bytes, 1000 + 7);
  EXPECT_EQ(ReadFile(fs::path(c->dir) / "adapter_model.safetensors"), Bytes(1000, 7));
  EXPECT_TRUE(fs::is_empty(fs::path(reg->data_dir()) / "staging"));

  auto byPath = reg->GetCheckpoint(*tinker::ParseTinkerPath("tinker://s1:train:0/weights/step_1"));
  ASSERT_TRUE(byPath.ok());
  EXPECT_EQ(byPath->size_bytes, c->size_bytes);
  EXPECT_EQ(byPath->dir, c->dir);
  EXPECT_FALSE(byPath->expires_ms.has_value());
  EXPECT_EQ(reg->GetCheckpoint(*tinker::ParseTinkerPath("tinker://s1:train:0/sampler_weights/step_1")).status().code(),
            Code::kNotFound);

  // A second save under the same name: refused unless overwrite, and the
  // refused staging files are cleaned up while the original stays intact.
  auto dup = Save(*reg, "alice", "s1:train:0", kWeightsKind, "step_1", 200, 50);
  EXPECT_EQ(dup.status().code(), Code::kAlreadyExists);
  EXPECT_TRUE(fs::is_empty(fs::path(reg->data_dir()) / "staging"));
  EXPECT_EQ(ReadFile(fs::path(c->dir) / "adapter_model.safetensors"), Bytes(1000, 7));
  auto over = Save(*reg, "alice", "s1:train:0", kWeightsKind, "step_1", 300, 50, {}, true);
  ASSERT_TRUE(over.ok()) << over.status().message();
  EXPECT_EQ(over->size_bytes, 50 + 7);
  EXPECT_EQ(ReadFile(fs::path(over->dir) / "adapter_model.safetensors"), Bytes(50, 7));
  EXPECT_EQ(reg->ListCheckpoints("s1:train:0", {-1, 0})->total, 1);
  EXPECT_TRUE(fs::is_empty(fs::path(reg->data_dir()) / "trash"));
}

TEST(RegistryTest, BadNamesAreRejectedNamingTheField) {
  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  for (const std::string& bad : std::vector<std::string>{"../escape", "a/b", "", "..", "white space", std::string(129, 'n')}) {
    auto c = Save(*reg, "alice", "m1", kWeightsKind, bad, 1);
    EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << bad;
    EXPECT_NE(c.status().message().find("name"), std::string::npos) << c.status().message();
  }
  auto kind = Save(*reg, "alice", "m1", "optimizer", "x", 1);
  EXPECT_EQ(kind.status().code(), Code::kInvalidArgument);
  EXPECT_NE(kind.status().message().find("kind"), std::string::npos);
  auto model = Save(*reg, "alice", "../m1", kWeightsKind, "x", 1);
  EXPECT_EQ(model.status().code(), Code::kInvalidArgument);
  EXPECT_NE(model.status().message().find("model_id"), std::string::npos);
  // Nothing escaped the data dir and no staging leftovers remain.
  EXPECT_FALSE(fs::exists(fs::path(tmp.path()).parent_path() / "escape"));
  EXPECT_TRUE(fs::is_empty(fs::path(reg->data_dir()) / "staging"));
  EXPECT_TRUE(fs::is_empty(fs::path(reg->data_dir()) / "runs"));
  // A folder that NewStagingDir did not make is refused.
  fs::create_directories(fs::path(tmp.path()) / "elsewhere");
  CheckpointSpec spec{"alice", "m1", kWeightsKind, "x"};
  EXPECT_EQ(reg->CommitCheckpoint((fs::path(tmp.path()) / "elsewhere").string(), spec).status().code(),
            Code::kInvalidArgument);
}

TEST(RegistryTest, ListsCheckpointsPerRunAndPerOwnerNewestFirst) {
  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  ASSERT_TRUE(Save(*reg, "alice", "a1", kWeightsKind, "s1", 10).ok());
  ASSERT_TRUE(Save(*reg, "alice", "a1", kSamplerWeightsKind, "s1", 20).ok());
  ASSERT_TRUE(Save(*reg, "alice", "a2", kWeightsKind, "s1", 30).ok());
  ASSERT_TRUE(Save(*reg, "alice", "a1", kWeightsKind, "s2", 40).ok());
  ASSERT_TRUE(Save(*reg, "bob", "b1", kWeightsKind, "s1", 50).ok());

  auto run = reg->ListCheckpoints("a1", {-1, 0});
  ASSERT_TRUE(run.ok());
  EXPECT_EQ(run->total, 3);
  ASSERT_EQ(run->items.size(), 3u);
  EXPECT_EQ(run->items[0].checkpoint_id(), "weights/s2");
  EXPECT_EQ(run->items[1].checkpoint_id(), "sampler_weights/s1");
  EXPECT_EQ(run->items[2].checkpoint_id(), "weights/s1");
  for (const auto& c : run->items) EXPECT_TRUE(fs::is_directory(c.dir));

  auto mine = reg->ListOwnerCheckpoints("alice", {2, 1});
  ASSERT_TRUE(mine.ok());
  EXPECT_EQ(mine->total, 4);
  ASSERT_EQ(mine->items.size(), 2u);
  EXPECT_EQ(mine->items[0].tinker_path, "tinker://a2/weights/s1");
  EXPECT_EQ(mine->items[1].tinker_path, "tinker://a1/sampler_weights/s1");
  auto bob = reg->ListOwnerCheckpoints("bob", {20, 0});
  ASSERT_EQ(bob->items.size(), 1u);
  EXPECT_EQ(bob->items[0].owner, "bob");
}

TEST(RegistryTest, DeleteRemovesFilesThenRow) {
  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  auto c = Save(*reg, "alice", "a1", kSamplerWeightsKind, "final", 10);
  ASSERT_TRUE(c.ok());
  const TinkerPath p{"a1", kSampler, "final"};
  ASSERT_TRUE(reg->DeleteCheckpoint(p).ok());
  EXPECT_FALSE(fs::exists(c->dir));
  EXPECT_TRUE(fs::is_empty(fs::path(reg->data_dir()) / "trash"));
  EXPECT_EQ(reg->GetCheckpoint(p).status().code(), Code::kNotFound);
  EXPECT_EQ(reg->DeleteCheckpoint(p).code(), Code::kNotFound);
  EXPECT_EQ(reg->ListCheckpoints("a1", {-1, 0})->total, 0);
}

TEST(RegistryTest, PublicFlagAndAccess) {
  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  ASSERT_TRUE(Save(*reg, "alice", "a1", kWeightsKind, "w", 10).ok());
  const TinkerPath p{"a1", kTraining, "w"};
  EXPECT_TRUE(reg->GetCheckpoint(p)->AccessibleBy("alice"));
  EXPECT_FALSE(reg->GetCheckpoint(p)->AccessibleBy("bob"));
  ASSERT_TRUE(reg->SetPublic(p, true).ok());
  ASSERT_TRUE(reg->SetPublic(p, true).ok());  // idempotent
  EXPECT_TRUE(reg->GetCheckpoint(p)->is_public);
  EXPECT_TRUE(reg->GetCheckpoint(p)->AccessibleBy("bob"));
  ASSERT_TRUE(reg->SetPublic(p, false).ok());
  EXPECT_FALSE(reg->GetCheckpoint(p)->AccessibleBy("bob"));
  EXPECT_EQ(reg->SetPublic(TinkerPath{"a1", kTraining, "none"}, true).code(), Code::kNotFound);
  EXPECT_EQ(reg->SetPublic(TinkerPath{"a1", kTraining, "../x"}, true).code(), Code::kInvalidArgument);
}

TEST(RegistryTest, TtlSweepDeletesExpiredFilesAndRows) {
  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  auto early = Save(*reg, "alice", "a1", kWeightsKind, "early", 1, 10, 100);
  auto late = Save(*reg, "alice", "a1", kWeightsKind, "late", 2, 10, 200);
  auto forever = Save(*reg, "alice", "a1", kWeightsKind, "forever", 3, 10);
  auto cleared = Save(*reg, "alice", "a1", kWeightsKind, "cleared", 4, 10, 50);
  ASSERT_TRUE(early.ok() && late.ok() && forever.ok() && cleared.ok());
  EXPECT_EQ(early->expires_ms, std::optional<int64_t>(100));
  ASSERT_TRUE(reg->SetExpiry(TinkerPath{"a1", kTraining, "cleared"}, std::nullopt).ok());
  EXPECT_FALSE(reg->GetCheckpoint(TinkerPath{"a1", kTraining, "cleared"})->expires_ms.has_value());
  EXPECT_EQ(reg->SetExpiry(TinkerPath{"a1", kTraining, "nope"}, 5).code(), Code::kNotFound);

  auto first = reg->SweepExpired(150);
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->size(), 1u);
  EXPECT_EQ((*first)[0].name, "early");
  EXPECT_EQ((*first)[0].dir, early->dir);
  EXPECT_FALSE(fs::exists(early->dir));
  EXPECT_TRUE(fs::exists(late->dir));

  auto second = reg->SweepExpired(1'000'000);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(second->size(), 1u);
  EXPECT_EQ((*second)[0].name, "late");
  EXPECT_FALSE(fs::exists(late->dir));
  EXPECT_TRUE(fs::exists(forever->dir));
  EXPECT_TRUE(fs::exists(cleared->dir));
  EXPECT_EQ(reg->ListCheckpoints("a1", {-1, 0})->total, 2);
  EXPECT_TRUE(reg->SweepExpired(2'000'000)->empty());
}

TEST(RegistryTest, SessionsPerOwner) {
  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  ASSERT_TRUE(reg->AddSession({"alice", "sa1", 1, "{}"}).ok());
  ASSERT_TRUE(reg->AddSession({"alice", "sa2", 2, R"({"k":"v"})"}).ok());
  ASSERT_TRUE(reg->AddSession({"bob", "sb1", 3, "{}"}).ok());
  auto alice = reg->ListSessions("alice", {1, 0});
  ASSERT_TRUE(alice.ok());
  EXPECT_EQ(alice->total, 2);
  ASSERT_EQ(alice->items.size(), 1u);
  EXPECT_EQ(alice->items[0].session_id, "sa2");
  EXPECT_EQ(reg->GetSession("sa2")->user_metadata, R"({"k":"v"})");
  EXPECT_EQ(reg->GetSession("sb1")->owner, "bob");
  EXPECT_EQ(reg->GetSession("zz").status().code(), Code::kNotFound);
  EXPECT_EQ(reg->AddSession({"", "x", 1, "{}"}).code(), Code::kInvalidArgument);
}

TEST(RegistryTest, RestartKeepsEverythingAndClearsLeftovers) {
  TempDir tmp;
  std::string dir_of_kept, dir_of_lost;
  {
    auto reg = OpenOrDie(tmp.path());
    ASSERT_TRUE(reg);
    // A second process on the same data dir is refused while this one lives.
    EXPECT_EQ(Registry::Open(tmp.path()).status().code(), Code::kUnavailable);
    ASSERT_TRUE(reg->UpsertRun(MakeRun("alice", "s:train:0", 10)).ok());
    ASSERT_TRUE(reg->AddSession({"alice", "s", 5, "{}"}).ok());
    auto kept = Save(*reg, "alice", "s:train:0", kWeightsKind, "kept", 20, 300, 9999);
    auto pub = Save(*reg, "alice", "s:train:0", kSamplerWeightsKind, "pub", 30);
    auto lost = Save(*reg, "alice", "s:train:0", kWeightsKind, "lost", 40);
    ASSERT_TRUE(kept.ok() && pub.ok() && lost.ok());
    ASSERT_TRUE(reg->SetPublic(TinkerPath{"s:train:0", kSampler, "pub"}, true).ok());
    dir_of_kept = kept->dir;
    dir_of_lost = lost->dir;
    // A save that was being written when the process died.
    auto staging = reg->NewStagingDir();
    ASSERT_TRUE(staging.ok());
    WriteFile(fs::path(staging.value()) / "half.bin", "xx");
  }
  fs::remove_all(dir_of_lost);  // files lost behind the registry's back
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  auto run = reg->GetRun("s:train:0");
  ASSERT_TRUE(run.ok());
  EXPECT_EQ(run->lora_rank, 8);
  EXPECT_EQ(reg->ListSessions("alice", {20, 0})->total, 1);
  auto ckpts = reg->ListCheckpoints("s:train:0", {-1, 0});
  ASSERT_TRUE(ckpts.ok());
  ASSERT_EQ(ckpts->total, 2);  // the one without files is dropped
  EXPECT_EQ(ckpts->items[0].name, "pub");
  EXPECT_TRUE(ckpts->items[0].is_public);
  EXPECT_EQ(ckpts->items[1].name, "kept");
  EXPECT_EQ(ckpts->items[1].expires_ms, std::optional<int64_t>(9999));
  EXPECT_EQ(ckpts->items[1].size_bytes, 300 + 7);
  EXPECT_EQ(ckpts->items[1].dir, dir_of_kept);
  EXPECT_EQ(ReadFile(fs::path(dir_of_kept) / "adapter_model.safetensors"), Bytes(300, 7));
  EXPECT_TRUE(fs::is_empty(fs::path(reg->data_dir()) / "staging"));
}

TEST(RegistryTest, ConcurrentCallersSeeConsistentCounts) {
  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const std::string owner = "tenant" + std::to_string(t);
      for (int i = 0; i < 25; ++i) {
        const std::string id = owner + ":train:" + std::to_string(i);
        EXPECT_TRUE(reg->UpsertRun(MakeRun(owner, id, i)).ok());
        EXPECT_TRUE(Save(*reg, owner, id, kSamplerWeightsKind, "s", i, 16).ok());
        EXPECT_EQ(reg->ListRuns(owner, {1, 0})->total, i + 1);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(reg->ListOwnerCheckpoints("tenant" + std::to_string(t), {-1, 0})->total, 25);
  }
}

TEST(RegistryTest, HugeTtlSaturatesInsteadOfWrappingIntoThePast) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  const int64_t now = 1'700'000'000'000;
  EXPECT_EQ(ExpiryMs(now, 60), now + 60'000);
  EXPECT_EQ(ExpiryMs(now, kMax), kMaxExpiryMs);         // ttl * 1000 overflows
  EXPECT_EQ(ExpiryMs(now, kMax / 1000), kMaxExpiryMs);  // now + ttl_ms overflows
  EXPECT_EQ(ExpiryMs(kMax, 1), kMaxExpiryMs);
  EXPECT_EQ(ExpiryMs(now, kMin), kMin + now);  // ttl * 1000 saturates: long expired, no UB
  EXPECT_EQ(ExpiryMs(kMin, -1), kMin);

  TempDir tmp;
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  auto huge = Save(*reg, "alice", "a1", kWeightsKind, "huge", now, 10, ExpiryMs(now, kMax));
  auto raw = Save(*reg, "alice", "a1", kWeightsKind, "raw", now, 10, kMax);  // clamped on the way in
  ASSERT_TRUE(huge.ok() && raw.ok());
  EXPECT_EQ(raw->expires_ms, std::optional<int64_t>(kMaxExpiryMs));
  ASSERT_TRUE(reg->SetExpiry(TinkerPath{"a1", kTraining, "raw"}, kMax).ok());
  EXPECT_EQ(reg->GetCheckpoint(TinkerPath{"a1", kTraining, "raw"})->expires_ms, std::optional<int64_t>(kMaxExpiryMs));
  const int64_t century_ms = int64_t{100} * 365 * 24 * 3600 * 1000;
  auto swept = reg->SweepExpired(now + century_ms);
  ASSERT_TRUE(swept.ok());
  EXPECT_TRUE(swept->empty());
  EXPECT_EQ(reg->ListCheckpoints("a1", {-1, 0})->total, 2);
}

// ------------------------------------------------------------ crash safety

constexpr int kFinished = 0;
constexpr int kCrashed = 42;
constexpr int kSetupFailed = 3;

// Runs body in a forked child that _exits with its result. _exit at a step
// stands for kill -9: no destructors run and nothing is flushed, so the disk
// holds exactly what a killed loom leaves. Returns the exit code, -1 if none.
int RunInChild(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// In a child: optionally saves m:train:0/weights/ckpt (100 bytes, t=10), then
// saves it (again) with 200 bytes at t=20 and dies after the crash_at-th step
// that CommitCheckpoint reports; the step's name goes to <dir>/crashed_at.
int SaveAndDie(const std::string& dir, bool save_first, int crash_at) {
  return RunInChild([&] {
    auto reg = Registry::Open(dir);
    if (!reg.ok()) return kSetupFailed;
    if (save_first && !Save(**reg, "alice", "m:train:0", kWeightsKind, "ckpt", 10, 100).ok()) return kSetupFailed;
    int seen = 0;
    (*reg)->SetStepHookForTest([&](std::string_view step) {
      if (seen++ != crash_at) return;
      WriteFile(fs::path(dir) / "crashed_at", std::string(step));
      ::_exit(kCrashed);
    });
    return Save(**reg, "alice", "m:train:0", kWeightsKind, "ckpt", 20, 200, {}, save_first).ok() ? kFinished
                                                                                                 : kSetupFailed;
  });
}

// Every directory under runs/<model>/weights/.
std::set<std::string> CheckpointDirsOnDisk(const std::string& data_dir) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fs::path(data_dir) / "runs" / SanitizeForPath("m:train:0") / "weights", ec)) {
    out.insert(e.path().string());
  }
  return out;
}

// Kills SaveAndDie(save_first)'s child after each step in turn, until a run
// finishes before its kill step; after each, reopens the data dir, checks that
// staging/ and trash/ are empty, and hands the registry to check.
void AfterAKillAtEveryStep(bool save_first, const std::function<void(Registry& reg, bool finished)>& check) {
  bool finished = false;
  for (int crash_at = 0; crash_at < 32 && !finished; ++crash_at) {
    TempDir tmp;
    const int rc = SaveAndDie(tmp.path(), save_first, crash_at);
    ASSERT_TRUE(rc == kCrashed || rc == kFinished) << "child exit " << rc;
    finished = rc == kFinished;
    const std::string step = finished ? "none (finished)" : ReadFile(fs::path(tmp.path()) / "crashed_at");
    SCOPED_TRACE("killed after step " + std::to_string(crash_at) + ": " + step);
    auto reg = OpenOrDie(tmp.path());
    ASSERT_TRUE(reg);
    EXPECT_TRUE(fs::is_empty(fs::path(reg->data_dir()) / "staging"));
    EXPECT_TRUE(fs::is_empty(fs::path(reg->data_dir()) / "trash"));
    check(*reg, finished);
  }
  EXPECT_TRUE(finished) << "the save never ran to completion";
}

TEST(RegistryCrashTest, KillAtEveryStepOfAnOverwriteKeepsTheOldOrTheNewVersion) {
  const TinkerPath path{"m:train:0", kTraining, "ckpt"};
  int kept_old = 0, kept_new = 0;
  AfterAKillAtEveryStep(/*save_first=*/true, [&](Registry& reg, bool finished) {
    auto c = reg.GetCheckpoint(path);
    ASSERT_TRUE(c.ok()) << c.status().message();
    const std::string weights = ReadFile(fs::path(c->dir) / "adapter_model.safetensors");
    const bool is_old = c->created_ms == 10 && c->size_bytes == 100 + 7 && weights == Bytes(100, 7);
    const bool is_new = c->created_ms == 20 && c->size_bytes == 200 + 7 && weights == Bytes(200, 7);
    ASSERT_TRUE(is_old || is_new) << "row t=" << c->created_ms << " size=" << c->size_bytes
                                  << " file bytes=" << weights.size();
    EXPECT_EQ(ReadFile(fs::path(c->dir) / "adapter_config.json"), R"({"r":8})");
    if (is_old) {
      EXPECT_EQ(kept_new, 0) << "an earlier step already kept the new version";
      ++kept_old;
    } else {
      ++kept_new;
    }
    if (finished) EXPECT_TRUE(is_new);
    // Listed once, and nothing else is left on disk.
    auto listed = reg.ListCheckpoints("m:train:0", {-1, 0});
    ASSERT_TRUE(listed.ok());
    ASSERT_EQ(listed->total, 1);
    EXPECT_EQ(listed->items[0].dir, c->dir);
    EXPECT_EQ(CheckpointDirsOnDisk(reg.data_dir()), std::set<std::string>{c->dir});
    // And it can be overwritten again after the restart.
    auto again = Save(reg, "alice", "m:train:0", kWeightsKind, "ckpt", 30, 300, {}, true);
    ASSERT_TRUE(again.ok()) << again.status().message();
    EXPECT_EQ(ReadFile(fs::path(reg.GetCheckpoint(path)->dir) / "adapter_model.safetensors"), Bytes(300, 7));
    EXPECT_EQ(CheckpointDirsOnDisk(reg.data_dir()).size(), 1u);
  });
  EXPECT_GT(kept_old, 0);
  EXPECT_GT(kept_new, 1);
}

TEST(RegistryCrashTest, KillAtEveryStepOfAFirstSaveLeavesNoOrphanDirectory) {
  const TinkerPath path{"m:train:0", kTraining, "ckpt"};
  int lost = 0;
  AfterAKillAtEveryStep(/*save_first=*/false, [&](Registry& reg, bool) {
    auto c = reg.GetCheckpoint(path);
    if (c.ok()) {  // the row was written: complete
      EXPECT_EQ(ReadFile(fs::path(c->dir) / "adapter_model.safetensors"), Bytes(200, 7));
      EXPECT_EQ(CheckpointDirsOnDisk(reg.data_dir()), std::set<std::string>{c->dir});
    } else {  // never acknowledged: neither listed nor left on disk
      ++lost;
      EXPECT_EQ(c.status().code(), Code::kNotFound);
      EXPECT_EQ(reg.ListCheckpoints("m:train:0", {-1, 0})->total, 0);
      EXPECT_EQ(CheckpointDirsOnDisk(reg.data_dir()), std::set<std::string>{});
    }
    // The name is free for a new save.
    ASSERT_TRUE(Save(reg, "alice", "m:train:0", kWeightsKind, "ckpt", 30, 300, {}, c.ok()).ok());
  });
  EXPECT_GT(lost, 0);
}

TEST(RegistryCrashTest, OpenDeletesDirectoriesNoRowNamesAndKeepsLiveOnes) {
  TempDir tmp;
  std::string live_dir, replaced_dir;
  {
    auto reg = OpenOrDie(tmp.path());
    ASSERT_TRUE(reg);
    ASSERT_TRUE(Save(*reg, "alice", "m:train:0", kWeightsKind, "kept", 1, 10).ok());
    auto v1 = Save(*reg, "alice", "m:train:0", kWeightsKind, "kept", 2, 20, {}, true);
    ASSERT_TRUE(v1.ok());
    live_dir = v1->dir;
    EXPECT_EQ(v1->version, 1);
    EXPECT_EQ(live_dir, reg->CheckpointDir("m:train:0", kWeightsKind, "kept").value() + "@1");
    replaced_dir = reg->CheckpointDir("m:train:0", kWeightsKind, "kept").value();
  }
  const fs::path runs = fs::path(tmp.path()) / "runs";
  // What crashes leave: a renamed save whose row never came (the old code's
  // orphan), a replaced version that was not removed yet, an orphan of a
  // model with no rows at all, and a stray file (not ours, left alone).
  WriteFile(runs / SanitizeForPath("m:train:0") / "weights" / "ghost" / "adapter_model.safetensors", "x");
  WriteFile(fs::path(replaced_dir) / "adapter_model.safetensors", Bytes(10, 7));
  WriteFile(runs / SanitizeForPath("z:train:9") / "sampler_weights" / "s@4" / "adapter_config.json", "{}");
  WriteFile(runs / SanitizeForPath("m:train:0") / "weights" / "README", "notes");
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  auto c = reg->GetCheckpoint(TinkerPath{"m:train:0", kTraining, "kept"});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->dir, live_dir);
  EXPECT_EQ(ReadFile(fs::path(live_dir) / "adapter_model.safetensors"), Bytes(20, 7));
  EXPECT_FALSE(fs::exists(runs / SanitizeForPath("m:train:0") / "weights" / "ghost"));
  EXPECT_FALSE(fs::exists(replaced_dir));
  EXPECT_FALSE(fs::exists(runs / SanitizeForPath("z:train:9") / "sampler_weights" / "s@4"));
  EXPECT_TRUE(fs::exists(runs / SanitizeForPath("m:train:0") / "weights" / "README"));
  EXPECT_EQ(reg->ListOwnerCheckpoints("alice", {-1, 0})->total, 1);
  EXPECT_TRUE(fs::is_empty(fs::path(reg->data_dir()) / "trash"));
}

TEST(RegistryCrashTest, RegistryWithoutVersionColumnIsMigratedAndStillLoads) {
  TempDir tmp;
  {
    auto db = SqliteDb::Open((fs::path(tmp.path()) / "registry.sqlite3").string());
    ASSERT_TRUE(db.ok());
    ASSERT_TRUE((*db)->Exec(R"sql(
      CREATE TABLE checkpoints (model_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL,
        owner TEXT NOT NULL, created_ms INTEGER NOT NULL, size_bytes INTEGER NOT NULL,
        expires_ms INTEGER, is_public INTEGER NOT NULL, PRIMARY KEY (model_id, kind, name));
      INSERT INTO checkpoints VALUES ('m:train:0', 'weights', 'old', 'alice', 5, 3, NULL, 0);)sql").ok());
  }
  const fs::path old_dir = fs::path(tmp.path()) / "runs" / SanitizeForPath("m:train:0") / "weights" / "old";
  WriteFile(old_dir / "adapter_model.safetensors", "abc");
  auto reg = OpenOrDie(tmp.path());
  ASSERT_TRUE(reg);
  auto c = reg->GetCheckpoint(TinkerPath{"m:train:0", kTraining, "old"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->version, 0);
  EXPECT_EQ(c->dir, old_dir.string());
  auto over = Save(*reg, "alice", "m:train:0", kWeightsKind, "old", 6, 40, {}, true);
  ASSERT_TRUE(over.ok()) << over.status().message();
  EXPECT_EQ(over->version, 1);
  EXPECT_FALSE(fs::exists(old_dir));
}

}  // namespace
}  // namespace loom::store
