// The engine thread of Service: takes ready requests in packed batches, runs
// them on the Engine (the only thread that does), completes their futures,
// and does the periodic chores (lease expiry, seq gaps, TTLs, slot release).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "common/batch_window.h"
#include "common/log.h"
#include "service/service.h"
#include "service/util.h"

namespace loom::service {

namespace fs = std::filesystem;

namespace {

// What the planner needs to know of a ready request.
sched::Request PlanRequest(uint64_t id, const TrainingOp& op, int64_t arrival_ms) {
  sched::Request r;
  r.id = id;
  r.model_id = op.model_id;
  r.arrival_ms = arrival_ms;
  switch (op.kind) {
    case OpKind::kForwardBackward: {
      const auto& fb = op.forward_backward;
      r.kind = sched::OpKind::kPackable;
      r.batch_key = sched::BatchKey(fb.forward_only ? "forward" : "forward_backward", fb.loss_fn, fb.loss_fn_config);
      for (const auto& d : fb.data) r.datum_tokens.push_back(static_cast<int64_t>(d.tokens.size()));
      break;
    }
    case OpKind::kOptimStep: r.kind = sched::OpKind::kOptim; break;
    default: r.kind = sched::OpKind::kExclusive; break;
  }
  return r;
}

// Joins a split request's piece outputs: datums in order; "x:sum" metrics
// add up, "x:max"/"x:min" take the extreme, others (means) weigh by datums.
void JoinOutput(engine::ForwardBackwardOutput& into, engine::ForwardBackwardOutput&& more) {
  const double n0 = static_cast<double>(into.outputs.size());
  const double n1 = static_cast<double>(more.outputs.size());
  for (auto& [key, v] : more.metrics) {
    auto it = into.metrics.find(key);
    if (it == into.metrics.end()) {
      into.metrics[key] = v;
    } else if (key.ends_with(":sum")) {
      it->second += v;
    } else if (key.ends_with(":max")) {
      it->second = std::max(it->second, v);
    } else if (key.ends_with(":min")) {
      it->second = std::min(it->second, v);
    } else if (n0 + n1 > 0) {
      it->second = (it->second * n0 + v * n1) / (n0 + n1);
    }
  }
  for (auto& o : more.outputs) into.outputs.push_back(std::move(o));
}

// A failure of the whole engine call (an exception such as out-of-memory)
// rather than of one call's data: worth retrying the calls one at a time.
bool WholePassFailed(const std::vector<Result<engine::ForwardBackwardOutput>>& results) {
  if (results.size() < 2) return false;
  for (const auto& r : results) {
    if (r.ok()) return false;
    if (r.status().code() != Code::kInternal && r.status().code() != Code::kResourceExhausted) return false;
  }
  return true;
}

const char* PassKindName(const sched::Pass& pass) {
  switch (pass.kind) {
    case sched::OpKind::kPackable:
      return pass.batch_key.starts_with("forward|") ? "forward" : "forward_backward";
    case sched::OpKind::kOptim: return "optim_step";
    case sched::OpKind::kExclusive: return "exclusive";
  }
  return "?";
}

}  // namespace

bool Service::AnyReadyLocked() const {
  if (!planner_.empty()) return true;
  for (const auto& [id, m] : models_) {
    if (m->sequencer.HasReady()) return true;
  }
  return false;
}

void Service::FeedPlannerLocked() {
  // Everything the sequencers released, each model's in seq_id order; models
  // are fed oldest ready head first, so the planner's anchor tickets follow
  // arrival across models.
  std::vector<TrainingModel*> feeding;
  for (auto& [id, m] : models_) {
    if (m->sequencer.HasReady()) feeding.push_back(m.get());
  }
  std::stable_sort(feeding.begin(), feeding.end(), [](const TrainingModel* a, const TrainingModel* b) {
    return a->sequencer.FrontReady().ticket < b->sequencer.FrontReady().ticket;
  });
  std::vector<TrainingOp> ready;
  for (TrainingModel* m : feeding) {
    while (m->sequencer.HasReady()) ready.push_back(m->sequencer.PopReady());
  }
  const auto now = Clock::now();
  if (!ready.empty()) last_arrival_ = now;
  for (TrainingOp& op : ready) {
    const uint64_t id = next_plan_id_++;
    Status st = planner_.Push(PlanRequest(id, op, NowMs()));
    if (!st.ok()) {
      futures_.Fail(op.request_id, st);
      continue;
    }
    planned_.emplace(id, Planned{std::move(op), now, false, std::nullopt});
  }
}

void Service::FailPlannedLocked(uint64_t plan_id, const Status& status) {
  planner_.Remove(plan_id);  // its later pieces, if any, will not run
  auto it = planned_.find(plan_id);
  if (it == planned_.end()) return;
  futures_.Fail(it->second.op.request_id, status);
  planned_.erase(it);
}

Service::PassWork Service::TakePassLocked(sched::Pass pass) {
  PassWork work;
  const auto now = Clock::now();
  for (const sched::Piece& piece : pass.pieces) {
    auto pit = planned_.find(piece.request_id);
    if (pit == planned_.end()) continue;  // its model was dropped meanwhile
    Planned& planned = pit->second;
    auto mit = models_.find(piece.model_id);
    if (mit == models_.end() || mit->second->state != ModelState::kActive ||
        (planned.op.kind != OpKind::kCreateModel && mit->second->slot < 0)) {
      FailPlannedLocked(piece.request_id,
                        mit == models_.end() ? Status::NotFound("model_id '" + piece.model_id + "' not found")
                        : mit->second->state != ModelState::kActive ? Status::Precondition(mit->second->state_reason)
                                                                      : Status::Precondition("model has no adapter slot"));
      continue;
    }
    if (!planned.started) {
      planned.started = true;
      metrics_.RecordQueueWait(piece.model_id, std::chrono::duration<double>(now - planned.ready_at).count());
    }
    PieceWork pw;
    pw.plan_id = piece.request_id;
    pw.piece = piece;
    pw.slot = mit->second->slot;
    if (pass.kind == sched::OpKind::kPackable && !piece.last) {
      // Copy the call's parameters; move only this piece's datums out.
      TrainingOp& src = planned.op;
      pw.op.kind = src.kind;
      pw.op.request_id = src.request_id;
      pw.op.model_id = src.model_id;
      pw.op.seq_id = src.seq_id;
      pw.op.forward_backward.loss_fn = src.forward_backward.loss_fn;
      pw.op.forward_backward.loss_fn_config = src.forward_backward.loss_fn_config;
      pw.op.forward_backward.forward_only = src.forward_backward.forward_only;
      for (size_t d = piece.datum_begin; d < piece.datum_end; ++d) {
        pw.op.forward_backward.data.push_back(std::move(src.forward_backward.data[d]));
      }
    } else {
      pw.op = std::move(planned.op);
      pw.partial = std::move(planned.partial);
      if (pass.kind == sched::OpKind::kPackable && !piece.first) {
        auto& data = pw.op.forward_backward.data;
        data.erase(data.begin(), data.begin() + static_cast<std::ptrdiff_t>(piece.datum_begin));
      }
      planned_.erase(pit);
    }
    work.pieces.push_back(std::move(pw));
  }
  work.pass = std::move(pass);
  return work;
}

void Service::EngineLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait_for(lock, options_.janitor_period, [&] {
      return stopping_ || AnyReadyLocked() || !slots_to_release_.empty();
    });
    const auto now = Clock::now();
    if (now - last_janitor_ >= options_.janitor_period) {
      JanitorLocked(now, &slots_to_release_);
      last_janitor_ = now;
    }
    if (!slots_to_release_.empty()) {
      std::vector<int> release;
      release.swap(slots_to_release_);
      lock.unlock();
      for (int s : release) engine_->ReleaseSlot(s);
      lock.lock();
      for (int s : release) free_slots_.insert(s);
    }
    if (stopping_) {
      for (auto& [id, planned] : planned_) {
        futures_.Fail(planned.op.request_id, Status::Unavailable("server is shutting down; request was not run"));
      }
      planned_.clear();
      planner_ = sched::Planner(sched::PlannerOptions{options_.token_budget});
      for (auto& [id, m] : models_) {
        for (TrainingOp& op : m->sequencer.DrainAll()) {
          futures_.Fail(op.request_id, Status::Unavailable("server is shutting down; request was not run"));
        }
      }
      break;
    }
    FeedPlannerLocked();
    if (BatchWindowOpenLocked(lock)) continue;
    auto pass = planner_.Next();
    if (!pass) continue;
    PassWork work = TakePassLocked(std::move(*pass));
    if (work.pieces.empty()) continue;
    lock.unlock();
    RunPass(work);
    lock.lock();
  }
}

bool Service::BatchWindowOpenLocked(std::unique_lock<std::mutex>& lock) {
  const BatchWindow rule{options_.batch_window};
  if (!rule.enabled() || planner_.empty()) return false;
  const auto now = Clock::now();
  const auto oldest_arrival = now - std::chrono::milliseconds(planner_.OldestWaitMs(NowMs()));
  if (!rule.KeepWaiting(now, last_arrival_, oldest_arrival)) return false;
  const auto quiet_at = last_arrival_ + options_.batch_window;
  // Sleep until the window closes or a new request arrives (then look
  // again). Not AnyReadyLocked(): the planner's queue is non-empty here, and
  // waking on it would spin and starve the submitting threads of mu_.
  cv_.wait_until(lock, quiet_at, [&] {
    if (stopping_) return true;
    for (const auto& [id, m] : models_)
      if (m->sequencer.HasReady()) return true;
    return false;
  });
  return true;
}

void Service::JanitorLocked(Clock::time_point now, std::vector<int>* slots_to_release) {
  for (auto& [id, session] : sessions_) {
    if (!session.expired && now - session.last_seen > options_.session_ttl) {
      ExpireSessionLocked(session, slots_to_release);
    }
  }
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
  futures_.Sweep(now);
  for (auto it = idempotent_.begin(); it != idempotent_.end();) {
    it = now - it->second.at > std::chrono::hours(1) ? idempotent_.erase(it) : std::next(it);
  }
  for (auto it = archives_.begin(); it != archives_.end();) {
    it = it->second.expires < now ? archives_.erase(it) : std::next(it);
  }
  static thread_local Clock::time_point last_ttl_sweep = now;
  if (now - last_ttl_sweep > std::chrono::seconds(60)) {
    last_ttl_sweep = now;
    auto swept = registry_->SweepExpired(NowMs());
    if (swept.ok() && !swept->empty()) log::Info("ttl_sweep removed={}", swept->size());
  }
}

void Service::ExpireSessionLocked(Session& session, std::vector<int>* slots_to_release) {
  session.expired = true;
  const std::string reason = fmt::format(
      "model expired: session '{}' sent no heartbeat for {} s (--session-ttl), so its adapter slot was released; "
      "saved checkpoints remain loadable",
      session.session_id, options_.session_ttl.count() / 1000.0);
  for (const std::string& mid : session.model_ids) {
    auto it = models_.find(mid);
    if (it != models_.end() && it->second->state == ModelState::kActive) {
      FailModelLocked(*it->second, ModelState::kExpired, reason, slots_to_release);
    }
  }
  log::Info("session_expired session={} models={}", session.session_id, session.model_ids.size());
}

Result<Service::ModelRef> Service::ModelForRun(const std::string& model_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = models_.find(model_id);
  if (it == models_.end()) return Status::NotFound("model_id '" + model_id + "' not found");
  const TrainingModel& m = *it->second;
  if (m.state != ModelState::kActive) return Status::Precondition(m.state_reason);
  return ModelRef{m.model_id, m.owner, m.session_id, m.base_model, m.lora, m.slot};
}

void Service::RunPass(PassWork& work) {
  const auto t0 = Clock::now();
  switch (work.pass.kind) {
    case sched::OpKind::kPackable: RunForwardBackwardPass(work); break;
    case sched::OpKind::kOptim: RunOptimPass(work); break;
    case sched::OpKind::kExclusive:
      for (PieceWork& pw : work.pieces) {
        switch (pw.op.kind) {
          case OpKind::kCreateModel: RunCreateModel(pw.op); break;
          case OpKind::kSaveWeights: RunSaveWeights(pw.op); break;
          case OpKind::kLoadWeights: RunLoadWeights(pw.op); break;
          case OpKind::kSaveForSampler: RunSaveForSampler(pw.op); break;
          default: futures_.Fail(pw.op.request_id, Status::Internal("unexpected request kind")); break;
        }
      }
      break;
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  std::set<std::string> models;
  for (const PieceWork& pw : work.pieces) models.insert(pw.piece.model_id);
  const char* kind = PassKindName(work.pass);
  metrics_.RecordPass(kind, work.pass.tokens, work.pass.fill_ratio(), models.size(), seconds);
  if (work.pass.kind != sched::OpKind::kExclusive) {
    log::Info("pass kind={} models={} pieces={} tokens={} budget={} fill={:.3f} ms={:.1f}", kind, models.size(),
              work.pieces.size(), work.pass.tokens, work.pass.token_budget, work.pass.fill_ratio(), seconds * 1e3);
  }
}

void Service::RunForwardBackwardPass(PassWork& work) {
  std::vector<engine::ForwardBackwardCall> calls;
  calls.reserve(work.pieces.size());
  for (PieceWork& pw : work.pieces) {
    engine::ForwardBackwardCall call = std::move(pw.op.forward_backward);
    call.slot = pw.slot;
    // A request split over passes takes effect whole or not at all: its
    // slot's gradient is marked before its first piece (FinishPiece rolls
    // back to the mark if a piece fails).
    if (!pw.piece.last && pw.piece.first && !call.forward_only) engine_->MarkGrad(pw.slot);
    calls.push_back(std::move(call));
  }
  auto results = engine_->ForwardBackward(calls);
  if (WholePassFailed(results)) {
    // One tenant's batch may have exhausted memory for everybody: run each
    // call alone so that only the culprit fails.
    log::Warn("pass_failed calls={} error=\"{}\" retrying_one_by_one", calls.size(), results[0].status().message());
    for (size_t i = 0; i < calls.size(); ++i) {
      auto alone = engine_->ForwardBackward({calls[i]});
      results[i] = alone.empty() ? Result<engine::ForwardBackwardOutput>(Status::Internal("engine returned no result"))
                                 : std::move(alone[0]);
    }
  }
  for (size_t i = 0; i < work.pieces.size(); ++i) {
    FinishPiece(work.pieces[i], i < results.size() ? std::move(results[i])
                                                   : Result<engine::ForwardBackwardOutput>(
                                                         Status::Internal("engine returned too few results")));
  }
}

void Service::FinishPiece(PieceWork& pw, Result<engine::ForwardBackwardOutput> result) {
  const bool split = !(pw.piece.first && pw.piece.last);
  if (!result.ok()) {
    Status st = result.status();
    if (split) {
      engine_->RollbackGrad(pw.slot);
      st = Status(st.code(), fmt::format("{} (datums [{}, {}) of a request split over passes by --token-budget; "
                                         "the gradients of its earlier datums were rolled back, so the request "
                                         "had no effect)",
                                         st.message(), pw.piece.datum_begin, pw.piece.datum_end));
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (pw.piece.last) {
      futures_.Fail(pw.op.request_id, st);
    } else {
      FailPlannedLocked(pw.plan_id, st);
    }
    return;
  }
  if (!pw.piece.last) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = planned_.find(pw.plan_id);
    if (it == planned_.end()) return;  // dropped meanwhile (its future was failed)
    if (it->second.partial) {
      JoinOutput(*it->second.partial, std::move(*result));
    } else {
      it->second.partial = std::move(*result);
    }
    return;
  }
  if (split) engine_->ForgetGradMark(pw.slot);
  engine::ForwardBackwardOutput out = std::move(*result);
  if (pw.partial) {
    JoinOutput(*pw.partial, std::move(out));
    out = std::move(*pw.partial);
  }
  futures_.Complete(pw.op.request_id, std::move(out));
}

void Service::RunOptimPass(PassWork& work) {
  std::vector<engine::OptimStepCall> calls;
  for (PieceWork& pw : work.pieces) calls.push_back(engine::OptimStepCall{pw.slot, pw.op.adam});
  auto results = engine_->OptimStep(calls);
  for (size_t i = 0; i < work.pieces.size(); ++i) {
    const std::string& rid = work.pieces[i].op.request_id;
    if (i >= results.size()) {
      futures_.Fail(rid, Status::Internal("engine returned too few results"));
    } else if (!results[i].ok()) {
      futures_.Fail(rid, results[i].status());
    } else {
      auto metrics = results[i]->metrics;
      if (results[i]->skipped) metrics["skipped"] = 1.0;
      futures_.Complete(rid, tinker::OptimStepResult{std::move(metrics)});
    }
  }
}

std::string Service::MetricsText() const {
  QueueSnapshot live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t now_ms = NowMs();
    for (const auto& [id, m] : models_) {
      if (m->state != ModelState::kActive) continue;
      QueueSnapshot::Model q;
      q.queued = m->sequencer.ready_count() + m->sequencer.waiting();
      live.models[id] = q;
    }
    for (const auto& [model, depth] : planner_.QueueDepths()) {
      auto& q = live.models[model];
      q.queued += depth;
      q.oldest_wait_s = static_cast<double>(planner_.OldestWaitMs(model, now_ms)) / 1000.0;
    }
    live.slots_total = engine_->info().max_slots;
    live.slots_in_use = live.slots_total - static_cast<int>(free_slots_.size());
    live.token_budget = planner_.token_budget();
  }
  return metrics_.Render(live);
}

void Service::RunCreateModel(TrainingOp& op) {
  int slot = -1;
  engine::LoraConfig lora;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = models_.find(op.model_id);
    if (it == models_.end() || it->second->state != ModelState::kActive) {
      futures_.Fail(op.request_id, Status::Precondition(it == models_.end() ? "model vanished"
                                                                             : it->second->state_reason));
      return;
    }
    TrainingModel& m = *it->second;
    if (free_slots_.empty()) {
      const std::string reason = fmt::format(
          "no free adapter slot: all {} are bound to live models (--max-adapters); unload a model or retry later",
          engine_->info().max_slots);
      FailModelLocked(m, ModelState::kFailed, "model '" + op.model_id + "' could not be created: " + reason,
                      &slots_to_release_);
      futures_.Fail(op.request_id, Status::Exhausted(reason));
      return;
    }
    slot = *free_slots_.begin();
    free_slots_.erase(free_slots_.begin());
    m.slot = slot;  // from now on expiry/unload hands it back via slots_to_release_
    lora = m.lora;
  }
  Status st = engine_->BindSlot(slot, lora);
  if (st.ok() && op.load_path) {
    auto ckpt = registry_->GetCheckpoint(*op.load_path);
    st = ckpt.ok() ? engine_->LoadState(slot, ckpt->dir, op.with_optimizer) : ckpt.status();
  }
  if (!st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = models_.find(op.model_id);
    if (it != models_.end() && it->second->state == ModelState::kActive) {
      FailModelLocked(*it->second, ModelState::kFailed,
                      "model '" + op.model_id + "' could not be created: " + st.message(), &slots_to_release_);
    }
    futures_.Fail(op.request_id, st);
    return;
  }
  log::Info("model_created model={} slot={} rank={}", op.model_id, slot, lora.rank);
  if (op.load_path) {
    futures_.Complete(op.request_id, tinker::LoadWeightsResult{*op.load_path, op.model_id});
    return;
  }
  futures_.Complete(op.request_id, tinker::CreateModelResult{op.model_id});
}

namespace {
// A fresh path under the registry's staging folder that does not exist yet
// (the engine writes its directory atomically and creates it itself).
Result<std::string> StagingTarget(store::Registry& registry) {
  auto dir = registry.NewStagingDir();
  if (!dir.ok()) return dir.status();
  std::error_code ec;
  fs::remove_all(*dir, ec);
  return *dir;
}

std::optional<int64_t> ExpiresMs(int64_t created_ms, const std::optional<int64_t>& ttl_seconds) {
  if (!ttl_seconds) return std::nullopt;
  return store::ExpiryMs(created_ms, *ttl_seconds);  // saturated: a huge TTL never wraps into the past
}
}  // namespace

void Service::RunSaveWeights(TrainingOp& op) {
  auto ref = ModelForRun(op.model_id);
  if (!ref.ok()) return futures_.Fail(op.request_id, ref.status());
  const tinker::TinkerPath path{op.model_id, tinker::TinkerPath::Kind::kTraining, op.name};
  if (!op.overwrite && registry_->GetCheckpoint(path).ok()) {
    return futures_.Fail(op.request_id,
                         Status::Invalid("save_weights.path: checkpoint '" + op.name + "' already exists for model '" +
                                         op.model_id + "'; choose another name or pass overwrite=true"));
  }
  auto staging = StagingTarget(*registry_);
  if (!staging.ok()) return futures_.Fail(op.request_id, staging.status());
  if (Status st = engine_->SaveState(ref->slot, *staging); !st.ok()) return futures_.Fail(op.request_id, st);
  store::CheckpointSpec spec;
  spec.owner = ref->owner;
  spec.model_id = op.model_id;
  spec.kind = path.kind_segment();
  spec.name = op.name;
  spec.created_ms = NowMs();
  spec.expires_ms = ExpiresMs(spec.created_ms, op.ttl_seconds);
  spec.overwrite = op.overwrite;
  auto committed = registry_->CommitCheckpoint(*staging, spec);
  if (!committed.ok()) {
    Status st = committed.status();
    if (st.code() == Code::kAlreadyExists) st = Status::Invalid("save_weights.path: " + st.message());
    return futures_.Fail(op.request_id, st);
  }
  registry_->TouchRun(op.model_id, spec.created_ms);
  futures_.Complete(op.request_id, tinker::SaveWeightsResult{path});
}

void Service::RunLoadWeights(TrainingOp& op) {
  auto ref = ModelForRun(op.model_id);
  if (!ref.ok()) return futures_.Fail(op.request_id, ref.status());
  const tinker::TinkerPath& path = *op.load_path;  // set for every kLoadWeights
  auto ckpt = registry_->GetCheckpoint(path);
  if (!ckpt.ok() || !ckpt->AccessibleBy(ref->owner)) {
    return futures_.Fail(op.request_id, Status::NotFound("load_weights.path: checkpoint '" + path.ToString() +
                                                         "' not found"));
  }
  if (Status st = engine_->LoadState(ref->slot, ckpt->dir, op.with_optimizer); !st.ok()) {
    return futures_.Fail(op.request_id, st);
  }
  futures_.Complete(op.request_id, tinker::LoadWeightsResult{path, op.model_id});
}

void Service::RunSaveForSampler(TrainingOp& op) {
  auto ref = ModelForRun(op.model_id);
  if (!ref.ok()) return futures_.Fail(op.request_id, ref.status());
  const bool named = !op.name.empty();
  const std::string name = named ? op.name : fmt::format("unnamed-seq-{}", op.seq_id);
  const tinker::TinkerPath path{op.model_id, tinker::TinkerPath::Kind::kSampler, name};
  if (named && registry_->GetCheckpoint(path).ok()) {
    return futures_.Fail(op.request_id, Status::Invalid("save_weights_for_sampler.path: checkpoint '" + name +
                                                        "' already exists for model '" + op.model_id +
                                                        "'; choose another name"));
  }
  auto staging = StagingTarget(*registry_);
  if (!staging.ok()) return futures_.Fail(op.request_id, staging.status());
  if (Status st = engine_->SaveForSampler(ref->slot, *staging, ref->base_model); !st.ok()) {
    return futures_.Fail(op.request_id, st);
  }
  store::CheckpointSpec spec;
  spec.owner = ref->owner;
  spec.model_id = op.model_id;
  spec.kind = path.kind_segment();
  spec.name = name;
  spec.created_ms = NowMs();
  spec.expires_ms = ExpiresMs(spec.created_ms, op.ttl_seconds);
  spec.overwrite = !named;  // a retried unnamed save replaces its own snapshot
  auto committed = registry_->CommitCheckpoint(*staging, spec);
  if (!committed.ok()) {
    Status st = committed.status();
    if (st.code() == Code::kAlreadyExists) st = Status::Invalid("save_weights_for_sampler.path: " + st.message());
    return futures_.Fail(op.request_id, st);
  }
  registry_->TouchRun(op.model_id, spec.created_ms);
  std::optional<std::string> sampler_id;
  if (!named) {
    sampler_id = fmt::format("{}:sample:{}", ref->session_id, op.sampling_session_seq_id.value_or(0));
    std::lock_guard<std::mutex> lock(mu_);
    samplers_[*sampler_id] = Sampler{*sampler_id, ref->owner, ref->base_model, path};
    auto sit = sessions_.find(ref->session_id);
    if (sit != sessions_.end()) sit->second.sampler_ids.push_back(*sampler_id);
  }
  futures_.Complete(op.request_id, tinker::SaveWeightsForSamplerResult{path, sampler_id});
}

}  // namespace loom::service
