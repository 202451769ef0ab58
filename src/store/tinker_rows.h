// The registry's rows as Tinker's types (tinker/results.h) and back: the one
// place that maps a stored record to what the REST API answers.
//
// Pure functions; any thread.
#pragma once
#include <string>
#include <vector>

#include "store/registry.h"
#include "tinker/requests.h"
#include "tinker/results.h"

namespace loom::store {

// Seconds, as the API reports times; size, visibility and expiry as stored.
tinker::Checkpoint ToTinker(const Checkpoint& c);
// `checkpoints`: the run's checkpoints newest first (ListCheckpoints); the
// newest of each kind becomes last_checkpoint / last_sampler_checkpoint.
tinker::TrainingRun ToTinker(const TrainingRun& r, const std::vector<Checkpoint>& checkpoints);

// user_metadata as the rows keep it: a JSON object of strings.
std::string UserMetadataText(const tinker::UserMetadata& metadata);
// The inverse; a value that is not a string is kept as its JSON text, text
// that is not a JSON object gives no metadata.
tinker::UserMetadata ParseUserMetadata(const std::string& text);

PageRequest ToPageRequest(const tinker::PageParams& page);

}  // namespace loom::store
