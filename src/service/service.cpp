// Service: sessions, training models and the admission of requests (I/O
// threads). The engine thread's side is in engine_loop.cpp, REST in rest.cpp.
#include "service/service.h"

#include <fmt/format.h>

#include <random>

#include "common/hash.h"
#include "common/log.h"
#include "service/util.h"
#include "store/tinker_rows.h"

namespace loom::service {

namespace {
std::string RandomTag() { return RandomHex(6); }
}  // namespace

uint64_t BodyDigest(std::string_view body) { return Fnv1a64(body); }

Service::Service(ServiceOptions options, std::unique_ptr<engine::Engine> engine,
                 std::unique_ptr<store::Registry> registry)
    : options_(std::move(options)),
      engine_(std::move(engine)),
      registry_(std::move(registry)),
      futures_(options_.instance_tag.empty() ? RandomTag() : options_.instance_tag, options_.future_retention) {
  for (int s = 0; s < engine_->info().max_slots; ++s) free_slots_.insert(s);
  planner_ = sched::Planner(sched::PlannerOptions{options_.token_budget});
}

Service::~Service() { Stop(); }

void Service::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_) return;
  started_ = true;
  auto swept = registry_->SweepExpired(NowMs());
  if (swept.ok() && !swept->empty()) log::Info("ttl_sweep removed={}", swept->size());
  engine_thread_ = std::thread([this] { EngineLoop(); });
}

void Service::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_ || stopping_) {
      stopping_ = true;
      if (!engine_thread_.joinable()) return;
    }
    stopping_ = true;
  }
  cv_.notify_all();
  if (engine_thread_.joinable()) engine_thread_.join();
}

int Service::slots_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_->info().max_slots - static_cast<int>(free_slots_.size());
}

// ------------------------------------------------------------ idempotency

namespace {
// What a key is bound to: the operation, the route it came by and its body.
std::string IdempotencyScope(const Caller& caller, std::string_view op) {
  return fmt::format("{} via '{}' body {:016x}", op, caller.route, caller.body_digest);
}
}  // namespace

Status Service::IdempotentLocked(const Caller& caller, std::string_view op, std::optional<Submitted>* prior) const {
  prior->reset();
  if (caller.idempotency_key.empty()) return Status::Ok();
  auto it = idempotent_.find({caller.tenant, caller.idempotency_key});
  if (it == idempotent_.end()) return Status::Ok();
  if (it->second.scope != IdempotencyScope(caller, op)) {
    return Status::Invalid(fmt::format(
        "X-Idempotency-Key: '{}' was already used for another request ({}); a key names one request, so send a new "
        "key for a different route or body",
        caller.idempotency_key, it->second.scope));
  }
  *prior = it->second.submitted;
  return Status::Ok();
}

void Service::RememberLocked(const Caller& caller, std::string_view op, const Submitted& submitted) {
  if (caller.idempotency_key.empty()) return;
  idempotent_[{caller.tenant, caller.idempotency_key}] = {IdempotencyScope(caller, op), submitted, Clock::now()};
}

Status Service::AdmitNewModelLocked(const std::string& tenant) const {
  // A live model holds a slot or is queued to bind one; the others gave theirs back.
  int live = 0, mine = 0;
  for (const auto& [id, m] : models_) {
    if (m->state != ModelState::kActive) continue;
    ++live;
    if (m->owner == tenant) ++mine;
  }
  const int quota = options_.max_models_per_tenant;
  if (quota > 0 && mine >= quota) {
    return Status::Exhausted(fmt::format(
        "create_model: tenant quota reached: {} of {} live models (--max-models-per-tenant {}); unload_model one of "
        "yours or let an idle session expire, then retry",
        mine, quota, quota));
  }
  const int slots = engine_->info().max_slots;
  if (live >= slots) {
    return Status::Unavailable(fmt::format(
        "create_model: no free adapter slot: all {} are bound to live models (--max-adapters); retry later", slots));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- sessions

Result<std::string> Service::CreateSession(const Caller& caller, const tinker::CreateSessionRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return Status::Unavailable("server is shutting down");
  std::optional<Submitted> prior;
  if (Status st = IdempotentLocked(caller, "create_session", &prior); !st.ok()) return st;
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
  Status st = registry_->AddSession(rec);
  if (!st.ok()) log::Warn("session_record_failed session={} error={}", id, st.message());
  RememberLocked(caller, "create_session", {id, ""});
  log::Info("session_created session={} tenant={}", id, caller.tenant);
  return id;
}

Status Service::Heartbeat(const Caller& caller, const std::string& session_id) {
  std::lock_guard<std::mutex> lock(mu_);
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

void Service::TouchSessionLocked(const std::string& session_id) {
  auto it = sessions_.find(session_id);
  if (it != sessions_.end() && !it->second.expired) it->second.last_seen = Clock::now();
}

// ------------------------------------------------------------------ models

Result<Service::TrainingModel*> Service::FindModelLocked(const std::string& tenant, const std::string& model_id,
                                                         bool must_be_active) {
  auto it = models_.find(model_id);
  if (it == models_.end() || it->second->owner != tenant) {
    return Status::NotFound("model_id '" + model_id + "' not found");
  }
  TrainingModel* m = it->second.get();
  if (must_be_active && m->state != ModelState::kActive) return Status::Precondition(m->state_reason);
  return m;
}

Result<Submitted> Service::AdmitLocked(const Caller& caller, TrainingModel& model, TrainingOp op) {
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
  RememberLocked(caller, OpKindName(kind), out);
  TouchSessionLocked(model.session_id);
  if (model.sequencer.HasReady()) cv_.notify_all();
  return out;
}

Result<Submitted> Service::SubmitOnModel(const Caller& caller, const std::string& model_id, TrainingOp op,
                                         Status precheck) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return Status::Unavailable("server is shutting down");
  std::optional<Submitted> prior;
  if (Status st = IdempotentLocked(caller, OpKindName(op.kind), &prior); !st.ok()) return st;
  if (prior) return *prior;
  auto model = FindModelLocked(caller.tenant, model_id, /*must_be_active=*/false);
  if (!model.ok()) return model.status();
  if (op.seq_id < 1) {
    return Status::Invalid(fmt::format("seq_id: must be >= 1 (got {}); seq_id 0 is the model's create_model",
                                       op.seq_id));
  }
  if (!precheck.ok()) {
    (*model)->sequencer.Skip(op.seq_id);
    if ((*model)->sequencer.HasReady()) cv_.notify_all();
    return precheck;
  }
  return AdmitLocked(caller, **model, std::move(op));
}

Result<Submitted> Service::CreateModel(const Caller& caller, const tinker::CreateModelRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  return CreateModelLocked(caller, request, std::nullopt, false);
}

Result<Submitted> Service::CreateModelLocked(const Caller& caller, const tinker::CreateModelRequest& request,
                                             std::optional<tinker::TinkerPath> load_path, bool with_optimizer) {
  const auto& info = engine_->info();
  if (request.base_model != options_.base_model_name) {
    return Status::Invalid(fmt::format("create_model.base_model: '{}' is not served here; this server serves '{}'",
                                       request.base_model, options_.base_model_name));
  }
  if (request.lora.rank < 1 || request.lora.rank > info.max_rank) {
    return Status::Invalid(fmt::format("create_model.lora_config.rank: {} is outside [1, {}] (--max-rank)",
                                       request.lora.rank, info.max_rank));
  }
  if (stopping_) return Status::Unavailable("server is shutting down");
  std::optional<Submitted> prior;
  if (Status st = IdempotentLocked(caller, OpKindName(OpKind::kCreateModel), &prior); !st.ok()) return st;
  if (prior) return *prior;
  auto sit = sessions_.find(request.session_id);
  if (sit == sessions_.end() || sit->second.owner != caller.tenant) {
    return Status::NotFound("create_model.session_id: session '" + request.session_id + "' not found");
  }
  if (sit->second.expired) {
    return Status::Precondition("create_model.session_id: session '" + request.session_id +
                                "' expired (no heartbeat); create a new ServiceClient");
  }
  const std::string model_id = fmt::format("{}:train:{}", request.session_id, request.model_seq_id);
  if (auto it = models_.find(model_id); it != models_.end()) {
    if (auto first = it->second->sequencer.Lookup(0)) return Submitted{*first, model_id};
  }
  // Limits up front: nothing is recorded for a model that cannot get a slot.
  if (Status st = AdmitNewModelLocked(caller.tenant); !st.ok()) return st;
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
  sit->second.model_ids.push_back(model_id);

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
  if (Status st = registry_->UpsertRun(run); !st.ok()) {
    log::Warn("run_record_failed model={} error={}", model_id, st.message());
  }

  TrainingOp op;
  op.kind = OpKind::kCreateModel;
  op.seq_id = 0;
  op.load_path = std::move(load_path);
  op.with_optimizer = with_optimizer;
  return AdmitLocked(caller, m, std::move(op));
}

Result<Submitted> Service::ForwardBackward(const Caller& caller, tinker::ForwardBackwardRequest request) {
  // Pure checks first, on this I/O thread: nothing invalid reaches the engine.
  // The slot is bound later, on the engine thread; validate as if slot 0.
  TrainingOp op;
  op.kind = OpKind::kForwardBackward;
  op.seq_id = request.seq_id;
  static_cast<tinker::ForwardBackwardInput&>(op.forward_backward) = std::move(request.call);
  op.forward_backward.slot = 0;
  Status valid = engine_->ValidateForwardBackward(op.forward_backward);
  op.forward_backward.slot = -1;
  return SubmitOnModel(caller, request.model_id, std::move(op), std::move(valid));
}

Result<Submitted> Service::OptimStep(const Caller& caller, const tinker::OptimStepRequest& request) {
  TrainingOp op;
  op.kind = OpKind::kOptimStep;
  op.seq_id = request.seq_id;
  op.adam = request.adam_params;
  return SubmitOnModel(caller, request.model_id, std::move(op));
}

Result<Submitted> Service::SaveWeights(const Caller& caller, const tinker::SaveWeightsRequest& request) {
  TrainingOp op;
  op.kind = OpKind::kSaveWeights;
  op.seq_id = request.seq_id;
  op.name = request.name.value_or(fmt::format("seq-{}", request.seq_id));
  Status valid = tinker::ValidateCheckpointName(op.name, "save_weights.path");
  op.ttl_seconds = request.ttl_seconds;
  op.overwrite = request.overwrite;
  return SubmitOnModel(caller, request.model_id, std::move(op), std::move(valid));
}

Result<Submitted> Service::LoadWeights(const Caller& caller, const tinker::LoadWeightsRequest& request) {
  Status valid;
  if (request.path.kind != tinker::TinkerPath::Kind::kTraining) {
    valid = Status::Invalid("load_weights.path: '" + request.path.ToString() +
                            "' is a sampler_weights checkpoint; load_state needs a /weights/ checkpoint");
    if (request.mode != tinker::LoadWeightsRequest::Mode::kTrainingClient) return valid;
  }
  TrainingOp op;
  op.kind = OpKind::kLoadWeights;
  op.load_path = request.path;
  op.with_optimizer = request.optimizer;
  if (request.mode == tinker::LoadWeightsRequest::Mode::kTrainingClient) {
    op.seq_id = request.seq_id;
    return SubmitOnModel(caller, request.model_id, std::move(op), std::move(valid));
  }
  // create_model_via_load_weights: a new model whose LoRA config is the
  // checkpoint's, created and loaded as its seq 0.
  const std::string shown = request.path.ToString();
  auto ckpt = registry_->GetCheckpoint(request.path);
  if (!ckpt.ok() || !ckpt->AccessibleBy(caller.tenant)) {
    return Status::NotFound("load_weights.path: checkpoint '" + shown + "' not found");
  }
  auto run = registry_->GetRun(ckpt->model_id);
  if (!run.ok()) return Status::NotFound("load_weights.path: training run of '" + shown + "' not found");
  tinker::CreateModelRequest create;
  create.session_id = request.session_id;
  create.model_seq_id = request.model_seq_id;
  create.base_model = request.base_model.value_or(run->base_model);
  create.user_metadata = request.user_metadata;
  create.lora.rank = run->lora_rank;
  create.lora.train_attn = run->train_attn;
  create.lora.train_mlp = run->train_mlp;
  create.lora.train_unembed = run->train_unembed;
  std::lock_guard<std::mutex> lock(mu_);
  return CreateModelLocked(caller, create, op.load_path, op.with_optimizer);
}

Result<Submitted> Service::SaveWeightsForSampler(const Caller& caller,
                                                 const tinker::SaveWeightsForSamplerRequest& request) {
  TrainingOp op;
  op.kind = OpKind::kSaveForSampler;
  op.seq_id = request.seq_id;
  op.ttl_seconds = request.ttl_seconds;
  Status valid;
  if (request.named()) {
    op.name = *request.name;
    valid = tinker::ValidateCheckpointName(op.name, "save_weights_for_sampler.path");
  } else {
    op.sampling_session_seq_id = request.sampling_session_seq_id;
  }
  return SubmitOnModel(caller, request.model_id, std::move(op), std::move(valid));
}

Result<Submitted> Service::UnloadModel(const Caller& caller, const std::string& model_id) {
  std::lock_guard<std::mutex> lock(mu_);
  const char* op = OpKindName(OpKind::kUnloadModel);
  std::optional<Submitted> prior;
  if (Status st = IdempotentLocked(caller, op, &prior); !st.ok()) return st;
  if (prior) return *prior;
  auto model = FindModelLocked(caller.tenant, model_id, /*must_be_active=*/false);
  if (!model.ok()) return model.status();
  TrainingModel& m = **model;
  if (m.state == ModelState::kActive) {
    FailModelLocked(m, ModelState::kUnloaded, "model '" + model_id + "' was unloaded", &slots_to_release_);
    cv_.notify_all();
  }
  Submitted out{futures_.Create(caller.tenant, op), model_id};
  futures_.Complete(out.request_id, tinker::UnloadModelResult{model_id});
  RememberLocked(caller, op, out);
  return out;
}

void Service::FailModelLocked(TrainingModel& model, ModelState state, const std::string& reason,
                              std::vector<int>* slots_to_release) {
  model.state = state;
  model.state_reason = reason;
  if (model.slot >= 0) {
    slots_to_release->push_back(model.slot);
    model.slot = -1;
  }
  for (TrainingOp& op : model.sequencer.DrainAll()) futures_.Fail(op.request_id, Status::Precondition(reason));
  for (uint64_t id : planner_.DropModel(model.model_id)) FailPlannedLocked(id, Status::Precondition(reason));
}

Result<tinker::GetInfoResult> Service::GetInfo(const Caller& caller, const std::string& model_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto model = FindModelLocked(caller.tenant, model_id, /*must_be_active=*/false);
  if (!model.ok()) return model.status();
  tinker::GetInfoResult info;
  info.model_id = model_id;
  info.model_data.arch = engine_->info().model_type;
  info.model_data.model_name = (*model)->base_model;
  info.model_data.tokenizer_id = options_.tokenizer_id.empty() ? options_.base_model_name : options_.tokenizer_id;
  info.lora_rank = (*model)->lora.rank;
  return info;
}

Result<tinker::WeightsInfoResult> Service::WeightsInfo(const Caller& caller, const tinker::TinkerPath& path) {
  auto ckpt = registry_->GetCheckpoint(path);
  if (!ckpt.ok() || !ckpt->AccessibleBy(caller.tenant)) {
    return Status::NotFound("weights_info.tinker_path: checkpoint '" + path.ToString() + "' not found");
  }
  auto run = registry_->GetRun(ckpt->model_id);
  if (!run.ok()) return Status::NotFound("weights_info.tinker_path: run of '" + path.ToString() + "' not found");
  tinker::WeightsInfoResult info;
  info.base_model = run->base_model;
  info.lora.rank = run->lora_rank;
  info.lora.train_attn = run->train_attn;
  info.lora.train_mlp = run->train_mlp;
  info.lora.train_unembed = run->train_unembed;
  return info;
}

}  // namespace loom::service
