// FakeSampler: a tensor-free engine::Sampler test double for the service and
// http tests. It validates like the real one does in the parts the service
// relies on (empty prompt, context window, stop strings without a tokenizer),
// records every call, and completes calls on its own thread, in order, with
// deterministic sequences: sample i of a call generates max_tokens tokens
// (prompt.back() + i + 1 + j) % vocab with logprob -(j + 1) / 10.
// Thread-safe; Hold() keeps calls queued until Release(); Cancel() fails a
// session's queued calls; Offer() only records the offers.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/sample_api.h"

namespace loom::testing {

class FakeSampler : public engine::Sampler {
 public:
  explicit FakeSampler(int64_t vocab = 100, int64_t context_window = 32) {
    info_.vocab_size = vocab;
    info_.context_window = context_window;
    info_.sampler_adapters = 2;
    // The limits engine::ValidateSampleCall reads (a gateway in front of this
    // fake checks calls against them): roomy.
    info_.max_num_samples = 16;
    info_.max_rank = 32;
    info_.block_size = 16;
    info_.kv_blocks = 1024;
    info_.kv_tokens = info_.kv_blocks * info_.block_size;
    thread_ = std::thread([this] { Run(); });
  }
  ~FakeSampler() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      hold_ = false;
    }
    cv_.notify_all();
    thread_.join();
    for (auto& [call, done] : queue_) done(Status::Unavailable("the sampler is shutting down"));
  }

  const engine::SamplerInfo& info() const override { return info_; }

  Status Validate(const engine::SampleCall& c) const override {
    if (c.prompt.empty()) return Status::Invalid("prompt must have at least one token");
    for (int32_t t : c.prompt) {
      if (t < 0 || t >= info_.vocab_size) return Status::Invalid("prompt token " + std::to_string(t) + " is outside the vocabulary");
    }
    if (!c.params.stop_strings.empty()) {
      return Status::Invalid("sampling_params.stop: stop strings need tokenizer.json in the model directory");
    }
    const int64_t max_tokens = c.params.max_tokens.value_or(1);
    if (static_cast<int64_t>(c.prompt.size()) + max_tokens > info_.context_window) {
      return Status::Invalid("prompt (" + std::to_string(c.prompt.size()) + " tokens) + max_tokens (" +
                             std::to_string(max_tokens) + ") exceeds the context window of " +
                             std::to_string(info_.context_window));
    }
    return Status::Ok();
  }

  void Submit(engine::SampleCall call, engine::SampleCallback done) override {
    if (Status st = Validate(call); !st.ok()) return done(st);
    std::optional<Status> refused;
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls_.push_back(call);
      if (auto c = cancelled_.find(call.session); c != cancelled_.end()) {
        refused = c->second;
      } else {
        queue_.emplace_back(std::move(call), std::move(done));
      }
    }
    if (refused) return done(*refused);
    cv_.notify_all();
  }

  // As the real one: queued calls of the session fail with why (a held fake
  // has no running calls), and so do its later ones.
  void Cancel(const std::string& session, const Status& why) override {
    std::vector<engine::SampleCallback> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_.emplace(session, why);
      for (auto it = queue_.begin(); it != queue_.end();) {
        if (it->first.session != session) {
          ++it;
          continue;
        }
        dropped.push_back(std::move(it->second));
        it = queue_.erase(it);
      }
    }
    for (auto& done : dropped) done(why);
  }

  // Records (dir, snapshot) in order.
  void Offer(const std::string& dir, std::shared_ptr<const engine::SlotSnapshot> snapshot) override {
    std::lock_guard<std::mutex> lock(mu_);
    offers_.emplace_back(dir, std::move(snapshot));
  }

  // Whether it takes calls' in-memory snapshots (as the in-process sampler
  // does; off by default, as a replica's gateway).
  bool SamplesFromMemory() const override { return samples_from_memory_; }
  void set_samples_from_memory(bool on) { samples_from_memory_ = on; }

  engine::SamplerStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    engine::SamplerStats s;
    s.requests_done = done_;
    return s;
  }

  // ---- test controls ----
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = true;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      hold_ = false;
    }
    cv_.notify_all();
  }
  std::vector<engine::SampleCall> calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  std::vector<std::string> offered_dirs() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> dirs;
    for (const auto& [dir, snapshot] : offers_) dirs.push_back(dir);
    return dirs;
  }

  static engine::SampleOutput Answer(const engine::SampleCall& c, int64_t vocab) {
    engine::SampleOutput out;
    const int32_t n = c.params.max_tokens.value_or(1);
    for (int32_t i = 0; i < c.num_samples; ++i) {
      engine::SampledSequence s;
      for (int32_t j = 0; j < n; ++j) {
        s.tokens.push_back(static_cast<int32_t>((c.prompt.back() + i + 1 + j) % vocab));
        s.logprobs.push_back(-(j + 1) / 10.0f);
      }
      s.stop_reason = engine::SampleStopReason::kLength;
      out.sequences.push_back(std::move(s));
    }
    if (c.prompt_logprobs) {
      std::vector<float> p(c.prompt.size(), -0.5f);
      p[0] = std::numeric_limits<float>::quiet_NaN();
      out.prompt_logprobs = p;
    }
    if (c.topk_prompt_logprobs > 0) {
      out.topk = c.topk_prompt_logprobs;
      for (size_t r = 0; r < c.prompt.size(); ++r) {
        for (int32_t k = 0; k < out.topk; ++k) {
          out.topk_token_ids.push_back(r == 0 ? 0 : k);
          out.topk_logprobs.push_back(r == 0 ? engine::SampleOutput::kTopkPad : -1.0f - k);
        }
      }
    }
    return out;
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || (!hold_ && !queue_.empty()); });
      if (stop_) return;
      auto [call, done] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      done(Answer(call, info_.vocab_size));
      lock.lock();
      ++done_;
    }
  }

  engine::SamplerInfo info_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false;
  std::atomic<bool> samples_from_memory_{false};
  bool stop_ = false;
  int64_t done_ = 0;
  std::deque<std::pair<engine::SampleCall, engine::SampleCallback>> queue_;
  std::vector<engine::SampleCall> calls_;
  std::vector<std::pair<std::string, std::shared_ptr<const engine::SlotSnapshot>>> offers_;
  std::map<std::string, Status> cancelled_;
  std::thread thread_;
};

}  // namespace loom::testing
