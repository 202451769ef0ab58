// Service: the REST side (training runs, checkpoints, sessions, archives).
// Every lookup compares the record's owner with the caller and answers a
// foreign record exactly like a missing one.
#include <fmt/format.h>

#include "service/service.h"
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

Result<tinker::TrainingRunsPage> Service::ListTrainingRuns(const Caller& caller, tinker::PageParams page) {
  auto runs = registry_->ListRuns(caller.tenant, store::ToPageRequest(page));
  if (!runs.ok()) return runs.status();
  tinker::TrainingRunsPage out;
  for (const auto& r : runs->items) out.runs.push_back(DescribeRun(*registry_, r));
  out.cursor = MakeCursor(page, runs->total);
  return out;
}

Result<tinker::TrainingRun> Service::GetTrainingRun(const Caller& caller, const std::string& run_id) {
  auto run = registry_->GetRun(run_id);
  if (!run.ok() || run->owner != caller.tenant) {
    return Status::NotFound("training run '" + run_id + "' not found");
  }
  return DescribeRun(*registry_, *run);
}

Result<tinker::CheckpointsPage> Service::ListRunCheckpoints(const Caller& caller, const std::string& run_id) {
  auto run = registry_->GetRun(run_id);
  if (!run.ok() || run->owner != caller.tenant) {
    return Status::NotFound("training run '" + run_id + "' not found");
  }
  auto ckpts = registry_->ListCheckpoints(run_id, store::PageRequest{-1, 0});
  if (!ckpts.ok()) return ckpts.status();
  tinker::CheckpointsPage out;
  for (const auto& c : ckpts->items) out.checkpoints.push_back(store::ToTinker(c));
  out.cursor = tinker::Cursor{0, static_cast<int64_t>(out.checkpoints.size()), ckpts->total};
  return out;
}

Result<tinker::CheckpointsPage> Service::ListUserCheckpoints(const Caller& caller, tinker::PageParams page) {
  auto ckpts = registry_->ListOwnerCheckpoints(caller.tenant, store::ToPageRequest(page));
  if (!ckpts.ok()) return ckpts.status();
  tinker::CheckpointsPage out;
  for (const auto& c : ckpts->items) out.checkpoints.push_back(store::ToTinker(c));
  out.cursor = MakeCursor(page, ckpts->total);
  return out;
}

Result<store::Checkpoint> Service::OwnedCheckpoint(const Caller& caller, const std::string& run_id,
                                                   const std::string& checkpoint_id) {
  auto path = tinker::ParseCheckpointId(run_id, checkpoint_id);
  if (!path.ok()) return path.status();
  auto ckpt = registry_->GetCheckpoint(*path);
  if (!ckpt.ok() || ckpt->owner != caller.tenant) {
    return Status::NotFound("checkpoint '" + path->ToString() + "' not found");
  }
  return ckpt;
}

Status Service::DeleteCheckpoint(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  return registry_->DeleteCheckpoint(ckpt->path());
}

Status Service::SetCheckpointTtl(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id,
                                 std::optional<int64_t> ttl_seconds) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  std::optional<int64_t> expires;
  if (ttl_seconds) {
    if (*ttl_seconds < 1) return Status::Invalid(fmt::format("ttl_seconds: must be >= 1 or null (got {})", *ttl_seconds));
    expires = store::ExpiryMs(NowMs(), *ttl_seconds);  // saturated, never wraps into the past
  }
  return registry_->SetExpiry(ckpt->path(), expires);
}

Status Service::SetCheckpointPublic(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id,
                                    bool is_public) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  return registry_->SetPublic(ckpt->path(), is_public);
}

Result<std::string> Service::CreateArchiveToken(const Caller& caller, const std::string& run_id,
                                                const std::string& checkpoint_id, int64_t* expires_unix) {
  auto ckpt = OwnedCheckpoint(caller, run_id, checkpoint_id);
  if (!ckpt.ok()) return ckpt.status();
  std::string token = RandomHex(24);
  std::lock_guard<std::mutex> lock(mu_);
  archives_[token] =
      ArchiveGrant{ckpt->path(), "", Clock::now() + options_.archive_url_ttl};
  if (expires_unix) *expires_unix = NowMs() / 1000 + options_.archive_url_ttl.count();
  return token;
}

Result<std::string> Service::ReadArchive(const std::string& token) {
  ArchiveGrant grant;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = archives_.find(token);
    if (it == archives_.end() || it->second.expires < Clock::now()) {
      return Status::NotFound("archive link not found or expired; ask for a new one");
    }
    grant = it->second;
  }
  auto ckpt = registry_->GetCheckpoint(grant.path);
  if (!ckpt.ok()) return Status::NotFound("archive: checkpoint " + grant.path.ToString() + " is gone (deleted?)");
  store::TarOptions options;
  options.prefix = grant.prefix;
  auto tar = store::TarDirectory(ckpt->dir, options);
  if (!tar.ok() && tar.status().code() == Code::kInvalidArgument) {
    return Status::NotFound("archive: checkpoint files are gone (deleted?)");
  }
  return tar;
}

Result<tinker::SessionsPage> Service::ListSessions(const Caller& caller, tinker::PageParams page) {
  auto sessions = registry_->ListSessions(caller.tenant, store::ToPageRequest(page));
  if (!sessions.ok()) return sessions.status();
  tinker::SessionsPage out;
  for (const auto& s : sessions->items) out.session_ids.push_back(s.session_id);
  return out;
}

Result<tinker::SessionInfo> Service::GetSession(const Caller& caller, const std::string& session_id) {
  tinker::SessionInfo out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it != sessions_.end()) {
      if (it->second.owner != caller.tenant) return Status::NotFound("session '" + session_id + "' not found");
      return tinker::SessionInfo{it->second.model_ids, it->second.sampler_ids};
    }
  }
  auto rec = registry_->GetSession(session_id);
  if (!rec.ok() || rec->owner != caller.tenant) return Status::NotFound("session '" + session_id + "' not found");
  auto all = registry_->ListRuns(caller.tenant, store::PageRequest{-1, 0});
  if (all.ok()) {
    const std::string prefix = session_id + ":train:";
    for (const auto& r : all->items) {
      if (r.model_id.rfind(prefix, 0) == 0) out.training_run_ids.push_back(r.model_id);
    }
  }
  return out;
}

}  // namespace loom::service
