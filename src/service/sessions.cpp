// Sessions: create_session, heartbeats, expiry, and the sessions' REST side.
#include "service/sessions.h"

#include <fmt/format.h>

#include "common/log.h"
#include "service/util.h"
#include "store/tinker_rows.h"

namespace loom::service {

Result<std::string> Sessions::CreateSession(const Caller& caller, const tinker::CreateSessionRequest& request) {
  std::lock_guard<std::mutex> lock(lock_.mu);
  if (lock_.stopping) return Status::Unavailable("server is shutting down");
  std::optional<Submitted> prior;
  if (Status st = idempotency_.IdempotentLocked(caller, "create_session", &prior); !st.ok()) return st;
  if (prior) return prior->request_id;
  std::string id = RandomUuid();
  Session& s = sessions_[id];
  s.session_id = id;
  s.owner = caller.tenant;
  s.last_seen = Clock::now();
  store::SessionRecord rec;
  rec.owner = caller.tenant;
  rec.session_id = id;
  rec.created_ms = NowMs();
  rec.user_metadata = store::UserMetadataText(request.user_metadata);
  Status st = registry_.AddSession(rec);
  if (!st.ok()) log::Warn("session_record_failed session={} error={}", id, st.message());
  idempotency_.RememberLocked(caller, "create_session", {id, ""});
  log::Info("session_created session={} tenant={}", id, caller.tenant);
  return id;
}

Status Sessions::Heartbeat(const Caller& caller, const std::string& session_id) {
  std::lock_guard<std::mutex> lock(lock_.mu);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end() || it->second.owner != caller.tenant) {
    return Status::NotFound("session_heartbeat.session_id: session '" + session_id + "' not found");
  }
  if (it->second.expired) {
    return Status::Precondition(fmt::format(
        "session '{}' expired: no heartbeat for {} s, its models' adapter slots were released; create a new "
        "ServiceClient", session_id, options_.session_ttl.count() / 1000.0));
  }
  it->second.last_seen = Clock::now();
  return Status::Ok();
}

Sessions::Session* Sessions::FindLocked(const std::string& session_id) {
  auto it = sessions_.find(session_id);
  return it == sessions_.end() ? nullptr : &it->second;
}

void Sessions::TouchSessionLocked(const std::string& session_id) {
  auto it = sessions_.find(session_id);
  if (it != sessions_.end() && !it->second.expired) it->second.last_seen = Clock::now();
}

void Sessions::AddSamplerLocked(SamplingSession sampler, const std::string& session_id) {
  const std::string id = sampler.sampler_id;
  samplers_[id] = std::move(sampler);
  auto sit = sessions_.find(session_id);
  if (sit != sessions_.end()) sit->second.sampler_ids.push_back(id);
}

const Sessions::SamplingSession* Sessions::FindSamplerLocked(const std::string& sampler_id) const {
  auto it = samplers_.find(sampler_id);
  return it == samplers_.end() ? nullptr : &it->second;
}

void Sessions::CommitSamplerLocked(const std::string& sampler_id, const tinker::TinkerPath& path) {
  auto it = samplers_.find(sampler_id);
  if (it == samplers_.end()) return;
  it->second.model_path = path;
  it->second.snapshot.reset();
  it->second.snapshot_key.clear();
}

std::vector<Sessions::Session*> Sessions::ExpireIdleLocked(Clock::time_point now) {
  std::vector<Session*> expired;
  for (auto& [id, session] : sessions_) {
    if (!session.expired && now - session.last_seen > options_.session_ttl) {
      session.expired = true;
      expired.push_back(&session);
    }
  }
  return expired;
}

// ------------------------------------------------------------------- REST

Result<tinker::SessionsPage> Sessions::ListSessions(const Caller& caller, tinker::PageParams page) {
  auto sessions = registry_.ListSessions(caller.tenant, store::ToPageRequest(page));
  if (!sessions.ok()) return sessions.status();
  tinker::SessionsPage out;
  for (const auto& s : sessions->items) out.session_ids.push_back(s.session_id);
  return out;
}

Result<tinker::SessionInfo> Sessions::GetSession(const Caller& caller, const std::string& session_id) {
  tinker::SessionInfo out;
  {
    std::lock_guard<std::mutex> lock(lock_.mu);
    auto it = sessions_.find(session_id);
    if (it != sessions_.end()) {
      if (it->second.owner != caller.tenant) return Status::NotFound("session '" + session_id + "' not found");
      return tinker::SessionInfo{it->second.model_ids, it->second.sampler_ids};
    }
  }
  auto rec = registry_.GetSession(session_id);
  if (!rec.ok() || rec->owner != caller.tenant) return Status::NotFound("session '" + session_id + "' not found");
  auto all = registry_.ListRuns(caller.tenant, store::PageRequest{-1, 0});
  if (all.ok()) {
    const std::string prefix = session_id + ":train:";
    for (const auto& r : all->items) {
      if (r.model_id.rfind(prefix, 0) == 0) out.training_run_ids.push_back(r.model_id);
    }
  }
  return out;
}

}  // namespace loom::service
