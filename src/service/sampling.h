// Sampling sessions on the Service (spec §5.18-5.20): the state Service keeps
// for create_sampling_session / asample / samplers/{id}. The Service methods
// themselves are implemented in sampling.cpp.
//
// Invariants: a sampling session id is "{session_id}:sample:{n}", made once
// per (session, n) (by create_sampling_session or an unnamed
// save_weights_for_sampler) and owned by its session's tenant; one
// (sampling_session_id, seq_id) is admitted at most once (a repeat answers
// the first request's future and sequence ids); a session that expired
// takes no new asample, and its queued and running samples are cancelled
// (the janitor calls Sampler::Cancel for each of its sampling sessions).
//
// The sampling sessions themselves are Sessions' (sessions.h).
//
// Threading: SamplingState is guarded by ServiceLock::mu; the Sampler it owns
// is thread-safe and completes futures on its own decode thread.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/tenant_gate.h"
#include "engine/sample_api.h"

namespace loom::service {

// The answer to an admitted asample: the future and one id per sample, in
// the order of the result's sequences.
struct SampleSubmitted {
  std::string request_id;
  std::vector<std::string> sample_sequence_ids;
};

// What Service holds for sampling (guarded by ServiceLock::mu, except the
// gate, which is thread-safe: the sampler's callbacks leave it).
struct SamplingState {
  explicit SamplingState(int sample_queue) : queue(sample_queue) {}
  // asample calls in the sampler, queued or running: at most --sample-queue,
  // half of it for one tenant; beyond, asample answers 429 (the SDK backs
  // off and resubmits, spec 5.19). Declared before the sampler, whose
  // callbacks leave it as it stops.
  TenantGate queue;
  std::unique_ptr<engine::Sampler> sampler;  // null: sampling is not served
  // (sampling_session_id, seq_id) -> first answer and when (pruned after an hour).
  std::map<std::pair<std::string, int64_t>, std::pair<SampleSubmitted, std::chrono::steady_clock::time_point>>
      admitted;
  std::chrono::steady_clock::time_point last_prune{};
};

}  // namespace loom::service
