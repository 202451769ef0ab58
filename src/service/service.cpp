// Service: the facade (service/service.h). Each request becomes a part's
// call: sessions, training models (admission), checkpoints, the train loop.
#include "service/service.h"

#include <algorithm>

#include <fmt/format.h>

#include "service/util.h"

namespace loom::service {

namespace {
std::string RandomTag() { return RandomHex(6); }
}  // namespace

namespace {
std::vector<BaseModelSpec> OneBase(const ServiceOptions& options, std::unique_ptr<engine::Engine> engine) {
  std::vector<BaseModelSpec> bases;
  bases.push_back(BaseModelSpec{options.base_model_name, std::move(engine), 0});
  return bases;
}
}  // namespace

Service::Service(ServiceOptions options, std::unique_ptr<engine::Engine> engine,
                 std::unique_ptr<store::Registry> registry)
    : Service(options, OneBase(options, std::move(engine)), std::move(registry)) {}

Service::Service(ServiceOptions options, std::vector<BaseModelSpec> bases, std::unique_ptr<store::Registry> registry)
    : options_(std::move(options)),
      registry_(std::move(registry)),
      futures_(options_.instance_tag.empty() ? RandomTag() : options_.instance_tag, options_.future_retention),
      usage_(NowMs()),
      sessions_(options_, lock_, idempotency_, *registry_),
      catalog_(options_, *registry_),
      janitor_(options_, futures_, sessions_, bases_, idempotency_, catalog_) {
  const SharedParts shared{*registry_, futures_, metrics_, usage_, lock_, sessions_, idempotency_};
  ServiceOptions per_base = options_;
  per_base.room_share = std::max<int64_t>(1, static_cast<int64_t>(bases.size()));
  for (BaseModelSpec& spec : bases) bases_.push_back(std::make_unique<BaseModel>(per_base, std::move(spec), shared));
}

Service::~Service() { Stop(); }

void Service::Start() {
  std::lock_guard<std::mutex> lock(lock_.mu);
  if (bases_.front()->loop.StartedLocked()) return;
  catalog_.SweepExpired();
  for (const auto& base : bases_) {
    base->publisher.Start();
    // The first engine thread runs the one janitor, which sweeps every base model.
    if (base == bases_.front()) {
      base->loop.StartLocked([this](Clock::time_point now) { janitor_.SweepIfDueLocked(now); });
    } else {
      base->loop.StartLocked([](Clock::time_point) {});
    }
  }
}

void Service::Stop() {
  for (const auto& base : bases_) base->loop.Stop();       // no more saves are submitted
  for (const auto& base : bases_) base->publisher.Stop();  // the ones submitted are written and answered
}

BaseModel* Service::FindBase(const std::string& name) const {
  for (const auto& base : bases_) {
    if (base->name == name) return base.get();
  }
  return nullptr;
}

Status Service::NotServed(const std::string& field, const std::string& name) const {
  std::string served;
  for (const auto& base : bases_) served += (served.empty() ? "'" : ", '") + base->name + "'";
  return Status::Invalid(fmt::format("{}: '{}' is not served here; this server serves {}", field, name, served));
}

BaseModel& Service::BaseOfModelLocked(const std::string& model_id) const {
  for (const auto& base : bases_) {
    if (base->models.FindLocked(model_id) != nullptr) return *base;
  }
  return *bases_.front();
}

BaseModel& Service::BaseOfModel(const std::string& model_id) const {
  std::lock_guard<std::mutex> lock(lock_.mu);
  return BaseOfModelLocked(model_id);
}

std::optional<engine::SamplerStats> Service::sampler_stats() const {
  std::lock_guard<std::mutex> lock(lock_.mu);
  const SamplingState& sampling = bases_.front()->sampling;
  if (!sampling.sampler) return std::nullopt;
  return sampling.sampler->stats();
}

engine::DeviceMemory Service::device_memory() const {
  std::lock_guard<std::mutex> lock(lock_.mu);
  return bases_.front()->engine->Memory();
}

engine::Engine::RecomputeStats Service::recompute_stats() const {
  std::lock_guard<std::mutex> lock(lock_.mu);
  return bases_.front()->engine->TrainRecomputeStats();
}

int Service::slots_in_use() const {
  std::lock_guard<std::mutex> lock(lock_.mu);
  int in_use = 0;
  for (const auto& base : bases_) in_use += base->models.SlotsInUseLocked();
  return in_use;
}

std::string Service::MetricsText(bool with_usage) const { return metrics_.Render(LiveSnapshot(with_usage)); }

QueueSnapshot Service::LiveSnapshot(bool with_usage) const {
  QueueSnapshot live;
  {
    std::lock_guard<std::mutex> lock(lock_.mu);
    for (const auto& base : bases_) {
      base->models.QueueDepthsLocked(&live);
      base->loop.QueueDepthsLocked(&live);
      live.slots_total += base->engine->info().max_slots;
      live.slots_in_use += base->models.SlotsInUseLocked();
      live.capacity_waiters += base->models.WaitersLocked();
      const engine::Engine::RecomputeStats recompute = base->engine->TrainRecomputeStats();
      live.planned_passes += recompute.passes;
      live.recomputed_layers += recompute.layers;
      live.planned_rows += recompute.rows;
      if (base->sampling.sampler) {
        const engine::SamplerStats stats = base->sampling.sampler->stats();
        live.adapter_loads += stats.adapter_loads;
        live.adapter_installs += stats.adapter_installs;
        live.sampler_replicas += stats.replicas;
        live.sampler_replicas_live += stats.replicas_live;
        live.sampler_resubmitted += stats.resubmitted;
      }
    }
  }
  for (const auto& base : bases_) live.publishes_pending += base->publisher.pending();
  if (with_usage) live.usage = AllUsage();
  return live;
}

std::vector<Service::ModelStatus> Service::ModelsOf(const std::string& tenant) const {
  std::vector<ModelStatus> out;
  QueueSnapshot depths;
  std::lock_guard<std::mutex> lock(lock_.mu);
  for (const auto& base : bases_) {
    base->models.QueueDepthsLocked(&depths);
    base->loop.QueueDepthsLocked(&depths);
  }
  for (const auto& base : bases_) {
    std::vector<bool> waiting;
    const auto models = base->models.TenantModelsLocked(tenant, &waiting);
    for (size_t i = 0; i < models.size(); ++i) {
      const auto& m = models[i];
      auto q = depths.models.find(m.model_id);
      out.push_back(ModelStatus{m.model_id, m.base_model, m.lora.rank, waiting[i] ? "paused_capacity" : "active",
                                q == depths.models.end() ? 0 : q->second.queued});
    }
  }
  return out;
}

tinker::TenantUsage Service::UsageOf(const std::string& tenant) const {
  tinker::TenantUsage u = usage_.Of(tenant);
  {
    std::lock_guard<std::mutex> lock(lock_.mu);
    for (const auto& base : bases_) base->models.TenantSlotsLocked(tenant, Clock::now(), &u);
  }
  if (auto stored = registry_->StoredByOwner(); stored.ok()) {
    if (auto it = stored->find(tenant); it != stored->end()) {
      u.checkpoints = it->second.checkpoints;
      u.bytes_stored = it->second.bytes;
    }
  }
  return u;
}

std::vector<tinker::TenantUsage> Service::AllUsage() const {
  std::map<std::string, tinker::TenantUsage> all = usage_.All();
  auto stored = registry_->StoredByOwner();
  if (stored.ok()) {
    for (const auto& [owner, s] : *stored) {
      tinker::TenantUsage& u = all.try_emplace(owner, usage_.Of(owner)).first->second;
      u.checkpoints = s.checkpoints;
      u.bytes_stored = s.bytes;
    }
  }
  {
    std::lock_guard<std::mutex> lock(lock_.mu);
    const auto now = Clock::now();
    for (const auto& base : bases_) {
      for (const std::string& tenant : base->models.TenantsLocked()) all.try_emplace(tenant, usage_.Of(tenant));
    }
    for (auto& [tenant, u] : all) {
      for (const auto& base : bases_) base->models.TenantSlotsLocked(tenant, now, &u);
    }
  }
  std::vector<tinker::TenantUsage> out;
  for (auto& [tenant, u] : all) out.push_back(std::move(u));
  return out;
}

// ---------------------------------------------------------------- sessions

Result<std::string> Service::CreateSession(const Caller& caller, const tinker::CreateSessionRequest& request) {
  return sessions_.CreateSession(caller, request);
}

Status Service::Heartbeat(const Caller& caller, const std::string& session_id) {
  return sessions_.Heartbeat(caller, session_id);
}

// ------------------------------------------------------------------ models

Result<Submitted> Service::CreateModel(const Caller& caller, const tinker::CreateModelRequest& request) {
  return CreateModelOnBase(caller, request, std::nullopt, false);
}

Result<Submitted> Service::CreateModelOnBase(const Caller& caller, const tinker::CreateModelRequest& request,
                                             std::optional<tinker::TinkerPath> load_path, bool with_optimizer) {
  BaseModel* base = FindBase(request.base_model);
  if (base == nullptr) return NotServed("create_model.base_model", request.base_model);
  std::lock_guard<std::mutex> lock(lock_.mu);
  // Model ids are unique across base models: the same model_seq_id on
  // another base model is a client error, not a repeat.
  const std::string model_id = fmt::format("{}:train:{}", request.session_id, request.model_seq_id);
  // (A session is its tenant's, so the id names nobody else's model.)
  if (BaseModel& holder = BaseOfModelLocked(model_id);
      &holder != base && holder.models.FindLocked(model_id) != nullptr) {
    return Status::Invalid(fmt::format("create_model.model_seq_id: {} already names model '{}' on base model '{}'",
                                       request.model_seq_id, model_id, holder.name));
  }
  return base->models.CreateModelLocked(caller, request, std::move(load_path), with_optimizer);
}

Result<Submitted> Service::ForwardBackward(const Caller& caller, tinker::ForwardBackwardRequest request) {
  // Pure checks first, on this I/O thread: nothing invalid reaches the engine.
  // The slot is bound later, on the engine thread; validate as if slot 0.
  TrainingOp op;
  op.kind = OpKind::kForwardBackward;
  op.seq_id = request.seq_id;
  static_cast<tinker::ForwardBackwardInput&>(op.forward_backward) = std::move(request.call);
  op.forward_backward.slot = 0;
  BaseModel& base = BaseOfModel(request.model_id);
  Status valid = base.engine->ValidateForwardBackward(op.forward_backward);
  op.forward_backward.slot = -1;
  return base.models.SubmitOnModel(caller, request.model_id, std::move(op), std::move(valid));
}

Result<Submitted> Service::OptimStep(const Caller& caller, const tinker::OptimStepRequest& request) {
  TrainingOp op;
  op.kind = OpKind::kOptimStep;
  op.seq_id = request.seq_id;
  op.adam = request.adam_params;
  return BaseOfModel(request.model_id).models.SubmitOnModel(caller, request.model_id, std::move(op));
}

Result<Submitted> Service::SaveWeights(const Caller& caller, const tinker::SaveWeightsRequest& request) {
  TrainingOp op;
  op.kind = OpKind::kSaveWeights;
  op.seq_id = request.seq_id;
  op.name = request.name.value_or(fmt::format("seq-{}", request.seq_id));
  Status valid = tinker::ValidateCheckpointName(op.name, "save_weights.path");
  op.ttl_seconds = request.ttl_seconds;
  op.overwrite = request.overwrite;
  return BaseOfModel(request.model_id).models.SubmitOnModel(caller, request.model_id, std::move(op), std::move(valid));
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
    return BaseOfModel(request.model_id).models.SubmitOnModel(caller, request.model_id, std::move(op), std::move(valid));
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
  return CreateModelOnBase(caller, create, op.load_path, op.with_optimizer);
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
  return BaseOfModel(request.model_id).models.SubmitOnModel(caller, request.model_id, std::move(op), std::move(valid));
}

Result<Submitted> Service::UnloadModel(const Caller& caller, const std::string& model_id) {
  std::lock_guard<std::mutex> lock(lock_.mu);
  const char* op = OpKindName(OpKind::kUnloadModel);
  std::optional<Submitted> prior;
  if (Status st = idempotency_.IdempotentLocked(caller, op, &prior); !st.ok()) return st;
  if (prior) return *prior;
  BaseModel& base = BaseOfModelLocked(model_id);
  auto model = base.models.FindModelLocked(caller.tenant, model_id, /*must_be_active=*/false);
  if (!model.ok()) return model.status();
  TrainingModels::TrainingModel& m = **model;
  if (m.state == TrainingModels::ModelState::kActive) {
    base.loop.FailModelLocked(m, TrainingModels::ModelState::kUnloaded, "model '" + model_id + "' was unloaded");
    lock_.work.notify_all();
  }
  Submitted out{futures_.Create(caller.tenant, op), model_id};
  futures_.Complete(out.request_id, tinker::UnloadModelResult{model_id});
  idempotency_.RememberLocked(caller, op, out);
  return out;
}

Result<tinker::GetInfoResult> Service::GetInfo(const Caller& caller, const std::string& model_id) {
  std::lock_guard<std::mutex> lock(lock_.mu);
  BaseModel& base = BaseOfModelLocked(model_id);
  auto model = base.models.FindModelLocked(caller.tenant, model_id, /*must_be_active=*/false);
  if (!model.ok()) return model.status();
  tinker::GetInfoResult info;
  info.model_id = model_id;
  info.model_data.arch = base.engine->info().model_type;
  info.model_data.model_name = (*model)->base_model;
  info.model_data.tokenizer_id = base.options.tokenizer_id.empty() ? base.name : base.options.tokenizer_id;
  info.lora_rank = (*model)->lora.rank;
  return info;
}

// ------------------------------------------------------- sessions, REST

Result<tinker::SessionsPage> Service::ListSessions(const Caller& caller, tinker::PageParams page) {
  return sessions_.ListSessions(caller, page);
}

Result<tinker::SessionInfo> Service::GetSession(const Caller& caller, const std::string& session_id) {
  return sessions_.GetSession(caller, session_id);
}

}  // namespace loom::service
