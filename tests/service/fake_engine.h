// FakeEngine: a tensor-free Engine test double for the service tests. It
// records every call in order, can hold the engine thread inside
// ForwardBackward (to let requests pile up and be packed), and writes small
// marker files for saves; its sampler snapshots' writes can be held or made
// to fail. Thread-safe (tests read while the engine thread runs).
#pragma once
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "engine/api.h"
#include "tinker/requests.h"

namespace loom::testing {

// A forward_backward of one datum {tag, 1, 2}: FakeEngine logs it as "fb:<slot>:<tag>".
inline tinker::ForwardBackwardRequest TaggedForwardBackward(const std::string& model, int64_t seq, int32_t tag,
                                                            const std::string& loss = "cross_entropy") {
  tinker::ForwardBackwardRequest r;
  r.model_id = model;
  r.seq_id = static_cast<int32_t>(seq);
  engine::Datum d;
  d.tokens = {tag, 1, 2};
  r.call.data.push_back(d);
  r.call.loss_fn = loss;
  return r;
}

class FakeEngine : public engine::Engine {
 public:
  explicit FakeEngine(int slots = 4, int max_rank = 32) {
    info_.model_type = "qwen3";
    info_.device = "cpu";
    info_.dtype = "float32";
    info_.vocab_size = 100;
    info_.context_window = 64;
    info_.max_slots = slots;
    info_.max_rank = max_rank;
  }

  const engine::ModelInfo& info() const override { return info_; }

  // What the memory plan reports (0: no limit, as on the CPU).
  int64_t max_pass_tokens = 0;
  int64_t MaxPassTokens() const override { return max_pass_tokens; }
  int64_t kept_pass_tokens = 0;  // the same with every layer kept
  int64_t KeptPassTokens() const override { return kept_pass_tokens; }
  RecomputeStats recompute_stats;  // what TrainRecomputeStats reports
  RecomputeStats TrainRecomputeStats() const override { return recompute_stats; }
  std::string MemoryPlanReport() const override { return max_pass_tokens > 0 ? "a fake plan" : ""; }

  loom::Status ValidateForwardBackward(const engine::ForwardBackwardCall& call) const override {
    if (call.data.empty()) return Status::Invalid("data: at least one datum is required");
    for (size_t i = 0; i < call.data.size(); ++i) {
      for (int32_t t : call.data[i].tokens) {
        if (t < 0 || t >= info_.vocab_size) return Status::Invalid("data[" + std::to_string(i) + "].tokens: out of vocabulary");
      }
    }
    return Status::Ok();
  }

  Status BindSlot(int slot, const engine::LoraConfig& config) override {
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back("bind:" + std::to_string(slot) + ":r" + std::to_string(config.rank));
    return Status::Ok();
  }
  void ReleaseSlot(int slot) override {
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back("release:" + std::to_string(slot));
  }

  // Gradient marks go to their own log (grad_log), so the call log stays as
  // the scheduling tests read it.
  void MarkGrad(int slot) override { GradLog("mark:" + std::to_string(slot)); }
  void RollbackGrad(int slot) override { GradLog("rollback:" + std::to_string(slot)); }
  void ForgetGradMark(int slot) override { GradLog("forget:" + std::to_string(slot)); }

  std::vector<Result<engine::ForwardBackwardOutput>> ForwardBackward(
      const std::vector<engine::ForwardBackwardCall>& calls) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++in_forward_;
      cv_.notify_all();
      cv_.wait(lock, [&] { return !hold_; });
      --in_forward_;
      batch_sizes_.push_back(calls.size());
      for (const auto& c : calls) {
        // Tests tag each call by its first token.
        log_.push_back("fb:" + std::to_string(c.slot) + ":" + std::to_string(c.data[0].tokens[0]));
      }
    }
    std::vector<Result<engine::ForwardBackwardOutput>> out;
    for (const auto& c : calls) {
      if (c.data[0].tokens[0] == 99) {  // token 99 = injected failure of this call only
        out.push_back(Status::Invalid("data[0]: injected failure"));
        continue;
      }
      engine::ForwardBackwardOutput o;
      for (const auto& d : c.data) {
        std::map<std::string, engine::Array> m;
        m["logprobs"] = engine::Array::Floats(std::vector<float>(d.tokens.size(), -1.0f));
        o.outputs.push_back(std::move(m));
      }
      o.metrics["loss:sum"] = static_cast<double>(c.data.size());
      out.push_back(std::move(o));
    }
    return out;
  }

  std::vector<Result<engine::OptimStepOutput>> OptimStep(const std::vector<engine::OptimStepCall>& calls) override {
    std::lock_guard<std::mutex> lock(mu_);
    optim_batch_sizes_.push_back(calls.size());
    std::vector<Result<engine::OptimStepOutput>> out;
    for (const auto& c : calls) {
      log_.push_back("optim:" + std::to_string(c.slot));
      engine::OptimStepOutput o;
      o.metrics["grad_norm"] = 0.5;
      out.push_back(o);
    }
    return out;
  }

  Status SaveState(int slot, const std::string& dir) override {
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/state.txt") << "slot " << slot << "\n";
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back("save:" + std::to_string(slot));
    return Status::Ok();
  }
  Status LoadState(int slot, const std::string& dir, bool with_optimizer) override {
    if (!std::filesystem::exists(dir + "/state.txt")) return Status::NotFound("no state in " + dir);
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back("load:" + std::to_string(slot) + (with_optimizer ? ":opt" : ""));
    return Status::Ok();
  }
  // A snapshot records "sampler:<slot>" when taken; writing it makes the
  // marker files of a PEFT directory, or fails / waits as the test set up.
  Result<std::shared_ptr<const engine::SlotSnapshot>> SnapshotForSampler(int slot) override {
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back("sampler:" + std::to_string(slot));
    return std::shared_ptr<const engine::SlotSnapshot>(
        std::make_shared<Snapshot>(this, slot, snapshot_tags_[slot]++));
  }

  // Records the thread, so that a write can tell whether its thread was readied.
  void PrepareSnapshotWriter() const override {
    std::lock_guard<std::mutex> lock(mu_);
    prepared_writers_.insert(std::this_thread::get_id());
  }
  // Records the thread among the released ones (a set that outlives the
  // engine: the service releases its writers as it shuts down).
  void ReleaseSnapshotWriter() const override {
    std::lock_guard<std::mutex> lock(mu_);
    released_writers_->insert(std::this_thread::get_id());
    if (!prepared_writers_.count(std::this_thread::get_id())) ++released_unprepared_;
  }

  // ---- test controls ----
  // Threads readied by PrepareSnapshotWriter; snapshot writes made on another thread.
  size_t prepared_writers() const {
    std::lock_guard<std::mutex> lock(mu_);
    return prepared_writers_.size();
  }
  int unprepared_writes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return unprepared_writes_;
  }
  // The threads that called ReleaseSnapshotWriter (read after the service
  // is gone), and how many of those calls came from a thread never readied.
  std::shared_ptr<const std::set<std::thread::id>> released_writers() const { return released_writers_; }
  int released_unprepared() const {
    std::lock_guard<std::mutex> lock(mu_);
    return released_unprepared_;
  }
  // Writes of slot's snapshots fail (as a disk that refuses them would).
  void FailWritesOf(int slot) {
    std::lock_guard<std::mutex> lock(mu_);
    failing_slots_.insert(slot);
  }
  // Snapshot writes wait until ReleaseWrites().
  void HoldWrites() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_writes_ = true;
  }
  void ReleaseWrites() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_writes_ = false;
    cv_.notify_all();
  }
  void WaitWriting(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return writing_ >= n; });
  }
  // "write:<slot>:<n>" per finished write of slot's n-th snapshot, in order.
  std::vector<std::string> write_log() const {
    std::lock_guard<std::mutex> lock(mu_);
    return write_log_;
  }
  void set_vocab_size(int64_t n) { info_.vocab_size = n; }
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = true;
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = false;
    cv_.notify_all();
  }
  void WaitInForward() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return in_forward_ > 0; });
  }
  std::vector<std::string> log() const {
    std::lock_guard<std::mutex> lock(mu_);
    return log_;
  }
  std::vector<std::string> grad_log() const {
    std::lock_guard<std::mutex> lock(mu_);
    return grad_log_;
  }
  std::vector<size_t> batch_sizes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return batch_sizes_;
  }
  std::vector<size_t> optim_batch_sizes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return optim_batch_sizes_;
  }

 private:
  class Snapshot final : public engine::SlotSnapshot {
   public:
    Snapshot(FakeEngine* engine, int slot, int tag) : engine_(engine), slot_(slot), tag_(tag) {}
    Status WritePeft(const std::string& dir, const std::string& base) const override {
      {
        std::unique_lock<std::mutex> lock(engine_->mu_);
        if (!engine_->prepared_writers_.count(std::this_thread::get_id())) ++engine_->unprepared_writes_;
        ++engine_->writing_;
        engine_->cv_.notify_all();
        engine_->cv_.wait(lock, [&] { return !engine_->hold_writes_; });
        --engine_->writing_;
        if (engine_->failing_slots_.count(slot_)) return Status::Internal("cannot create " + dir + ": Read-only file system");
      }
      std::filesystem::create_directories(dir);
      std::ofstream(dir + "/adapter_config.json") << "{\"base_model_name_or_path\":\"" << base << "\"}";
      std::ofstream(dir + "/adapter_model.safetensors") << "slot " << slot_ << " snapshot " << tag_;
      std::lock_guard<std::mutex> lock(engine_->mu_);
      engine_->write_log_.push_back("write:" + std::to_string(slot_) + ":" + std::to_string(tag_));
      return Status::Ok();
    }
    int64_t bytes() const override { return 1; }

   private:
    FakeEngine* engine_;
    int slot_, tag_;
  };

  void GradLog(std::string entry) {
    std::lock_guard<std::mutex> lock(mu_);
    grad_log_.push_back(std::move(entry));
  }
  engine::ModelInfo info_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false;
  int in_forward_ = 0;
  std::vector<std::string> log_;
  std::vector<std::string> grad_log_;
  std::vector<size_t> batch_sizes_;
  std::vector<size_t> optim_batch_sizes_;
  std::map<int, int> snapshot_tags_;  // slot -> snapshots taken
  std::set<int> failing_slots_;
  bool hold_writes_ = false;
  int writing_ = 0;
  std::vector<std::string> write_log_;
  mutable std::set<std::thread::id> prepared_writers_;
  int unprepared_writes_ = 0;
  std::shared_ptr<std::set<std::thread::id>> released_writers_ = std::make_shared<std::set<std::thread::id>>();
  mutable int released_unprepared_ = 0;
};

}  // namespace loom::testing
