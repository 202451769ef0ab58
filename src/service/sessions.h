// Sessions: the clients' sessions (heartbeat leases) and the sampling
// sessions made on them, with their REST listings.
//
// Owns: sessions_ (session id -> Session: owner, lease, the model and
// sampling session ids made on it) and samplers_ (sampling session id ->
// SamplingSession).
//
// Invariants: a session belongs to the tenant that created it, and another
// tenant gets NotFound with the text for an unknown id; once expired (no
// heartbeat for session_ttl) a session stays expired and its heartbeats fail
// with a FailedPrecondition that says "expired"; a sampling session id is
// "{session_id}:sample:{n}", made once per (session, n) and owned by its
// session's tenant.
//
// Threading: both maps are guarded by ServiceLock::mu (see service_lock.h
// for why it is shared). Methods named *Locked expect it held; the others
// take it. The registry is thread-safe and called under the lock only where
// the Service always did (create_session's record).
#pragma once
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "service/caller.h"
#include "service/idempotency.h"
#include "service/options.h"
#include "service/service_lock.h"
#include "store/registry.h"
#include "tinker/path.h"
#include "tinker/requests.h"
#include "tinker/results.h"

namespace loom::engine {
class SlotSnapshot;  // engine/api.h
}  // namespace loom::engine

namespace loom::service {

class Sessions {
 public:
  using Clock = std::chrono::steady_clock;
  struct Session {
    std::string session_id;
    std::string owner;
    Clock::time_point last_seen;
    bool expired = false;
    std::vector<std::string> model_ids;
    std::vector<std::string> sampler_ids;
  };
  struct SamplingSession {
    std::string sampler_id;
    std::string owner;
    std::string base_model;
    std::optional<tinker::TinkerPath> model_path;  // unset: the base model (or, with snapshot, not yet committed)
    // An ephemeral sampler (an unnamed save_weights_for_sampler, answered
    // once its snapshot reached the sampler): the weights in memory and the
    // key the sampler caches them under, until the snapshot's write commits
    // (CommitSamplerLocked sets model_path then and drops them).
    std::shared_ptr<const engine::SlotSnapshot> snapshot;
    std::string snapshot_key;
  };

  Sessions(const ServiceOptions& options, ServiceLock& lock, IdempotencyMemory& idempotency,
           store::Registry& registry)
      : options_(options), lock_(lock), idempotency_(idempotency), registry_(registry) {}

  Result<std::string> CreateSession(const Caller& caller, const tinker::CreateSessionRequest& request);
  Status Heartbeat(const Caller& caller, const std::string& session_id);
  // REST: the caller's sessions, live or recorded.
  Result<tinker::SessionsPage> ListSessions(const Caller& caller, tinker::PageParams page);
  Result<tinker::SessionInfo> GetSession(const Caller& caller, const std::string& session_id);

  Session* FindLocked(const std::string& session_id);
  // A request on the session counts as a heartbeat (not once expired).
  void TouchSessionLocked(const std::string& session_id);
  // Records a sampling session and lists it on its session (if that is still known).
  void AddSamplerLocked(SamplingSession sampler, const std::string& session_id);
  const SamplingSession* FindSamplerLocked(const std::string& sampler_id) const;
  // An ephemeral sampler's snapshot is on disk as `path`: the session samples
  // it from there on (a no-op when the session is gone).
  void CommitSamplerLocked(const std::string& sampler_id, const tinker::TinkerPath& path);
  // The janitor: marks the sessions idle longer than session_ttl expired and
  // returns them (their models are the caller's to fail).
  std::vector<Session*> ExpireIdleLocked(Clock::time_point now);

 private:
  const ServiceOptions& options_;
  ServiceLock& lock_;
  IdempotencyMemory& idempotency_;  // [lock_.mu]
  store::Registry& registry_;
  std::map<std::string, Session> sessions_;          // [lock_.mu]
  std::map<std::string, SamplingSession> samplers_;  // [lock_.mu]
};

}  // namespace loom::service
