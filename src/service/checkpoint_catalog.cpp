// CheckpointCatalog (checkpoint_catalog.h): weights info, training runs,
// checkpoints, TTLs and archives.
#include <fmt/format.h>

#include "service/checkpoint_catalog.h"

#include "common/log.h"
#include "service/util.h"
#include "store/archive.h"
#include "store/tinker_rows.h"

namespace loom::service {

namespace {
tinker::Cursor MakeCursor(const tinker::PageParams& p, int64_t total) { return tinker::Cursor{p.offset, p.limit, total}; }

// A run as REST shows it, with its newest checkpoint of each kind.
tinker::TrainingRun DescribeRun(const store::Registry& registry, const store::TrainingRun& r) {
  auto ckpts = registry.ListCheckpoints(r.model_id, store::PageRequest{-1, 0});
  return store::ToTinker(r, ckpts.ok() ? ckpts->items : std::vector<store::Checkpoint>{});
}
}  // namespace

Result<tinker::WeightsInfoResult> CheckpointCatalog::WeightsInfo(const Caller& caller, const tinker::TinkerPath& path) {
  auto ckpt = registry_.GetCheckpoint(path);
  if (!ckpt.ok() || !ckpt->AccessibleBy(caller.tenant)) {
    return Status::NotFound("weights_info.tinker_path: checkpoint '" + path.ToString() + "' not found");
  }
  auto run = registry_.GetRun(ckpt->model_id);
  if (!run.ok()) return Status::NotFound("weights_info.tinker_path: run of '" + path.ToString() + "' not found");
  tinker::WeightsInfoResult info;
  info.base_model = run->base_model;
  info.lora.rank = run->lora_rank;
  info.lora.train_attn = run->train_attn;
  info.lora.train_mlp = run->train_mlp;
  info.lora.train_unembed = run->train_unembed;
  return info;
}

Result<tinker::TrainingRunsPage> CheckpointCatalog::ListTrainingRuns(const Caller& caller, tinker::PageParams page) {
  auto runs = registry_.ListRuns(caller.tenant, store::ToPageRequest(page));
  if (!runs.ok()) return runs.status();
  tinker::TrainingRunsPage out;
  for (const auto& r : runs->items) out.runs.push_back(DescribeRun(registry_, r));
  out.cursor = MakeCursor(page, runs->total);
  return out;
}

Result<tinker::TrainingRun> CheckpointCatalog::GetTrainingRun(const Caller& caller, const std::string& run_id) {
  auto run = registry_.GetRun(run_id);
  if (!run.ok() || run->owner != caller.tenant) {
    return Status::NotFound("training run '" + run_id + "' not found");
  }
  return DescribeRun(registry_, *run);
}

Result<tinker::CheckpointsPage> CheckpointCatalog::ListRunCheckpoints(const Caller& caller, const std::string& run_id) {
  auto run = registry_.GetRun(run_id);
  if (!run.ok() || run->owner != caller.tenant) {
    return Status::NotFound("training run '" + run_id + "' not found");
  }
  auto ckpts = registry_.ListCheckpoints(run_id, store::PageRequest{-1, 0});
  if (!ckpts.ok()) return ckpts.status();
  tinker::CheckpointsPage out;
  for (const auto& c : ckpts->items) out.checkpoints.push_back(store::ToTinker(c));
  out.cursor = tinker::Cursor{0, static_cast<int64_t>(out.checkpoints.size()), ckpts->total};
  return out;
}

Result<tinker::CheckpointsPage> CheckpointCatalog::ListUserCheckpoints(const Caller& caller, tinker::PageParams page) {
  auto ckpts = registry_.ListOwnerCheckpoints(caller.tenant, store::ToPageRequest(page));
  if (!ckpts.ok()) return ckpts.status();
  tinker::CheckpointsPage out;
  for (const auto& c : ckpts->items) out.checkpoints.push_back(store::ToTinker(c));
  out.cursor = MakeCursor(page, ckpts->total);
  return out;
}

Result<store::Checkpoint> CheckpointCatalog::OwnedCheckpoint(const Caller& caller, const std::string& run_id,
                                                   const std::string& checkpoint_id) {
  auto path = tinker::ParseCheckpointId(run_id, checkpoint_id);
  if (!path.ok()) return path.status();
  auto ckpt = registry_.GetCheckpoint(*path);
  if (!ckpt.ok() || ckpt->owner != caller.tenant) {
    return Status::NotFound("checkpoint '" + path->ToString() + "' not found");
  }
  return ckpt;
}

Status CheckpointCatalog::DeleteCheckpoint(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  return registry_.DeleteCheckpoint(ckpt->path());
}

Status CheckpointCatalog::SetCheckpointTtl(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id,
                                 std::optional<int64_t> ttl_seconds) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  std::optional<int64_t> expires;
  if (ttl_seconds) {
    if (*ttl_seconds < 1) return Status::Invalid(fmt::format("ttl_seconds: must be >= 1 or null (got {})", *ttl_seconds));
    expires = store::ExpiryMs(NowMs(), *ttl_seconds);  // saturated, never wraps into the past
  }
  return registry_.SetExpiry(ckpt->path(), expires);
}

Status CheckpointCatalog::SetCheckpointPublic(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id,
                                    bool is_public) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  return registry_.SetPublic(ckpt->path(), is_public);
}

Result<std::string> CheckpointCatalog::CreateArchiveToken(const Caller& caller, const std::string& run_id,
                                                const std::string& checkpoint_id, int64_t* expires_unix) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  std::string token = RandomHex(24);
  std::lock_guard<std::mutex> lock(grants_mu_);
  archives_[token] =
      ArchiveGrant{ckpt->path(), "", Clock::now() + options_.archive_url_ttl};
  if (expires_unix) *expires_unix = NowMs() / 1000 + options_.archive_url_ttl.count();
  return token;
}

Result<std::string> CheckpointCatalog::ReadArchive(const std::string& token) {
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


void CheckpointCatalog::SweepExpired() {
  auto swept = registry_.SweepExpired(NowMs());
  if (swept.ok() && !swept->empty()) log::Info("ttl_sweep removed={}", swept->size());
}

void CheckpointCatalog::ExpireGrants(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(grants_mu_);
  for (auto it = archives_.begin(); it != archives_.end();) {
    it = it->second.expires < now ? archives_.erase(it) : std::next(it);
  }
}

}  // namespace loom::service
