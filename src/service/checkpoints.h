// Checkpoints: saving and loading a model's weights through the registry
// (staging, commit). The REST side of runs and checkpoints, their TTLs and
// the archive grants are CheckpointCatalog's (service/checkpoint_catalog.h).
//
// Owns nothing: the checkpoints and runs are the registry's (thread-safe,
// durable), the slots' weights the engine's.
//
// Invariants: a save is staged in a fresh folder under the registry's staging
// area and committed whole, or not at all; save_weights and
// save_weights_for_sampler share the name and overwrite rule (Target), the
// staging (Stage) and the commit (Commit), and differ in the checkpoint
// kind, the engine's writer and the thread that writes: save_weights writes
// on the engine thread (Save); save_weights_for_sampler only takes the
// slot's snapshot there (SnapshotForSampler, which touches neither the
// registry nor the disk, so it never waits for another save's commit), and
// a writer thread stages, writes and commits it (Publish,
// service/publisher.h).
//
// Threading: Save, SnapshotForSampler, Load and Restore call the Engine:
// only the engine thread calls them, with no lock held. Publish touches no
// engine state: any thread.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "engine/api.h"
#include "service/options.h"
#include "service/training_models.h"
#include "service/training_op.h"
#include "store/registry.h"
#include "tinker/path.h"
#include "tinker/requests.h"

namespace loom::service {

class Checkpoints {
 public:
  using ModelRef = TrainingModels::ModelRef;

  // A save_weights_for_sampler between the engine thread and its writer:
  // the slot's snapshot and the checkpoint it becomes.
  struct Publication {
    std::shared_ptr<const engine::SlotSnapshot> snapshot;
    std::string staging;  // set by Publish: a fresh path under the registry's staging area
    store::CheckpointSpec spec;
    tinker::TinkerPath path;
    std::string base_model;  // written into adapter_config.json
  };

  Checkpoints(const ServiceOptions& options, engine::Engine& engine, store::Registry& registry)
      : options_(options), engine_(engine), registry_(registry) {}

  // ---- the engine thread ----
  // save_weights (kSaveWeights) of ref's slot, written and committed: its path.
  Result<tinker::TinkerPath> Save(const TrainingOp& op, const ModelRef& ref);
  // save_weights_for_sampler (kSaveForSampler) of ref's slot: the slot's
  // snapshot and the checkpoint it becomes; nothing checked or written yet.
  Result<Publication> SnapshotForSampler(const TrainingOp& op, const ModelRef& ref);
  // load_state[_with_optimizer] into ref's slot, from a checkpoint ref's
  // owner may read: the loaded path.
  Result<tinker::TinkerPath> Load(const TrainingOp& op, const ModelRef& ref);
  // Loads load_path into a freshly bound slot (create_model_via_load_weights,
  // whose access was checked at admission).
  Status Restore(int slot, const tinker::TinkerPath& load_path, bool with_optimizer);

  // ---- any thread ----
  // Readies the calling thread to Publish (Engine::PrepareSnapshotWriter):
  // once per writer thread, before its first Publish.
  void PrepareWriter() const { engine_.PrepareSnapshotWriter(); }
  // Undoes PrepareWriter, on the same thread, before it ends.
  void ReleaseWriter() const { engine_.ReleaseSnapshotWriter(); }
  // Checks pub's name is free (unless it may overwrite), writes its
  // snapshot as a PEFT directory into a staging folder and commits it: the
  // committed checkpoint (its dir is where the files are).
  Result<store::Checkpoint> Publish(Publication& pub);

 private:
  // The checkpoint op asks for: its name, path and spec (overwrite rule, TTL).
  static Publication Target(const TrainingOp& op, const ModelRef& ref);
  // The answer to a name already taken, or a fresh staging target in pub.
  Status Stage(Publication& pub);
  Result<store::Checkpoint> Commit(const Publication& pub);

  const ServiceOptions& options_;
  engine::Engine& engine_;
  store::Registry& registry_;
};

}  // namespace loom::service
