// The engine thread of Service: takes ready requests in packed batches, runs
// them on the Engine (the only thread that does), completes their futures,
// and does the periodic chores (lease expiry, seq gaps, TTLs, slot release).
#include <fmt/format.h>

#include <filesystem>

#include "common/log.h"
#include "service/service.h"
#include "service/util.h"

namespace loom::service {

namespace fs = std::filesystem;

namespace {

// Forward_backwards pack together when they share loss, config and mode.
bool SamePass(const TrainingOp& a, const TrainingOp& b) {
  if (a.kind != b.kind) return false;
  if (a.kind == OpKind::kOptimStep) return true;
  if (a.kind != OpKind::kForwardBackward) return false;
  return a.forward_backward.loss_fn == b.forward_backward.loss_fn &&
         a.forward_backward.forward_only == b.forward_backward.forward_only &&
         a.forward_backward.loss_fn_config == b.forward_backward.loss_fn_config;
}

wire::TinkerPath ToWirePath(const store::TinkerPath& p) {
  wire::TinkerPath w;
  w.training_run_id = p.model_id;
  w.kind = p.kind == store::kSamplerWeightsKind ? wire::TinkerPath::Kind::kSampler : wire::TinkerPath::Kind::kTraining;
  w.name = p.name;
  return w;
}

}  // namespace

bool Service::AnyReadyLocked() const {
  for (const auto& [id, m] : models_) {
    if (m->sequencer.HasReady()) return true;
  }
  return false;
}

Service::Batch Service::TakeBatchLocked() {
  Batch batch;
  // The oldest ready request decides the kind of pass; every other model
  // whose next ready request fits the same pass joins it (one per model, so
  // each model still advances strictly in seq_id order).
  TrainingModel* first = nullptr;
  for (auto& [id, m] : models_) {
    if (!m->sequencer.HasReady()) continue;
    if (!first || m->sequencer.FrontReady().ticket < first->sequencer.FrontReady().ticket) first = m.get();
  }
  if (!first) return batch;
  TrainingOp head = first->sequencer.PopReady();
  batch.kind = head.kind;
  const bool packs = head.kind == OpKind::kForwardBackward || head.kind == OpKind::kOptimStep;
  if (packs) {
    for (auto& [id, m] : models_) {
      if (m.get() == first || !m->sequencer.HasReady()) continue;
      if (SamePass(head, m->sequencer.FrontReady())) batch.ops.push_back(m->sequencer.PopReady());
    }
  }
  batch.ops.insert(batch.ops.begin(), std::move(head));
  return batch;
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
      for (auto& [id, m] : models_) {
        for (TrainingOp& op : m->sequencer.DrainAll()) {
          futures_.Fail(op.request_id, Status::Unavailable("server is shutting down; request was not run"));
        }
      }
      break;
    }
    Batch batch = TakeBatchLocked();
    if (batch.ops.empty()) continue;
    lock.unlock();
    RunBatch(batch);
    lock.lock();
  }
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
    it = now - it->second.second > std::chrono::hours(1) ? idempotent_.erase(it) : std::next(it);
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

void Service::RunBatch(Batch& batch) {
  switch (batch.kind) {
    case OpKind::kForwardBackward: {
      std::vector<engine::ForwardBackwardCall> calls;
      std::vector<const TrainingOp*> owners;
      for (TrainingOp& op : batch.ops) {
        auto ref = ModelForRun(op.model_id);
        if (!ref.ok() || ref->slot < 0) {
          futures_.Fail(op.request_id, ref.ok() ? Status::Precondition("model has no adapter slot") : ref.status());
          continue;
        }
        op.forward_backward.slot = ref->slot;
        calls.push_back(std::move(op.forward_backward));
        owners.push_back(&op);
      }
      if (calls.empty()) return;
      auto results = engine_->ForwardBackward(calls);
      for (size_t i = 0; i < owners.size(); ++i) {
        if (i >= results.size()) {
          futures_.Fail(owners[i]->request_id, Status::Internal("engine returned too few results"));
        } else if (!results[i].ok()) {
          futures_.Fail(owners[i]->request_id, results[i].status());
        } else {
          futures_.Complete(owners[i]->request_id, FutureResult{nullptr, std::move(results[i].value())});
        }
      }
      return;
    }
    case OpKind::kOptimStep: {
      std::vector<engine::OptimStepCall> calls;
      std::vector<const TrainingOp*> owners;
      for (TrainingOp& op : batch.ops) {
        auto ref = ModelForRun(op.model_id);
        if (!ref.ok() || ref->slot < 0) {
          futures_.Fail(op.request_id, ref.ok() ? Status::Precondition("model has no adapter slot") : ref.status());
          continue;
        }
        calls.push_back(engine::OptimStepCall{ref->slot, op.adam});
        owners.push_back(&op);
      }
      if (calls.empty()) return;
      auto results = engine_->OptimStep(calls);
      for (size_t i = 0; i < owners.size(); ++i) {
        if (i >= results.size()) {
          futures_.Fail(owners[i]->request_id, Status::Internal("engine returned too few results"));
        } else if (!results[i].ok()) {
          futures_.Fail(owners[i]->request_id, results[i].status());
        } else {
          auto metrics = results[i]->metrics;
          if (results[i]->skipped) metrics["skipped"] = 1.0;
          futures_.Complete(owners[i]->request_id, FutureResult{wire::OptimStepResultJson(metrics), std::nullopt});
        }
      }
      return;
    }
    default:
      break;
  }
  for (TrainingOp& op : batch.ops) {
    switch (op.kind) {
      case OpKind::kCreateModel: RunCreateModel(op); break;
      case OpKind::kSaveWeights: RunSaveWeights(op); break;
      case OpKind::kLoadWeights: RunLoadWeights(op); break;
      case OpKind::kSaveForSampler: RunSaveForSampler(op); break;
      default: futures_.Fail(op.request_id, Status::Internal("unexpected request kind")); break;
    }
  }
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
  if (st.ok() && !op.load_path.empty()) {
    auto path = store::ParseTinkerPath(op.load_path, "load_weights.path");
    auto ckpt = path.ok() ? registry_->GetCheckpoint(*path) : Result<store::Checkpoint>(path.status());
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
  if (!op.load_path.empty()) {
    auto p = wire::ParseTinkerPath(op.load_path);
    futures_.Complete(op.request_id,
                      FutureResult{p.ok() ? wire::LoadWeightsResultJson(*p, op.model_id)
                                          : wire::CreateModelResultJson(op.model_id),
                                   std::nullopt});
    return;
  }
  futures_.Complete(op.request_id, FutureResult{wire::CreateModelResultJson(op.model_id), std::nullopt});
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
  return created_ms + *ttl_seconds * 1000;
}
}  // namespace

void Service::RunSaveWeights(TrainingOp& op) {
  auto ref = ModelForRun(op.model_id);
  if (!ref.ok()) return futures_.Fail(op.request_id, ref.status());
  store::TinkerPath path{op.model_id, store::kWeightsKind, op.name};
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
  spec.kind = store::kWeightsKind;
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
  futures_.Complete(op.request_id, FutureResult{wire::SaveWeightsResultJson(ToWirePath(path)), std::nullopt});
}

void Service::RunLoadWeights(TrainingOp& op) {
  auto ref = ModelForRun(op.model_id);
  if (!ref.ok()) return futures_.Fail(op.request_id, ref.status());
  auto path = store::ParseTinkerPath(op.load_path, "load_weights.path");
  if (!path.ok()) return futures_.Fail(op.request_id, path.status());
  auto ckpt = registry_->GetCheckpoint(*path);
  if (!ckpt.ok() || !ckpt->AccessibleBy(ref->owner)) {
    return futures_.Fail(op.request_id, Status::NotFound("load_weights.path: checkpoint '" + op.load_path +
                                                         "' not found"));
  }
  if (Status st = engine_->LoadState(ref->slot, ckpt->dir, op.with_optimizer); !st.ok()) {
    return futures_.Fail(op.request_id, st);
  }
  futures_.Complete(op.request_id,
                    FutureResult{wire::LoadWeightsResultJson(ToWirePath(*path), op.model_id), std::nullopt});
}

void Service::RunSaveForSampler(TrainingOp& op) {
  auto ref = ModelForRun(op.model_id);
  if (!ref.ok()) return futures_.Fail(op.request_id, ref.status());
  const bool named = !op.name.empty();
  const std::string name = named ? op.name : fmt::format("unnamed-seq-{}", op.seq_id);
  store::TinkerPath path{op.model_id, store::kSamplerWeightsKind, name};
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
  spec.kind = store::kSamplerWeightsKind;
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
    samplers_[*sampler_id] = Sampler{*sampler_id, ref->owner, ref->base_model, path.ToString()};
    auto sit = sessions_.find(ref->session_id);
    if (sit != sessions_.end()) sit->second.sampler_ids.push_back(*sampler_id);
  }
  futures_.Complete(op.request_id,
                    FutureResult{wire::SaveWeightsForSamplerResultJson(ToWirePath(path), sampler_id), std::nullopt});
}

}  // namespace loom::service
