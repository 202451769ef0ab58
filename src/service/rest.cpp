// Checkpoints: the REST side (weights info, training runs, checkpoints,
// archives). Every lookup compares the record's owner with the caller and
// answers a foreign record exactly like a missing one.
#include <fmt/format.h>

#include "service/checkpoints.h"
#include "service/util.h"
#include "store/archive.h"

namespace loom::service {

namespace {
store::PageRequest ToStore(const wire::PageParams& p) { return store::PageRequest{p.limit, p.offset}; }

wire::Cursor MakeCursor(const wire::PageParams& p, int64_t total) { return wire::Cursor{p.offset, p.limit, total}; }
}  // namespace

wire::Checkpoint Checkpoints::ToWire(const store::Checkpoint& c) const {
  wire::Checkpoint w;
  w.path.training_run_id = c.model_id;
  w.path.kind = c.kind == store::kSamplerWeightsKind ? wire::TinkerPath::Kind::kSampler
                                                     : wire::TinkerPath::Kind::kTraining;
  w.path.name = c.name;
  w.time = c.created_ms / 1000;
  w.size_bytes = c.size_bytes;
  w.is_public = c.is_public;
  if (c.expires_ms) w.expires_at = *c.expires_ms / 1000;
  return w;
}

wire::TrainingRun Checkpoints::ToWire(const store::TrainingRun& r) {
  wire::TrainingRun w;
  w.training_run_id = r.model_id;
  w.base_model = r.base_model;
  w.model_owner = r.owner;
  w.is_lora = true;
  w.last_request_time = r.last_request_ms / 1000;
  w.lora_rank = r.lora_rank;
  auto ckpts = registry_.ListCheckpoints(r.model_id, store::PageRequest{-1, 0});
  if (ckpts.ok()) {
    for (const store::Checkpoint& c : ckpts->items) {  // newest first
      if (c.kind == store::kWeightsKind && !w.last_checkpoint) w.last_checkpoint = ToWire(c);
      if (c.kind == store::kSamplerWeightsKind && !w.last_sampler_checkpoint) w.last_sampler_checkpoint = ToWire(c);
    }
  }
  auto meta = nlohmann::json::parse(r.user_metadata, nullptr, /*allow_exceptions=*/false);
  if (meta.is_object()) {
    for (auto& [k, v] : meta.items()) w.user_metadata[k] = v.is_string() ? v.get<std::string>() : v.dump();
  }
  return w;
}

Result<nlohmann::json> Checkpoints::WeightsInfo(const Caller& caller, const wire::TinkerPath& path) {
  auto ckpt = registry_.GetCheckpointByPath(path.ToString());
  if (!ckpt.ok() || !ckpt->AccessibleBy(caller.tenant)) {
    return Status::NotFound("weights_info.tinker_path: checkpoint '" + path.ToString() + "' not found");
  }
  auto run = registry_.GetRun(ckpt->model_id);
  if (!run.ok()) return Status::NotFound("weights_info.tinker_path: run of '" + path.ToString() + "' not found");
  engine::LoraConfig lora;
  lora.rank = run->lora_rank;
  lora.train_attn = run->train_attn;
  lora.train_mlp = run->train_mlp;
  lora.train_unembed = run->train_unembed;
  return wire::WeightsInfoJson(run->base_model, lora);
}

Result<nlohmann::json> Checkpoints::ListTrainingRuns(const Caller& caller, wire::PageParams page) {
  auto runs = registry_.ListRuns(caller.tenant, ToStore(page));
  if (!runs.ok()) return runs.status();
  std::vector<wire::TrainingRun> out;
  for (const auto& r : runs->items) out.push_back(ToWire(r));
  return wire::TrainingRunsJson(out, MakeCursor(page, runs->total));
}

Result<nlohmann::json> Checkpoints::GetTrainingRun(const Caller& caller, const std::string& run_id) {
  auto run = registry_.GetRun(run_id);
  if (!run.ok() || run->owner != caller.tenant) {
    return Status::NotFound("training run '" + run_id + "' not found");
  }
  return wire::TrainingRunJson(ToWire(*run));
}

Result<nlohmann::json> Checkpoints::ListRunCheckpoints(const Caller& caller, const std::string& run_id) {
  auto run = registry_.GetRun(run_id);
  if (!run.ok() || run->owner != caller.tenant) {
    return Status::NotFound("training run '" + run_id + "' not found");
  }
  auto ckpts = registry_.ListCheckpoints(run_id, store::PageRequest{-1, 0});
  if (!ckpts.ok()) return ckpts.status();
  std::vector<wire::Checkpoint> out;
  for (const auto& c : ckpts->items) out.push_back(ToWire(c));
  return wire::CheckpointsListJson(out, wire::Cursor{0, static_cast<int64_t>(out.size()), ckpts->total});
}

Result<nlohmann::json> Checkpoints::ListUserCheckpoints(const Caller& caller, wire::PageParams page) {
  auto ckpts = registry_.ListOwnerCheckpoints(caller.tenant, ToStore(page));
  if (!ckpts.ok()) return ckpts.status();
  std::vector<wire::Checkpoint> out;
  for (const auto& c : ckpts->items) out.push_back(ToWire(c));
  return wire::CheckpointsListJson(out, MakeCursor(page, ckpts->total));
}

Result<store::Checkpoint> Checkpoints::OwnedCheckpoint(const Caller& caller, const std::string& run_id,
                                                   const std::string& checkpoint_id) {
  auto path = store::ParseCheckpointId(run_id, checkpoint_id);
  if (!path.ok()) return path.status();
  auto ckpt = registry_.GetCheckpoint(*path);
  if (!ckpt.ok() || ckpt->owner != caller.tenant) {
    return Status::NotFound("checkpoint '" + path->ToString() + "' not found");
  }
  return ckpt;
}

Status Checkpoints::DeleteCheckpoint(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  return registry_.DeleteCheckpoint(store::TinkerPath{ckpt->model_id, ckpt->kind, ckpt->name});
}

Status Checkpoints::SetCheckpointTtl(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id,
                                 std::optional<int64_t> ttl_seconds) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  std::optional<int64_t> expires;
  if (ttl_seconds) {
    if (*ttl_seconds < 1) return Status::Invalid(fmt::format("ttl_seconds: must be >= 1 or null (got {})", *ttl_seconds));
    expires = store::ExpiryMs(NowMs(), *ttl_seconds);  // saturated, never wraps into the past
  }
  return registry_.SetExpiry(store::TinkerPath{ckpt->model_id, ckpt->kind, ckpt->name}, expires);
}

Status Checkpoints::SetCheckpointPublic(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id,
                                    bool is_public) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  return registry_.SetPublic(store::TinkerPath{ckpt->model_id, ckpt->kind, ckpt->name}, is_public);
}

Result<std::string> Checkpoints::CreateArchiveToken(const Caller& caller, const std::string& run_id,
                                                const std::string& checkpoint_id, int64_t* expires_unix) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  std::string token = RandomHex(24);
  std::lock_guard<std::mutex> lock(grants_mu_);
  archives_[token] =
      ArchiveGrant{store::TinkerPath{ckpt->model_id, ckpt->kind, ckpt->name}, "", Clock::now() + options_.archive_url_ttl};
  if (expires_unix) *expires_unix = NowMs() / 1000 + options_.archive_url_ttl.count();
  return token;
}

Result<std::string> Checkpoints::ReadArchive(const std::string& token) {
  ArchiveGrant grant;
  {
    std::lock_guard<std::mutex> lock(grants_mu_);
    auto it = archives_.find(token);
    if (it == archives_.end() || it->second.expires < Clock::now()) {
      return Status::NotFound("archive link not found or expired; ask for a new one");
    }
    grant = it->second;
  }
  auto ckpt = registry_.GetCheckpoint(grant.path);
  if (!ckpt.ok()) return Status::NotFound("archive: checkpoint " + grant.path.ToString() + " is gone (deleted?)");
  store::TarOptions options;
  options.prefix = grant.prefix;
  auto tar = store::TarDirectory(ckpt->dir, options);
  if (!tar.ok() && tar.status().code() == Code::kInvalidArgument) {
    return Status::NotFound("archive: checkpoint files are gone (deleted?)");
  }
  return tar;
}

}  // namespace loom::service
