// Helpers of the tests that drive the sampler's Scheduler step by step (no
// decode thread, so every assertion counts steps): a scheduler over the
// shared tiny model (sample_world.h), requests whose results land in a
// caller's optional, and the loop that runs steps until it is idle.
#pragma once
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/sample/scheduler.h"
#include "sample_world.h"

namespace loom::engine::testing_sampler {

inline std::unique_ptr<sample::Scheduler> MakeScheduler(const sample::SchedulerLimits& limits, int64_t blocks,
                                                        int64_t block_size) {
  DecodeOptions decode;
  decode.cuda_graphs = false;
  return std::make_unique<sample::Scheduler>(W().model,
                                             std::make_unique<SlotBank>(2, 8, at::kCPU, W().model->LoraTargets()),
                                             blocks, block_size, limits, decode, nullptr, std::vector<int32_t>{});
}

// n prompt tokens, different for each salt.
inline std::vector<int32_t> Tokens(int n, int32_t salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((salt * 131 + i * 37 + 11) % 500));
  return t;
}

// Adds a request (session "<tenant>:sample:<id>") whose result lands in *out when it completes.
inline void AddRequest(sample::Scheduler& s, uint64_t id, std::vector<int32_t> prompt, int64_t max_tokens,
                       int num_samples, std::optional<Result<SampleOutput>>* out, std::string adapter = "",
                       std::string tenant = "") {
  auto r = std::make_unique<sample::SampleRequest>();
  r->id = id;
  r->call.prompt = std::move(prompt);
  r->call.adapter_dir = std::move(adapter);
  r->call.num_samples = num_samples;
  r->call.tenant = tenant;
  r->call.session = (tenant.empty() ? "t" : tenant) + ":sample:" + std::to_string(id);
  r->call.params.temperature = 1.0;
  r->max_tokens = max_tokens;
  r->seed = 40 + id;
  r->done = [out](Result<SampleOutput> res) { out->emplace(std::move(res)); };
  s.Add(std::move(r));
}

inline void RunCallbacks(sample::Scheduler& s) {
  for (auto& [cb, res] : s.TakeCompleted()) cb(std::move(res));
}

inline void Drain(sample::Scheduler& s) {
  for (int i = 0; i < 1000 && !s.idle(); ++i) {
    s.Step();
    RunCallbacks(s);
  }
  ASSERT_TRUE(s.idle());
}

}  // namespace loom::engine::testing_sampler
