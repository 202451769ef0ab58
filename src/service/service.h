// Service: Tinker's training semantics on top of one Engine per served base
// model, as a facade over parts that each own their state (each part's
// header says what it owns, its invariants and which lock guards what).
// Per base model (BaseModel, base_model.h: engine, training models, saves,
// sampler, publisher, train loop), looked up by base_model name or by the
// model a request names; shared by all of them:
//  - Sessions (sessions.h): sessions, heartbeat leases, sampling sessions;
//  - IdempotencyMemory (idempotency.h): X-Idempotency-Key answers;
//  - CheckpointCatalog (checkpoint_catalog.h): the REST runs/checkpoints
//    listings, archive grants;
//  - Janitor (janitor.h): the one periodic sweep over all of them;
//  - Usage (usage.h): what each tenant used, for billing and caps;
//  - FutureTable, Metrics.
// In each BaseModel:
//  - TrainingModels (training_models.h): the models, their sequencers and
//    adapter slots, admission (ownership, dedup, seq_id order, quota);
//  - TrainLoop (train_loop.h): the planner and that engine's thread;
//  - Checkpoints (checkpoints.h): saves/loads through the registry;
//  - Publisher (publisher.h): the writer threads of save_weights_for_sampler;
//  - SamplingState (sampling.cpp: asample): that base model's Sampler.
// The Service translates each request into a part's terms and delegates.
//
// Invariants (kept by the parts named):
//  - a model's requests take effect in seq_id order; a repeated (model_id,
//    seq_id) returns the first request's future, and so does a repeated
//    X-Idempotency-Key on the same route with the same body (the key reused
//    for another route or body is a 400 naming the header, as in Stripe);
//  - a model lives on one base model (its create_model's base_model) and
//    model ids are unique across them; a base_model that is not served is a
//    400 naming the field and listing the served names;
//  - per base model, a tenant holds at most max_models_per_tenant live
//    models (slots), and the live models of all tenants at most its slot count: create_model
//    beyond the quota is refused up front (429), beyond the slots it waits
//    for one in arrival order (queue_state paused_capacity) for at most
//    capacity_wait (then its future fails naming the limit), or with
//    capacity_wait 0 it is refused up front (503);
//  - every model, future, checkpoint and session has an owner (tenant); any
//    other tenant gets NotFound with the same text as for an unknown id;
//  - a slot is bound to at most one live model; a session without heartbeat
//    for session_ttl loses its models' slots, and later calls on them fail
//    with a FailedPrecondition that says "expired";
//  - only a base model's engine thread calls its Engine (except the pure
//    Validate*()).
//
// Threading: every public method may be called from any thread (I/O threads).
// The parts share one lock, ServiceLock (service_lock.h says why), never held
// across an engine call; FutureTable, Metrics and the archive grants have
// their own.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/api.h"
#include "service/base_model.h"
#include "service/caller.h"
#include "service/checkpoint_catalog.h"
#include "service/checkpoints.h"
#include "service/future_table.h"
#include "service/idempotency.h"
#include "service/janitor.h"
#include "service/metrics.h"
#include "service/options.h"
#include "service/publisher.h"
#include "service/sampling.h"
#include "service/service_lock.h"
#include "service/sessions.h"
#include "service/train_loop.h"
#include "service/training_models.h"
#include "service/usage.h"
#include "store/registry.h"
#include "tinker/path.h"
#include "tinker/requests.h"
#include "tinker/results.h"

namespace loom::service {

class Service {
 public:
  using Clock = std::chrono::steady_clock;

  // One base model, named options.base_model_name.
  Service(ServiceOptions options, std::unique_ptr<engine::Engine> engine,
          std::unique_ptr<store::Registry> registry);
  // Several (at least one, distinct names); the first is the default one
  // (model_info(), sampler_stats()).
  Service(ServiceOptions options, std::vector<BaseModelSpec> bases, std::unique_ptr<store::Registry> registry);
  ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // Starts the engine thread; sweeps expired checkpoint TTLs once.
  void Start();
  // Lets the batch in flight finish, fails everything still queued with
  // Unavailable ("server shutting down"), and joins the engine thread.
  void Stop();

  FutureTable& futures() { return futures_; }
  // The first base model's engine.
  const engine::ModelInfo& model_info() const { return bases_.front()->engine->info(); }
  // Every served base model, in the order given (get_server_capabilities).
  const std::vector<std::unique_ptr<BaseModel>>& bases() const { return bases_; }
  const ServiceOptions& options() const { return options_; }

  // ---- sessions ----
  Result<std::string> CreateSession(const Caller& caller, const tinker::CreateSessionRequest& request);
  Status Heartbeat(const Caller& caller, const std::string& session_id);

  // ---- asynchronous training requests (answers carry a request_id) ----
  Result<Submitted> CreateModel(const Caller& caller, const tinker::CreateModelRequest& request);
  Result<Submitted> ForwardBackward(const Caller& caller, tinker::ForwardBackwardRequest request);
  Result<Submitted> OptimStep(const Caller& caller, const tinker::OptimStepRequest& request);
  Result<Submitted> SaveWeights(const Caller& caller, const tinker::SaveWeightsRequest& request);
  Result<Submitted> LoadWeights(const Caller& caller, const tinker::LoadWeightsRequest& request);
  Result<Submitted> SaveWeightsForSampler(const Caller& caller, const tinker::SaveWeightsForSamplerRequest& request);
  Result<Submitted> UnloadModel(const Caller& caller, const std::string& model_id);

  // ---- sampling (sampling.cpp) ----
  // Serves sampling of base model `base` ("" = the first) with this Sampler
  // (built on that engine's SharedModel()); call before Start(). Without
  // one, asample answers Unavailable. An unknown name is refused.
  Status AttachSampler(std::unique_ptr<engine::Sampler> sampler, const std::string& base = "");
  Result<std::string> CreateSamplingSession(const Caller& caller, const tinker::CreateSamplingSessionRequest& request);
  Result<SampleSubmitted> Sample(const Caller& caller, const tinker::SampleRequest& request);
  Result<tinker::SamplingSessionInfo> GetSampler(const Caller& caller, const std::string& sampler_id);

  // ---- direct answers ----
  Result<tinker::GetInfoResult> GetInfo(const Caller& caller, const std::string& model_id);

  // ---- REST ----
  // weights_info and the runs, checkpoints and archives endpoints: the
  // catalog part itself (any thread), handed out rather than forwarded.
  CheckpointCatalog& checkpoints() { return catalog_; }
  Result<tinker::SessionsPage> ListSessions(const Caller& caller, tinker::PageParams page);
  Result<tinker::SessionInfo> GetSession(const Caller& caller, const std::string& session_id);

  // For tests and /metrics: slots currently bound to live models.
  int slots_in_use() const;
  // The first base model's sampler's counters (nullopt: none is attached).
  std::optional<engine::SamplerStats> sampler_stats() const;
  // The first base model's engine's device allocator counters (all 0 on the CPU).
  engine::DeviceMemory device_memory() const;
  // The first base model's engine's passes and the layers they recomputed.
  engine::Engine::RecomputeStats recompute_stats() const;
  // Counters other layers feed (router: responses; sampler: tokens).
  Metrics& metrics() { return metrics_; }
  // GET /metrics: Prometheus text with the live queue gauges; with_usage
  // adds every tenant's usage series (the admin's view).
  std::string MetricsText(bool with_usage = false) const;
  // The live gauges /metrics renders (and the admin dashboard shows).
  QueueSnapshot LiveSnapshot(bool with_usage) const;

  // ---- dashboard (docs/dashboard.md) ----
  struct ModelStatus {
    std::string model_id, base_model;
    int rank = 0;
    std::string queue_state;  // "active" or "paused_capacity" (waiting for a slot)
    size_t queued = 0;        // its requests not yet run
  };
  // The tenant's live models.
  std::vector<ModelStatus> ModelsOf(const std::string& tenant) const;

  // ---- usage (docs/usage.md) ----
  // What the caller's tenant used: the counters since start, its live and
  // waiting models and its stored checkpoints.
  tinker::TenantUsage UsageOf(const std::string& tenant) const;
  // The same for every tenant that used something or stores checkpoints.
  std::vector<tinker::TenantUsage> AllUsage() const;

 private:
  // create_model (load_path: via load_weights) on the base model it names.
  Result<Submitted> CreateModelOnBase(const Caller& caller, const tinker::CreateModelRequest& request,
                                      std::optional<tinker::TinkerPath> load_path, bool with_optimizer);
  // The bundle serving this base_model name, or null.
  BaseModel* FindBase(const std::string& name) const;
  // The 400 for a base_model that is not served: names the field and the served names.
  Status NotServed(const std::string& field, const std::string& name) const;
  // The bundle holding model_id (any tenant), or the first one (whose
  // lookups then answer NotFound).
  BaseModel& BaseOfModelLocked(const std::string& model_id) const;
  BaseModel& BaseOfModel(const std::string& model_id) const;

  // Declared in construction order: each part refers only to those above it.
  const ServiceOptions options_;
  std::unique_ptr<store::Registry> registry_;
  FutureTable futures_;
  Metrics metrics_;
  Usage usage_;
  mutable ServiceLock lock_;
  IdempotencyMemory idempotency_;
  Sessions sessions_;
  CheckpointCatalog catalog_;
  // Below futures_, metrics_ and usage_, which their Samplers' callbacks use,
  // so the Samplers stop before them; above the janitor, which sweeps them.
  std::vector<std::unique_ptr<BaseModel>> bases_;
  Janitor janitor_;
};

}  // namespace loom::service
