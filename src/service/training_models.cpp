// TrainingModels: create_model, admission onto a model, the wait for a slot,
// failing a model, and what the engine thread and the janitor ask of the
// models.
#include "service/training_models.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "service/util.h"
#include "store/tinker_rows.h"

namespace loom::service {

TrainingModels::TrainingModels(const ServiceOptions& options, const engine::ModelInfo& info,
                               store::Registry& registry, FutureTable& futures, ServiceLock& lock,
                               Sessions& sessions, IdempotencyMemory& idempotency, Usage& usage)
    : options_(options),
      info_(info),
      registry_(registry),
      futures_(futures),
      lock_(lock),
      sessions_(sessions),
      idempotency_(idempotency),
      usage_(usage) {
  for (int s = 0; s < info_.max_slots; ++s) free_slots_.insert(s);
}

// -------------------------------------------------------------- admission

int TrainingModels::GrantedLocked() const {
  int granted = 0;
  for (const auto& [id, m] : models_) granted += m->state == ModelState::kActive && !m->waiting_for_slot;
  return granted;
}

Status TrainingModels::AdmitNewModelLocked(const std::string& tenant, bool* wait) const {
  // A live model holds a slot, is about to bind one or waits for one; the
  // others gave theirs back.
  int mine = 0;
  for (const auto& [id, m] : models_) mine += m->state == ModelState::kActive && m->owner == tenant;
  const int quota = options_.max_models_per_tenant;
  if (quota > 0 && mine >= quota) {
    return Status::Exhausted(fmt::format(
        "create_model: tenant quota reached: {} of {} live models (--max-models-per-tenant {}); unload_model one of "
        "yours or let an idle session expire, then retry",
        mine, quota, quota));
  }
  const int slots = info_.max_slots;
  // Behind earlier waiters even when a place is free: nobody overtakes them.
  *wait = GrantedLocked() >= slots || !slot_waiters_.empty();
  if (!*wait) return Status::Ok();
  if (options_.capacity_wait.count() <= 0) {
    return Status::Unavailable(fmt::format(
        "create_model: no free adapter slot: all {} are bound to live models (--max-adapters; --capacity-wait 0 "
        "does not queue); retry later",
        slots));
  }
  const int most = kWaitersPerSlot * slots;
  if (static_cast<int>(slot_waiters_.size()) >= most) {
    return Status::Unavailable(fmt::format(
        "create_model: no free adapter slot and the queue for one is full: {} create_model calls wait already "
        "({} per slot, --max-adapters {}); retry later",
        slot_waiters_.size(), kWaitersPerSlot, slots));
  }
  return Status::Ok();
}

Result<TrainingModels::TrainingModel*> TrainingModels::FindModelLocked(const std::string& tenant,
                                                                       const std::string& model_id,
                                                                       bool must_be_active) {
  auto it = models_.find(model_id);
  if (it == models_.end() || it->second->owner != tenant) {
    return Status::NotFound("model_id '" + model_id + "' not found");
  }
  TrainingModel* m = it->second.get();
  if (must_be_active && m->state != ModelState::kActive) return Status::Precondition(m->state_reason);
  return m;
}

Result<Submitted> TrainingModels::AdmitLocked(const Caller& caller, TrainingModel& model, TrainingOp op) {
  if (auto prior = model.sequencer.Lookup(op.seq_id)) return Submitted{*prior, model.model_id};
  if (model.state != ModelState::kActive) return Status::Precondition(model.state_reason);
  if (op.seq_id < model.sequencer.next_seq()) {
    return Status::Invalid(fmt::format("seq_id: {} is below the next expected seq_id {} of model '{}' "
                                       "(requests of a model are numbered 1, 2, 3, ... without reuse)",
                                       op.seq_id, model.sequencer.next_seq(), model.model_id));
  }
  if (Status window = model.sequencer.CheckWindow(op.seq_id); !window.ok()) return window;
  op.model_id = model.model_id;
  op.request_id = futures_.Create(caller.tenant, OpKindName(op.kind));
  op.arrived = Clock::now();
  op.ticket = next_ticket_++;
  Submitted out{op.request_id, model.model_id};
  const OpKind kind = op.kind;
  model.sequencer.Admit(std::move(op));
  idempotency_.RememberLocked(caller, OpKindName(kind), out);
  sessions_.TouchSessionLocked(model.session_id);
  if (model.sequencer.HasReady()) lock_.work.notify_all();
  return out;
}

Result<Submitted> TrainingModels::SubmitOnModel(const Caller& caller, const std::string& model_id, TrainingOp op,
                                                Status precheck) {
  std::lock_guard<std::mutex> lock(lock_.mu);
  if (lock_.stopping) return Status::Unavailable("server is shutting down");
  std::optional<Submitted> prior;
  if (Status st = idempotency_.IdempotentLocked(caller, OpKindName(op.kind), &prior); !st.ok()) return st;
  if (prior) return *prior;
  auto model = FindModelLocked(caller.tenant, model_id, /*must_be_active=*/false);
  if (!model.ok()) return model.status();
  if (op.seq_id < 1) {
    return Status::Invalid(fmt::format("seq_id: must be >= 1 (got {}); seq_id 0 is the model's create_model",
                                       op.seq_id));
  }
  if (!precheck.ok()) {
    (*model)->sequencer.Skip(op.seq_id);
    if ((*model)->sequencer.HasReady()) lock_.work.notify_all();
    return precheck;
  }
  return AdmitLocked(caller, **model, std::move(op));
}

Result<Submitted> TrainingModels::CreateModelLocked(const Caller& caller, const tinker::CreateModelRequest& request,
                                                    std::optional<tinker::TinkerPath> load_path,
                                                    bool with_optimizer) {
  const auto& info = info_;
  if (request.base_model != options_.base_model_name) {
    return Status::Invalid(fmt::format("create_model.base_model: '{}' is not served here; this server serves '{}'",
                                       request.base_model, options_.base_model_name));
  }
  if (request.lora.rank < 1 || request.lora.rank > info.max_rank) {
    return Status::Invalid(fmt::format("create_model.lora_config.rank: {} is outside [1, {}] (--max-rank)",
                                       request.lora.rank, info.max_rank));
  }
  if (lock_.stopping) return Status::Unavailable("server is shutting down");
  std::optional<Submitted> prior;
  if (Status st = idempotency_.IdempotentLocked(caller, OpKindName(OpKind::kCreateModel), &prior); !st.ok()) {
    return st;
  }
  if (prior) return *prior;
  Sessions::Session* session = sessions_.FindLocked(request.session_id);
  if (session == nullptr || session->owner != caller.tenant) {
    return Status::NotFound("create_model.session_id: session '" + request.session_id + "' not found");
  }
  if (session->expired) {
    return Status::Precondition("create_model.session_id: session '" + request.session_id +
                                "' expired (no heartbeat); create a new ServiceClient");
  }
  const std::string model_id = fmt::format("{}:train:{}", request.session_id, request.model_seq_id);
  if (auto it = models_.find(model_id); it != models_.end()) {
    if (auto first = it->second->sequencer.Lookup(0)) return Submitted{*first, model_id};
  }
  // Limits up front: nothing is recorded for a model that may not have or wait for a slot.
  bool wait = false;
  if (Status st = AdmitNewModelLocked(caller.tenant, &wait); !st.ok()) return st;
  auto model = std::make_unique<TrainingModel>();
  model->model_id = model_id;
  model->owner = caller.tenant;
  model->session_id = request.session_id;
  model->base_model = request.base_model;
  model->lora = request.lora;
  model->lora.alpha = options_.lora_alpha;
  if (!request.seed_given) model->lora.seed = RandomU64();
  TrainingModel& m = *model;
  models_[model_id] = std::move(model);
  session->model_ids.push_back(model_id);

  store::TrainingRun run;
  run.owner = caller.tenant;
  run.model_id = model_id;
  run.base_model = request.base_model;
  run.lora_rank = request.lora.rank;
  run.train_attn = request.lora.train_attn;
  run.train_mlp = request.lora.train_mlp;
  run.train_unembed = request.lora.train_unembed;
  run.created_ms = run.last_request_ms = NowMs();
  run.user_metadata = store::UserMetadataText(request.user_metadata);
  if (Status st = registry_.UpsertRun(run); !st.ok()) {
    log::Warn("run_record_failed model={} error={}", model_id, st.message());
  }

  TrainingOp op;
  op.kind = OpKind::kCreateModel;
  op.seq_id = 0;
  op.load_path = std::move(load_path);
  op.with_optimizer = with_optimizer;
  if (wait) {  // before admission, so that the engine thread never sees it ready
    m.waiting_for_slot = true;
    m.waiting_since = Clock::now();
  }
  auto submitted = AdmitLocked(caller, m, std::move(op));
  if (wait && submitted.ok()) {
    slot_waiters_.push_back(&m);
    log::Info("model_waiting_for_slot model={} tenant={} waiters={}", model_id, caller.tenant, slot_waiters_.size());
    RefreshWaitersLocked();
  }
  return submitted;
}

void TrainingModels::RefreshWaitersLocked() {
  const size_t n = slot_waiters_.size();
  for (size_t i = 0; i < n; ++i) {
    const TrainingModel& m = *slot_waiters_[i];
    auto create = m.sequencer.Lookup(0);
    if (!create) continue;
    futures_.SetQueueState(
        *create, QueueState::kPausedCapacity,
        fmt::format("waiting for an adapter slot: all {} are in use (--max-adapters); {} of {} in the queue; "
                    "create_model fails after {} s of waiting (--capacity-wait)",
                    info_.max_slots, i + 1, n, options_.capacity_wait.count() / 1000.0));
  }
}

void TrainingModels::GrantWaitersLocked() {
  bool granted = false;
  while (!slot_waiters_.empty() && GrantedLocked() < info_.max_slots) {
    TrainingModel& m = *slot_waiters_.front();
    slot_waiters_.pop_front();
    m.waiting_for_slot = false;
    if (auto create = m.sequencer.Lookup(0)) futures_.SetQueueState(*create, QueueState::kActive);
    log::Info("model_granted_slot model={} tenant={} waited_s={:.3f}", m.model_id, m.owner,
              std::chrono::duration<double>(Clock::now() - m.waiting_since).count());
    granted = true;
  }
  if (!granted) return;
  RefreshWaitersLocked();
  lock_.work.notify_all();
}

void TrainingModels::FailModelLocked(TrainingModel& model, ModelState state, const std::string& reason) {
  const bool was_granted = model.state == ModelState::kActive && !model.waiting_for_slot;
  model.state = state;
  model.state_reason = reason;
  if (model.slot >= 0) {
    slots_to_release_.push_back(model.slot);
    model.slot = -1;
    usage_.AddSlotSeconds(model.owner, std::chrono::duration<double>(Clock::now() - model.bound_at).count());
  }
  for (TrainingOp& op : model.sequencer.DrainAll()) futures_.Fail(op.request_id, Status::Precondition(reason));
  if (model.waiting_for_slot) {
    model.waiting_for_slot = false;
    slot_waiters_.erase(std::find(slot_waiters_.begin(), slot_waiters_.end(), &model));
    RefreshWaitersLocked();
  }
  // Its place goes to the oldest waiter; the slot itself is released on the
  // engine thread before the waiter's create_model can run (TrainLoop).
  if (was_granted) GrantWaitersLocked();
}

// ------------------------------------------------------- the engine thread

bool TrainingModels::AnyReadyLocked() const {
  for (const auto& [id, m] : models_) {
    if (!m->waiting_for_slot && m->sequencer.HasReady()) return true;
  }
  return false;
}

std::vector<TrainingOp> TrainingModels::PopReadyLocked() {
  std::vector<TrainingModel*> feeding;
  for (auto& [id, m] : models_) {
    if (!m->waiting_for_slot && m->sequencer.HasReady()) feeding.push_back(m.get());
  }
  std::stable_sort(feeding.begin(), feeding.end(), [](const TrainingModel* a, const TrainingModel* b) {
    return a->sequencer.FrontReady().ticket < b->sequencer.FrontReady().ticket;
  });
  std::vector<TrainingOp> ready;
  for (TrainingModel* m : feeding) {
    while (m->sequencer.HasReady()) ready.push_back(m->sequencer.PopReady());
  }
  return ready;
}

TrainingModels::TrainingModel* TrainingModels::FindLocked(const std::string& model_id) {
  auto it = models_.find(model_id);
  return it == models_.end() ? nullptr : it->second.get();
}

Result<TrainingModels::ModelRef> TrainingModels::ModelForRun(const std::string& model_id) {
  std::lock_guard<std::mutex> lock(lock_.mu);
  auto it = models_.find(model_id);
  if (it == models_.end()) return Status::NotFound("model_id '" + model_id + "' not found");
  const TrainingModel& m = *it->second;
  if (m.state != ModelState::kActive) return Status::Precondition(m.state_reason);
  return static_cast<const ModelRef&>(m);
}

int TrainingModels::TakeFreeSlotLocked() {
  if (free_slots_.empty()) return -1;
  const int slot = *free_slots_.begin();
  free_slots_.erase(free_slots_.begin());
  return slot;
}

void TrainingModels::BindLocked(TrainingModel& model, int slot) {
  model.slot = slot;
  model.bound_at = Clock::now();
}

std::vector<int> TrainingModels::TakeSlotsToReleaseLocked() {
  std::vector<int> release;
  release.swap(slots_to_release_);
  return release;
}

void TrainingModels::FreeSlotsLocked(const std::vector<int>& released) {
  for (int s : released) free_slots_.insert(s);
}

std::vector<TrainingOp> TrainingModels::DrainAllLocked() {
  std::vector<TrainingOp> all;
  for (auto& [id, m] : models_) {
    for (TrainingOp& op : m->sequencer.DrainAll()) all.push_back(std::move(op));
  }
  return all;
}

// ------------------------------------------------------------ the janitor

void TrainingModels::ExpireGapsLocked(Clock::time_point now) {
  for (auto& [id, m] : models_) {
    if (m->state != ModelState::kActive || m->sequencer.waiting() == 0) continue;
    const int64_t gap = m->sequencer.next_seq();
    for (TrainingOp& op : m->sequencer.ExpireGap(now, options_.seq_gap_timeout)) {
      futures_.Fail(op.request_id,
                    Status::Precondition(fmt::format(
                        "seq_id {} of model '{}' never arrived within {} s (--seq-gap-timeout); request seq_id {} "
                        "waited behind it and was failed",
                        gap, id, options_.seq_gap_timeout.count() / 1000.0, op.seq_id)));
    }
  }
}

std::vector<TrainingModels::TrainingModel*> TrainingModels::OverdueWaitersLocked(Clock::time_point now) {
  std::vector<TrainingModel*> overdue;
  for (TrainingModel* m : slot_waiters_) {
    if (now - m->waiting_since >= options_.capacity_wait) overdue.push_back(m);
  }
  return overdue;
}

Status TrainingModels::CapacityWaitExpired(const TrainingModel& model) const {
  return Status::Unavailable(fmt::format(
      "create_model: no adapter slot became free within {} s (--capacity-wait): all {} are bound to live models "
      "(--max-adapters {}); model '{}' was not created, retry later",
      options_.capacity_wait.count() / 1000.0, info_.max_slots, info_.max_slots, model.model_id));
}

// ----------------------------------------------------------------- gauges

int TrainingModels::SlotsInUseLocked() const { return info_.max_slots - static_cast<int>(free_slots_.size()); }

void TrainingModels::TenantSlotsLocked(const std::string& tenant, Clock::time_point now,
                                       tinker::TenantUsage* into) const {
  for (const auto& [id, m] : models_) {
    if (m->owner != tenant || m->state != ModelState::kActive) continue;
    if (m->waiting_for_slot) ++into->waiting_models;
    if (m->slot < 0) continue;
    ++into->live_models;
    into->slot_seconds += std::chrono::duration<double>(now - m->bound_at).count();
  }
}

std::set<std::string> TrainingModels::TenantsLocked() const {
  std::set<std::string> tenants;
  for (const auto& [id, m] : models_) {
    if (m->state == ModelState::kActive) tenants.insert(m->owner);
  }
  return tenants;
}

void TrainingModels::QueueDepthsLocked(QueueSnapshot* live) const {
  for (const auto& [id, m] : models_) {
    if (m->state != ModelState::kActive) continue;
    QueueSnapshot::Model q;
    q.queued = m->sequencer.ready_count() + m->sequencer.waiting();
    live->models[id] = q;
  }
}

std::vector<TrainingModels::ModelRef> TrainingModels::TenantModelsLocked(const std::string& tenant,
                                                                        std::vector<bool>* waiting_for_slot) const {
  std::vector<ModelRef> out;
  for (const auto& [id, m] : models_) {
    if (m->owner != tenant || m->state != ModelState::kActive) continue;
    out.push_back(*m);
    waiting_for_slot->push_back(m->waiting_for_slot);
  }
  return out;
}

}  // namespace loom::service
