// `loom bench sample --contention` (bench_contention.cpp): a light tenant's
// small requests on an idle sampler and beside another tenant's flood.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "engine/sample_api.h"

namespace loom::cli {

struct ContentionOptions {
  int light_requests = 40;  // timed in each phase (after as many to warm up)
  int light_prompt = 16;
  int light_tokens = 4;
  int flood_depth = 48;     // flood requests kept in the sampler
  int flood_prompt = 1000;
  int flood_tokens = 16;
  // --arrival-order: both tenants' calls carry no names, so they share one
  // flow and the sampler admits them in arrival order (the yardstick).
  bool arrival_order = false;
  // Non-empty: the phase beside the flood is traced (cli/trace_profile.h) to
  // profile + ".contended.json"; its figures then include the tracing.
  std::string profile;
};

// Runs both phases on s (which the caller opened with room for the flood's
// prompts) and prints the table; 0 on success.
int RunContention(engine::Sampler& s, const ContentionOptions& o);

// len random prompt tokens in [0, vocab - 1) (the last id is often EOS);
// the sample benches' prompts.
std::vector<int32_t> RandomPrompt(std::mt19937& rng, int64_t vocab, int len);

}  // namespace loom::cli
