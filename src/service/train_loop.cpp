// The engine thread (service/train_loop.h): chores, then feed -> plan -> run -> finish.
#include "service/train_loop.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "common/batch_window.h"
#include "common/log.h"
#include "service/pass_room.h"
#include "service/util.h"

namespace loom::service {

namespace {

// The target tokens a forward_backward scored (its datums' logprobs).
int64_t RequestTokens(const engine::ForwardBackwardOutput& out) {
  int64_t n = 0;
  for (const auto& datum : out.outputs) {
    if (auto it = datum.find("logprobs"); it != datum.end()) n += it->second.numel();
  }
  return n;
}

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

TrainLoop::TrainLoop(const ServiceOptions& options, engine::Engine& engine, FutureTable& futures, Metrics& metrics,
                     Usage& usage, ServiceLock& lock, Sessions& sessions, TrainingModels& models, Checkpoints& checkpoints,
                     Publisher& publisher)
    : options_(options),
      engine_(engine),
      futures_(futures),
      metrics_(metrics),
      usage_(usage),
      lock_(lock),
      sessions_(sessions),
      models_(models),
      checkpoints_(checkpoints),
      publisher_(publisher),
      planner_(sched::PlannerOptions{options.token_budget, options.small_ops_first}) {}

// ------------------------------------------------------------- lifecycle

void TrainLoop::StartLocked(Chores chores) {
  started_ = true;
  chores_ = std::move(chores);
  engine_thread_ = std::thread([this] { EngineLoop(); });
}

void TrainLoop::Stop() {
  {
    std::lock_guard<std::mutex> lock(lock_.mu);
    if (!started_ || lock_.stopping) {
      lock_.stopping = true;
      if (!engine_thread_.joinable()) return;
    }
    lock_.stopping = true;
  }
  lock_.work.notify_all();
  if (engine_thread_.joinable()) engine_thread_.join();
}

void TrainLoop::FailModelLocked(TrainingModel& model, ModelState state, const std::string& reason) {
  models_.FailModelLocked(model, state, reason);
  metrics_.pass_history().Forget(model.model_id);
  for (uint64_t id : planner_.DropModel(model.model_id)) FailPlannedLocked(id, Status::Precondition(reason));
}

void TrainLoop::QueueDepthsLocked(QueueSnapshot* live) const {
  const int64_t now_ms = NowMs();
  for (const auto& [model, depth] : planner_.QueueDepths()) {
    auto& q = live->models[model];
    q.queued += depth;
    q.oldest_wait_s = static_cast<double>(planner_.OldestWaitMs(model, now_ms)) / 1000.0;
  }
  live->token_budget = planner_.token_budget();
}

// ------------------------------------------------------------------ the loop

void TrainLoop::EngineLoop() {
  std::unique_lock<std::mutex> lock(lock_.mu);
  while (true) {
    WaitForWorkLocked(lock);
    chores_(Clock::now());
    ReleaseSlots(lock);
    if (lock_.stopping) {
      FailAllLocked();
      break;
    }
    FeedLocked();
    std::optional<PassWork> work = PlanLocked(lock);
    if (!work) continue;
    lock.unlock();
    // Charged before the pass runs: its futures may be answered (and the
    // tenant read its usage) before FinishPass.
    for (const std::string& owner : PassOwners(*work)) usage_.AddPass(owner);
    RunPass(*work, Clock::now());
    lock.lock();
  }
}

void TrainLoop::WaitForWorkLocked(std::unique_lock<std::mutex>& lock) {
  lock_.work.wait_for(lock, options_.janitor_period, [&] {
    return lock_.stopping || !planner_.empty() || models_.AnyReadyLocked() || models_.HasSlotsToReleaseLocked();
  });
}

void TrainLoop::ReleaseSlots(std::unique_lock<std::mutex>& lock) {
  if (!models_.HasSlotsToReleaseLocked()) return;
  std::vector<int> release = models_.TakeSlotsToReleaseLocked();
  lock.unlock();
  for (int s : release) engine_.ReleaseSlot(s);
  lock.lock();
  models_.FreeSlotsLocked(release);
}

void TrainLoop::FailAllLocked() {
  for (auto& [id, planned] : planned_) {
    futures_.Fail(planned.op.request_id, Status::Unavailable("server is shutting down; request was not run"));
  }
  planned_.clear();
  planner_ = sched::Planner(sched::PlannerOptions{options_.token_budget, options_.small_ops_first});
  for (TrainingOp& op : models_.DrainAllLocked()) {
    futures_.Fail(op.request_id, Status::Unavailable("server is shutting down; request was not run"));
  }
}

void TrainLoop::FeedLocked() {
  std::vector<TrainingOp> ready = models_.PopReadyLocked();
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

std::optional<TrainLoop::PassWork> TrainLoop::PlanLocked(std::unique_lock<std::mutex>& lock) {
  if (BatchWindowOpenLocked(lock)) return std::nullopt;
  // The room free now, not only the budget sized at start-up: snapshots
  // awaiting their writers (and whatever else was allocated since) hold
  // memory the budget counted as free, and a pass planned past the room
  // would fail whole. Sized as options_.pass_sizing says.
  const auto share = [&](int64_t tokens) {
    return tokens > 0 ? std::max<int64_t>(1, tokens / options_.room_share) : 0;
  };
  auto pass = planner_.Next(
      PassRoomTokens(share(engine_.KeptPassTokens()), share(engine_.MaxPassTokens()), options_));
  if (!pass) return std::nullopt;
  PassWork work = TakePassLocked(std::move(*pass));
  if (work.pieces.empty()) return std::nullopt;
  return work;
}

void TrainLoop::FailPlannedLocked(uint64_t plan_id, const Status& status) {
  planner_.Remove(plan_id);  // its later pieces, if any, will not run
  auto it = planned_.find(plan_id);
  if (it == planned_.end()) return;
  futures_.Fail(it->second.op.request_id, status);
  planned_.erase(it);
}

TrainLoop::PassWork TrainLoop::TakePassLocked(sched::Pass pass) {
  PassWork work;
  const auto now = Clock::now();
  for (const sched::Piece& piece : pass.pieces) {
    auto pit = planned_.find(piece.request_id);
    if (pit == planned_.end()) continue;  // its model was dropped meanwhile
    Planned& planned = pit->second;
    TrainingModel* model = models_.FindLocked(piece.model_id);
    if (model == nullptr || model->state != ModelState::kActive ||
        (planned.op.kind != OpKind::kCreateModel && model->slot < 0)) {
      FailPlannedLocked(piece.request_id,
                        model == nullptr ? Status::NotFound("model_id '" + piece.model_id + "' not found")
                        : model->state != ModelState::kActive ? Status::Precondition(model->state_reason)
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
    pw.slot = model->slot;
    pw.owner = model->owner;
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

bool TrainLoop::BatchWindowOpenLocked(std::unique_lock<std::mutex>& lock) {
  const BatchWindow rule{options_.batch_window};
  if (!rule.enabled() || planner_.empty()) return false;
  const auto now = Clock::now();
  const auto oldest_arrival = now - std::chrono::milliseconds(planner_.OldestWaitMs(NowMs()));
  if (!rule.KeepWaiting(now, last_arrival_, oldest_arrival)) return false;
  const auto quiet_at = last_arrival_ + options_.batch_window;
  // Sleep until the window closes or a new request arrives (then look
  // again). Not AnyReadyLocked(): the planner's queue is non-empty here, and
  // waking on it would spin and starve the submitting threads of mu_.
  lock_.work.wait_until(lock, quiet_at, [&] { return lock_.stopping || models_.AnyReadyLocked(); });
  return true;
}

void TrainLoop::RunPass(PassWork& work, Clock::time_point started) {
  switch (work.pass.kind) {
    case sched::OpKind::kPackable: RunForwardBackwardPass(work, started); break;
    case sched::OpKind::kOptim: RunOptimPass(work, started); break;
    case sched::OpKind::kExclusive:
      for (PieceWork& pw : work.pieces) {
        switch (pw.op.kind) {
          case OpKind::kCreateModel: RunCreateModel(pw.op); break;
          case OpKind::kSaveWeights: RunSave(pw.op); break;
          case OpKind::kLoadWeights: RunLoadWeights(pw.op); break;
          case OpKind::kSaveForSampler: RunSaveForSampler(pw.op); break;
          default: futures_.Fail(pw.op.request_id, Status::Internal("unexpected request kind")); break;
        }
      }
      FinishPass(work, started);
      break;
  }
}

std::set<std::string> TrainLoop::PassOwners(const PassWork& work) {
  std::set<std::string> owners;
  for (const PieceWork& pw : work.pieces) owners.insert(pw.owner);
  return owners;
}

void TrainLoop::FinishPass(const PassWork& work, Clock::time_point started) {
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  std::set<std::string> models;
  for (const PieceWork& pw : work.pieces) models.insert(pw.piece.model_id);
  const char* kind = PassKindName(work.pass);
  metrics_.RecordPass(kind, work.pass.tokens, work.pass.fill_ratio(), models.size(), seconds);
  if (work.pass.kind != sched::OpKind::kExclusive) {
    log::Info("pass kind={} models={} pieces={} tokens={} budget={} fill={:.3f} ms={:.1f}", kind, models.size(),
              work.pieces.size(), work.pass.tokens, work.pass.token_budget, work.pass.fill_ratio(), seconds * 1e3);
  }
}

void TrainLoop::RunForwardBackwardPass(PassWork& work, Clock::time_point started) {
  std::vector<engine::ForwardBackwardCall> calls;
  calls.reserve(work.pieces.size());
  for (PieceWork& pw : work.pieces) {
    engine::ForwardBackwardCall call = std::move(pw.op.forward_backward);
    call.slot = pw.slot;
    // A request split over passes takes effect whole or not at all: its
    // slot's gradient is marked before its first piece (FinishPiece rolls
    // back to the mark if a piece fails).
    if (!pw.piece.last && pw.piece.first && !call.forward_only) engine_.MarkGrad(pw.slot);
    calls.push_back(std::move(call));
  }
  auto results = engine_.ForwardBackward(calls);
  if (WholePassFailed(results)) {
    // One tenant's batch may have exhausted memory for everybody: run each
    // call alone so that only the culprit fails.
    log::Warn("pass_failed calls={} error=\"{}\" retrying_one_by_one", calls.size(), results[0].status().message());
    for (size_t i = 0; i < calls.size(); ++i) {
      auto alone = engine_.ForwardBackward({calls[i]});
      results[i] = alone.empty() ? Result<engine::ForwardBackwardOutput>(Status::Internal("engine returned no result"))
                                 : std::move(alone[0]);
    }
  }
  FinishPass(work, started);
  for (size_t i = 0; i < work.pieces.size(); ++i) {
    FinishPiece(work.pieces[i], i < results.size() ? std::move(results[i])
                                                   : Result<engine::ForwardBackwardOutput>(
                                                         Status::Internal("engine returned too few results")));
  }
}

void TrainLoop::FinishPiece(PieceWork& pw, Result<engine::ForwardBackwardOutput> result) {
  const bool split = !(pw.piece.first && pw.piece.last);
  // The engine ran the piece's tokens: charged even if a later piece fails.
  if (result.ok()) usage_.AddTrainerTokens(pw.owner, pw.piece.tokens, pw.op.forward_backward.forward_only);
  if (!result.ok()) {
    Status st = result.status();
    if (split) {
      engine_.RollbackGrad(pw.slot);
      st = Status(st.code(), fmt::format("{} (datums [{}, {}) of a request split over passes by --token-budget; "
                                         "the gradients of its earlier datums were rolled back, so the request "
                                         "had no effect)",
                                         st.message(), pw.piece.datum_begin, pw.piece.datum_end));
    }
    std::lock_guard<std::mutex> lock(lock_.mu);
    if (pw.piece.last) {
      futures_.Fail(pw.op.request_id, st);
    } else {
      FailPlannedLocked(pw.plan_id, st);
    }
    return;
  }
  if (!pw.piece.last) {
    std::lock_guard<std::mutex> lock(lock_.mu);
    auto it = planned_.find(pw.plan_id);
    if (it == planned_.end()) return;  // dropped meanwhile (its future was failed)
    if (it->second.partial) {
      JoinOutput(*it->second.partial, std::move(*result));
    } else {
      it->second.partial = std::move(*result);
    }
    return;
  }
  if (split) engine_.ForgetGradMark(pw.slot);
  engine::ForwardBackwardOutput out = std::move(*result);
  if (pw.partial) {
    JoinOutput(*pw.partial, std::move(out));
    out = std::move(*pw.partial);
  }
  if (!pw.op.forward_backward.forward_only) {
    // The request's whole loss (all its pieces), for the dashboard's curve.
    auto loss = out.metrics.find("loss:sum");
    if (loss != out.metrics.end()) {
      // Under the lock, so that a model unloaded meanwhile (FailModelLocked
      // forgets its history) does not get a history again.
      std::lock_guard<std::mutex> lock(lock_.mu);
      const TrainingModel* model = models_.FindLocked(pw.piece.model_id);
      if (model != nullptr && model->state == ModelState::kActive) {
        metrics_.pass_history().Record(pw.owner, pw.piece.model_id, loss->second, RequestTokens(out), NowMs());
      }
    }
  }
  futures_.Complete(pw.op.request_id, std::move(out));
}

void TrainLoop::RunOptimPass(PassWork& work, Clock::time_point started) {
  std::vector<engine::OptimStepCall> calls;
  for (PieceWork& pw : work.pieces) calls.push_back(engine::OptimStepCall{pw.slot, pw.op.adam});
  auto results = engine_.OptimStep(calls);
  FinishPass(work, started);
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

void TrainLoop::RunCreateModel(TrainingOp& op) {
  int slot = -1;
  engine::LoraConfig lora;
  {
    std::unique_lock<std::mutex> lock(lock_.mu);
    TrainingModel* model = models_.FindLocked(op.model_id);
    slot = model != nullptr && model->state == ModelState::kActive ? models_.TakeFreeSlotLocked() : -1;
    if (slot < 0 && model != nullptr && model->state == ModelState::kActive && models_.HasSlotsToReleaseLocked()) {
      // The place this model was granted is a slot given back since this
      // turn released the last ones: release it now (the lock drops meanwhile).
      ReleaseSlots(lock);
      model = models_.FindLocked(op.model_id);
      slot = model != nullptr && model->state == ModelState::kActive ? models_.TakeFreeSlotLocked() : -1;
    }
    if (model == nullptr || model->state != ModelState::kActive) {
      if (slot >= 0) models_.FreeSlotsLocked({slot});
      futures_.Fail(op.request_id, Status::Precondition(model == nullptr ? "model vanished" : model->state_reason));
      return;
    }
    TrainingModel& m = *model;
    if (slot < 0) {  // only if more models were granted a place than there are slots (a bug)
      const std::string reason = fmt::format(
          "no free adapter slot: all {} are bound to live models (--max-adapters); unload a model or retry later",
          engine_.info().max_slots);
      FailModelLocked(m, ModelState::kFailed, "model '" + op.model_id + "' could not be created: " + reason);
      futures_.Fail(op.request_id, Status::Exhausted(reason));
      return;
    }
    models_.BindLocked(m, slot);  // from now on expiry/unload hands it back via the slots to release
    lora = m.lora;
  }
  Status st = engine_.BindSlot(slot, lora);
  if (st.ok() && op.load_path) st = checkpoints_.Restore(slot, *op.load_path, op.with_optimizer);
  if (!st.ok()) {
    std::lock_guard<std::mutex> lock(lock_.mu);
    TrainingModel* model = models_.FindLocked(op.model_id);
    if (model != nullptr && model->state == ModelState::kActive) {
      FailModelLocked(*model, ModelState::kFailed, "model '" + op.model_id + "' could not be created: " + st.message());
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

void TrainLoop::RunSave(TrainingOp& op) {
  auto ref = models_.ModelForRun(op.model_id);
  if (!ref.ok()) return futures_.Fail(op.request_id, ref.status());
  auto path = checkpoints_.Save(op, *ref);
  if (!path.ok()) return futures_.Fail(op.request_id, path.status());
  futures_.Complete(op.request_id, tinker::SaveWeightsResult{*path});
}

void TrainLoop::RunSaveForSampler(TrainingOp& op) {
  auto ref = models_.ModelForRun(op.model_id);
  if (!ref.ok()) return futures_.Fail(op.request_id, ref.status());
  // Only the snapshot here: the writing, the commit and the answer are the publisher's.
  const Clock::time_point copy_start = Clock::now();
  auto publication = checkpoints_.SnapshotForSampler(op, *ref);
  if (!publication.ok()) return futures_.Fail(op.request_id, publication.status());
  const Clock::time_point handoff_start = Clock::now();
  metrics_.RecordSnapshotCopy(std::chrono::duration<double>(handoff_start - copy_start).count());
  Publisher::Job job{op.request_id, std::move(*publication), std::nullopt, ref->session_id};
  if (op.name.empty()) {  // an unnamed save_weights_for_sampler opens a sampling session on its snapshot
    job.sampler = Sessions::SamplingSession{
        fmt::format("{}:sample:{}", ref->session_id, op.sampling_session_seq_id.value_or(0)), ref->owner,
        ref->base_model, std::nullopt};
  }
  publisher_.Submit(std::move(job));
  metrics_.RecordSnapshotHandoff(std::chrono::duration<double>(Clock::now() - handoff_start).count());
}

void TrainLoop::RunLoadWeights(TrainingOp& op) {
  auto ref = models_.ModelForRun(op.model_id);
  if (!ref.ok()) return futures_.Fail(op.request_id, ref.status());
  auto path = checkpoints_.Load(op, *ref);
  if (!path.ok()) return futures_.Fail(op.request_id, path.status());
  futures_.Complete(op.request_id, tinker::LoadWeightsResult{*path, op.model_id});
}

}  // namespace loom::service
