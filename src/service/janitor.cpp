#include "service/janitor.h"

#include <fmt/format.h>

#include "common/log.h"

namespace loom::service {

void Janitor::SweepIfDueLocked(Clock::time_point now) {
  if (now - last_sweep_ < options_.janitor_period) return;
  SweepLocked(now);
  last_sweep_ = now;
}

void Janitor::SweepLocked(Clock::time_point now) {
  for (Sessions::Session* session : sessions_.ExpireIdleLocked(now)) ExpireSessionLocked(*session);
  for (const auto& base : bases_) {
    base->models.ExpireGapsLocked(now);
    for (TrainingModels::TrainingModel* waiter : base->models.OverdueWaitersLocked(now)) {
      const Status why = base->models.CapacityWaitExpired(*waiter);
      if (auto create = waiter->sequencer.Lookup(0)) futures_.Fail(*create, why);
      base->loop.FailModelLocked(*waiter, TrainingModels::ModelState::kFailed, why.message());
    }
  }
  futures_.Sweep(now);
  idempotency_.ExpireLocked(now);
  catalog_.ExpireGrants(now);
  if (!last_ttl_sweep_) last_ttl_sweep_ = now;
  if (now - *last_ttl_sweep_ > std::chrono::seconds(60)) {
    last_ttl_sweep_ = now;
    catalog_.SweepExpired();
  }
}

void Janitor::ExpireSessionLocked(const Sessions::Session& session) {
  const std::string reason = fmt::format(
      "model expired: session '{}' sent no heartbeat for {} s (--session-ttl), so its adapter slot was released; "
      "saved checkpoints remain loadable",
      session.session_id, options_.session_ttl.count() / 1000.0);
  const Status why = Status::Precondition(fmt::format(
      "sample cancelled: session '{}' sent no heartbeat for {} s (--session-ttl), so its queued and running "
      "samples were dropped; create a new ServiceClient",
      session.session_id, options_.session_ttl.count() / 1000.0));
  for (const auto& base : bases_) {
    for (const std::string& mid : session.model_ids) {
      TrainingModels::TrainingModel* model = base->models.FindLocked(mid);
      if (model != nullptr && model->state == TrainingModels::ModelState::kActive) {
        base->loop.FailModelLocked(*model, TrainingModels::ModelState::kExpired, reason);
      }
    }
    if (base->sampling.sampler) {
      for (const std::string& sid : session.sampler_ids) base->sampling.sampler->Cancel(sid, why);
    }
  }
  log::Info("session_expired session={} models={} sampling_sessions={}", session.session_id, session.model_ids.size(),
            session.sampler_ids.size());
}

}  // namespace loom::service
