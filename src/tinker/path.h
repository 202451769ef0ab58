// Tinker checkpoint paths, `tinker://<training_run_id>/<weights|sampler_weights>/<name>`
// (spec §7.2), and the one rule for the names and run ids that go into them.
//
// A name or run id becomes a directory name under --data-dir, so a parsed
// TinkerPath is safe to hand to the file system: no '/', no "..", no control
// characters, a bounded length and a small character set. The spec asks only
// for "no '/'"; the character set is loom's and covers every name the SDK and
// the cookbook make ("step_100", "ckpt-001", "sampler-001", "final.v2").
//
// Pure functions; any thread.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

#include "common/status.h"

namespace loom::tinker {

// The kind segment of a path, as the registry records it too.
inline constexpr const char* kWeightsKind = "weights";                // save_state (+ optimizer)
inline constexpr const char* kSamplerWeightsKind = "sampler_weights";  // save_weights_for_sampler

inline constexpr size_t kMaxNameLength = 128;     // checkpoint name
inline constexpr size_t kMaxModelIdLength = 256;  // training run id

struct TinkerPath {
  enum class Kind { kTraining, kSampler };  // "weights" / "sampler_weights"
  std::string training_run_id;              // = model_id
  Kind kind = Kind::kTraining;
  std::string name;

  std::string ToString() const;             // the tinker:// URI
  std::string checkpoint_id() const;        // "weights/<name>" or "sampler_weights/<name>"
  const char* checkpoint_type() const;      // "training" or "sampler"
  const char* kind_segment() const;         // kWeightsKind or kSamplerWeightsKind
  bool operator==(const TinkerPath&) const = default;
};

// Checkpoint name: 1..kMaxNameLength characters of [A-Za-z0-9._-], not ".",
// no "..", no '/'. Errors start "<field>: checkpoint name ...".
Status ValidateCheckpointName(std::string_view name, std::string_view field = "name");
// Training run id: 1..kMaxModelIdLength characters of [A-Za-z0-9._:@-], no "..".
Status ValidateModelId(std::string_view model_id, std::string_view field = "model_id");
// "weights" -> kTraining, "sampler_weights" -> kSampler; else Invalid naming `field`.
Result<TinkerPath::Kind> ParseKind(std::string_view segment, std::string_view field = "kind");

// Exactly three non-empty parts after "tinker://", a kind segment, and a run
// id and name that pass the rules above; otherwise kInvalidArgument whose
// message starts with `field` ("load_weights.path: '/tmp/x' must start with
// tinker://").
Result<TinkerPath> ParseTinkerPath(std::string_view uri, std::string_view field = "tinker_path");
// A REST checkpoint id "<kind>/<name>" of the given run ("weights/step_10").
Result<TinkerPath> ParseCheckpointId(std::string_view training_run_id, std::string_view checkpoint_id);

}  // namespace loom::tinker
