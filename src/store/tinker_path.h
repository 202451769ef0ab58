// Tinker checkpoint paths ("tinker://<model_id>/<kind>/<name>") and the names
// that go into them. Pure functions; any thread.
//
// A name or model_id becomes a directory name under --data-dir, so it is
// validated here before it can reach the file system: no '/', no "..", no
// control characters, a bounded length and a safe character set.
#pragma once
#include <string>

#include "common/status.h"

namespace loom::store {

inline constexpr const char* kWeightsKind = "weights";                // save_state (+ optimizer)
inline constexpr const char* kSamplerWeightsKind = "sampler_weights";  // save_weights_for_sampler

inline constexpr size_t kMaxNameLength = 128;     // checkpoint name
inline constexpr size_t kMaxModelIdLength = 256;  // training run id

struct TinkerPath {
  std::string model_id;
  std::string kind;  // kWeightsKind or kSamplerWeightsKind
  std::string name;

  std::string ToString() const { return "tinker://" + model_id + "/" + kind + "/" + name; }
  // Tinker's checkpoint_id: "<kind>/<name>".
  std::string checkpoint_id() const { return kind + "/" + name; }
};

// Checkpoint name: 1..kMaxNameLength chars of [A-Za-z0-9._-], not "." or
// "..", no "..". `field` names the request field in the error message.
Status ValidateCheckpointName(const std::string& name, const char* field = "name");
// Training run id: 1..kMaxModelIdLength chars of [A-Za-z0-9._:@-], no "..".
Status ValidateModelId(const std::string& model_id, const char* field = "model_id");
// "weights" or "sampler_weights".
Status ValidateKind(const std::string& kind, const char* field = "kind");

// Parses and validates "tinker://<model_id>/<kind>/<name>" (exactly three
// parts after the scheme). Invalid names `field` in its message.
Result<TinkerPath> ParseTinkerPath(const std::string& path, const char* field = "path");
// Parses a REST checkpoint_id "<kind>/<name>" for the given run.
Result<TinkerPath> ParseCheckpointId(const std::string& model_id, const std::string& checkpoint_id);

// Injective map from a validated model_id to one directory name: keeps
// [A-Za-z0-9.-] and writes every other byte as "_XX" (hex), so "s:train:0"
// becomes "s_3Atrain_3A0".
std::string SanitizeForPath(const std::string& model_id);

}  // namespace loom::store
