// The directory name of a training run under <data_dir>/runs/. Pure; any thread.
#pragma once
#include <string>

namespace loom::store {

// Injective map from a validated model_id (tinker::ValidateModelId) to one
// directory name: keeps [A-Za-z0-9.-] and writes every other byte as "_XX"
// (hex), so "s:train:0" becomes "s_3Atrain_3A0".
std::string SanitizeForPath(const std::string& model_id);

}  // namespace loom::store
