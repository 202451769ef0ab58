// CheckpointCatalog: the REST side of training runs and checkpoints (weights
// info, listings, delete, TTL, visibility), the checkpoints' TTL sweep, and
// the one-time archive download grants.
//
// Owns: archives_ (download token -> grant). The runs and checkpoints
// themselves are the registry's (thread-safe, durable); saving and loading
// them is Checkpoints' (service/checkpoints.h), on the engine thread.
//
// Invariants: every lookup compares the record's owner with the caller and
// answers a foreign record exactly like a missing one. A grant names a
// checkpoint by path (it is resolved at download, as an overwrite moves its
// files) and is refused after archive_url_ttl.
//
// Threading: every method runs on any thread. archives_ is guarded by
// grants_mu_ (its own: nothing else spans it; taken after ServiceLock::mu
// when the janitor expires grants).
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "common/status.h"
#include "service/caller.h"
#include "service/options.h"
#include "store/registry.h"
#include "tinker/path.h"
#include "tinker/requests.h"
#include "tinker/results.h"

namespace loom::service {

class CheckpointCatalog {
 public:
  using Clock = std::chrono::steady_clock;

  CheckpointCatalog(const ServiceOptions& options, store::Registry& registry)
      : options_(options), registry_(registry) {}

  Result<tinker::WeightsInfoResult> WeightsInfo(const Caller& caller, const tinker::TinkerPath& path);
  Result<tinker::TrainingRunsPage> ListTrainingRuns(const Caller& caller, tinker::PageParams page);
  Result<tinker::TrainingRun> GetTrainingRun(const Caller& caller, const std::string& run_id);
  Result<tinker::CheckpointsPage> ListRunCheckpoints(const Caller& caller, const std::string& run_id);
  Result<tinker::CheckpointsPage> ListUserCheckpoints(const Caller& caller, tinker::PageParams page);
  Status DeleteCheckpoint(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id);
  Status SetCheckpointTtl(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id,
                          std::optional<int64_t> ttl_seconds);
  Status SetCheckpointPublic(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id,
                             bool is_public);
  // A one-time download token for the checkpoint's tar (unauthenticated GET);
  // *expires_unix receives its expiry.
  Result<std::string> CreateArchiveToken(const Caller& caller, const std::string& run_id,
                                         const std::string& checkpoint_id, int64_t* expires_unix);
  // The tar bytes for a token (NotFound when unknown or expired).
  Result<std::string> ReadArchive(const std::string& token);

  // ---- the janitor ----
  void ExpireGrants(Clock::time_point now);
  // Deletes the checkpoints whose TTL has passed (and logs how many).
  void SweepExpired();

 private:
  struct ArchiveGrant {
    tinker::TinkerPath path;  // resolved at download: an overwrite moves its files
    std::string prefix;
    Clock::time_point expires;
  };

  Result<store::Checkpoint> OwnedCheckpoint(const Caller& caller, const std::string& run_id,
                                            const std::string& checkpoint_id);

  const ServiceOptions& options_;
  store::Registry& registry_;
  std::mutex grants_mu_;
  std::map<std::string, ArchiveGrant> archives_;  // [grants_mu_]
};

}  // namespace loom::service
