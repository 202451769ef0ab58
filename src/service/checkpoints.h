// Checkpoints: saving and loading a model's weights through the registry
// (staging, commit), the REST side of training runs and checkpoints, and the
// one-time archive download grants.
//
// Owns: archives_ (download token -> grant). The checkpoints and runs
// themselves are the registry's (thread-safe, durable).
//
// Invariants: a save is staged in a fresh folder under the registry's staging
// area and committed whole, or not at all; save_weights and
// save_weights_for_sampler go through one path (Save) and differ only in the
// checkpoint kind, the engine's writer and the overwrite rule. Every REST
// lookup compares the record's owner with the caller and answers a foreign
// record exactly like a missing one. A grant names a checkpoint by path (it
// is resolved at download, as an overwrite moves its files) and is refused
// after archive_url_ttl.
//
// Threading: Save, Load and Restore call the Engine: only the engine thread
// calls them, with no lock held. The REST methods run on any thread.
// archives_ is guarded by grants_mu_ (its own: nothing else spans it; taken
// after ServiceLock::mu when the janitor expires grants).
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "common/status.h"
#include "engine/api.h"
#include "service/caller.h"
#include "service/options.h"
#include "service/training_models.h"
#include "service/training_op.h"
#include "store/registry.h"
#include "tinker/path.h"
#include "tinker/requests.h"
#include "tinker/results.h"

namespace loom::service {

class Checkpoints {
 public:
  using Clock = std::chrono::steady_clock;
  using ModelRef = TrainingModels::ModelRef;

  Checkpoints(const ServiceOptions& options, engine::Engine& engine, store::Registry& registry)
      : options_(options), engine_(engine), registry_(registry) {}

  // ---- the engine thread ----
  // save_weights (kSaveWeights) or save_weights_for_sampler (kSaveForSampler)
  // of ref's slot: the committed checkpoint's path.
  Result<tinker::TinkerPath> Save(const TrainingOp& op, const ModelRef& ref);
  // load_state[_with_optimizer] into ref's slot, from a checkpoint ref's
  // owner may read: the loaded path.
  Result<tinker::TinkerPath> Load(const TrainingOp& op, const ModelRef& ref);
  // Loads load_path into a freshly bound slot (create_model_via_load_weights,
  // whose access was checked at admission).
  Status Restore(int slot, const tinker::TinkerPath& load_path, bool with_optimizer);
  // Deletes the checkpoints whose TTL has passed (and logs how many).
  void SweepExpired();

  // ---- REST (any thread; rest.cpp) ----
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
  Result<std::string> CreateArchiveToken(const Caller& caller, const std::string& run_id,
                                         const std::string& checkpoint_id, int64_t* expires_unix);
  Result<std::string> ReadArchive(const std::string& token);

  // ---- the janitor ----
  void ExpireGrants(Clock::time_point now);

 private:
  struct ArchiveGrant {
    tinker::TinkerPath path;  // resolved at download: an overwrite moves its files
    std::string prefix;
    Clock::time_point expires;
  };

  Result<store::Checkpoint> OwnedCheckpoint(const Caller& caller, const std::string& run_id,
                                            const std::string& checkpoint_id);

  const ServiceOptions& options_;
  engine::Engine& engine_;
  store::Registry& registry_;
  std::mutex grants_mu_;
  std::map<std::string, ArchiveGrant> archives_;  // [grants_mu_]
};

}  // namespace loom::service
