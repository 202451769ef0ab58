// Registry rows <-> Tinker types; see tinker_rows.h.
#include "store/tinker_rows.h"

#include <nlohmann/json.hpp>

namespace loom::store {

tinker::Checkpoint ToTinker(const Checkpoint& c) {
  tinker::Checkpoint t;
  t.path = c.path();
  t.time = c.created_ms / 1000;
  t.size_bytes = c.size_bytes;
  t.is_public = c.is_public;
  if (c.expires_ms) t.expires_at = *c.expires_ms / 1000;
  return t;
}

tinker::TrainingRun ToTinker(const TrainingRun& r, const std::vector<Checkpoint>& checkpoints) {
  tinker::TrainingRun t;
  t.training_run_id = r.model_id;
  t.base_model = r.base_model;
  t.model_owner = r.owner;
  t.is_lora = true;
  t.last_request_time = r.last_request_ms / 1000;
  t.lora_rank = r.lora_rank;
  for (const Checkpoint& c : checkpoints) {  // newest first
    if (c.kind == tinker::kWeightsKind && !t.last_checkpoint) t.last_checkpoint = ToTinker(c);
    if (c.kind == tinker::kSamplerWeightsKind && !t.last_sampler_checkpoint) t.last_sampler_checkpoint = ToTinker(c);
  }
  t.user_metadata = ParseUserMetadata(r.user_metadata);
  return t;
}

std::string UserMetadataText(const tinker::UserMetadata& metadata) {
  nlohmann::json meta = nlohmann::json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  return meta.dump();
}

tinker::UserMetadata ParseUserMetadata(const std::string& text) {
  tinker::UserMetadata out;
  auto meta = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (meta.is_object()) {
    for (auto& [k, v] : meta.items()) out[k] = v.is_string() ? v.get<std::string>() : v.dump();
  }
  return out;
}

PageRequest ToPageRequest(const tinker::PageParams& page) { return PageRequest{page.limit, page.offset}; }

}  // namespace loom::store
