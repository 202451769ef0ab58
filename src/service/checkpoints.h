// Checkpoints: saving and loading a model's weights through the registry
// (staging, commit). The REST side of runs and checkpoints, their TTLs and
// the archive grants are CheckpointCatalog's (service/checkpoint_catalog.h).
//
// Owns nothing: the checkpoints and runs are the registry's (thread-safe,
// durable), the slots' weights the engine's.
//
// Invariants: a save is staged in a fresh folder under the registry's staging
// area and committed whole, or not at all; save_weights and
// save_weights_for_sampler go through one path (Save) and differ only in the
// checkpoint kind, the engine's writer and the overwrite rule.
//
// Threading: every method calls the Engine: only the engine thread calls
// them, with no lock held.
#pragma once
#include <cstdint>
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

 private:
  const ServiceOptions& options_;
  engine::Engine& engine_;
  store::Registry& registry_;
};

}  // namespace loom::service
