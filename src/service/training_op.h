// TrainingOp: one accepted Tinker request on a training model, waiting for
// its turn (seq_id order) and then for the engine thread. Plain data.
#pragma once
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "engine/api.h"
#include "tinker/path.h"

namespace loom::service {

enum class OpKind {
  kCreateModel,      // seq 0: bind a slot (optionally load a checkpoint into it)
  kForwardBackward,  // forward_only included
  kOptimStep,
  kSaveWeights,      // save_state: adapter + optimizer, resumable
  kLoadWeights,      // load_state[_with_optimizer]
  kSaveForSampler,   // PEFT snapshot, named or unnamed
  kUnloadModel,
};

const char* OpKindName(OpKind kind);  // Tinker's request type, e.g. "ForwardBackward"

struct TrainingOp {
  OpKind kind = OpKind::kForwardBackward;
  std::string request_id;
  std::string model_id;
  int64_t seq_id = 0;
  std::chrono::steady_clock::time_point arrived{};
  uint64_t ticket = 0;  // global arrival order of becoming ready (FIFO across models)

  engine::ForwardBackwardCall forward_backward;  // kForwardBackward (slot set when run)
  engine::AdamParams adam;                       // kOptimStep

  // kSaveWeights / kSaveForSampler: checkpoint name ("" = unnamed sampler save).
  std::string name;
  std::optional<int64_t> ttl_seconds;
  bool overwrite = false;
  std::optional<int64_t> sampling_session_seq_id;  // unnamed save_weights_for_sampler

  // kLoadWeights, and kCreateModel when created from a checkpoint.
  std::optional<tinker::TinkerPath> load_path;
  bool with_optimizer = false;
};

}  // namespace loom::service
