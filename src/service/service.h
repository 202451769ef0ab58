// Service: Tinker's training semantics on top of one Engine. It owns the
// sessions (heartbeat leases), the training models (slot, LoRA config,
// seq_id ordering, dedup), the futures, the registry of runs/checkpoints, and
// the engine thread that runs ready requests in packed batches.
//
// Invariants:
//  - a model's requests take effect in seq_id order; a repeated (model_id,
//    seq_id) returns the first request's future, and so does a repeated
//    X-Idempotency-Key on the same route with the same body (the key reused
//    for another route or body is a 400 naming the header, as in Stripe);
//  - a tenant holds at most max_models_per_tenant live models (slots), and
//    the live models of all tenants at most the slot count: create_model
//    beyond either is refused up front with a retryable answer (429 for the
//    tenant's quota, 503 for a full service), before a model is recorded;
//  - every model, future, checkpoint and session has an owner (tenant); any
//    other tenant gets NotFound with the same text as for an unknown id;
//  - a slot is bound to at most one live model; a session without heartbeat
//    for session_ttl loses its models' slots, and later calls on them fail
//    with a FailedPrecondition that says "expired";
//  - only the engine thread calls the Engine (except the pure Validate*()).
//
// Threading: every public method may be called from any thread (I/O threads);
// one mutex guards the state and is never held across an engine call.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/status.h"
#include "engine/api.h"
#include "sched/planner.h"
#include "service/future_table.h"
#include "service/metrics.h"
#include "service/sampling.h"
#include "service/sequencer.h"
#include "store/registry.h"
#include "tinker/path.h"
#include "tinker/requests.h"
#include "tinker/results.h"

namespace loom::service {

struct ServiceOptions {
  std::string base_model_name = "loom/tiny-qwen3";  // --model-name: base_model clients send
  std::string tokenizer_id;                          // "" = base_model_name
  std::chrono::milliseconds session_ttl{std::chrono::seconds(300)};
  std::chrono::milliseconds seq_gap_timeout{std::chrono::seconds(120)};
  std::chrono::milliseconds janitor_period{std::chrono::milliseconds(500)};
  std::chrono::seconds future_retention{std::chrono::hours(2)};
  std::chrono::seconds archive_url_ttl{std::chrono::minutes(15)};
  double lora_alpha = 32.0;
  std::string instance_tag;  // prefix of request ids; "" = random
  int64_t token_budget = 8192;  // --token-budget: tokens per packed forward(_backward) pass
  // --batch-window-ms: before a pass, the engine waits until no request has
  // arrived for this long (tenants submitting "at once" land in one pass),
  // but never keeps a request waiting longer than BatchWindow::kMaxWindows
  // windows (common/batch_window.h, the sampler's rule too).
  std::chrono::milliseconds batch_window{2};
  // --max-models-per-tenant: live models (adapter slots, held or being bound)
  // one tenant may have at once; 0 = no per-tenant limit (only the slots).
  int max_models_per_tenant = 0;
};

// Who is calling, as http/ authenticated it.
struct Caller {
  std::string tenant;
  std::string idempotency_key;  // X-Idempotency-Key, "" when absent
  std::string route;            // "<METHOD> <route under /api/v1/>", "" when not from http/
  uint64_t body_digest = 0;     // BodyDigest() of the decoded body
};

// The digest of a request body that scopes its X-Idempotency-Key (FNV-1a 64:
// it only tells one tenant's own requests apart, so it need not resist attacks).
uint64_t BodyDigest(std::string_view body);

// The answer to a submitted asynchronous request.
struct Submitted {
  std::string request_id;
  std::string model_id;
};

class Service {
 public:
  using Clock = std::chrono::steady_clock;

  Service(ServiceOptions options, std::unique_ptr<engine::Engine> engine,
          std::unique_ptr<store::Registry> registry);
  ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // Starts the engine thread; sweeps expired checkpoint TTLs once.
  void Start();
  // Lets the batch in flight finish, fails everything still queued with
  // Unavailable ("server shutting down"), and joins the engine thread.
  void Stop();

  FutureTable& futures() { return futures_; }
  const engine::ModelInfo& model_info() const { return engine_->info(); }
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
  // Serves sampling with this Sampler (built on engine's SharedModel()); call
  // before Start(). Without one, asample answers Unavailable.
  void AttachSampler(std::unique_ptr<engine::Sampler> sampler);
  Result<std::string> CreateSamplingSession(const Caller& caller, const tinker::CreateSamplingSessionRequest& request);
  Result<SampleSubmitted> Sample(const Caller& caller, const tinker::SampleRequest& request);
  Result<tinker::SamplingSessionInfo> GetSampler(const Caller& caller, const std::string& sampler_id);

  // ---- direct answers ----
  Result<tinker::GetInfoResult> GetInfo(const Caller& caller, const std::string& model_id);
  Result<tinker::WeightsInfoResult> WeightsInfo(const Caller& caller, const tinker::TinkerPath& path);

  // ---- REST ----
  Result<tinker::TrainingRunsPage> ListTrainingRuns(const Caller& caller, tinker::PageParams page);
  Result<tinker::TrainingRun> GetTrainingRun(const Caller& caller, const std::string& run_id);
  Result<tinker::CheckpointsPage> ListRunCheckpoints(const Caller& caller, const std::string& run_id);
  Result<tinker::CheckpointsPage> ListUserCheckpoints(const Caller& caller, tinker::PageParams page);
  Status DeleteCheckpoint(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id);
  Status SetCheckpointTtl(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id,
                          std::optional<int64_t> ttl_seconds);
  Status SetCheckpointPublic(const Caller& caller, const std::string& run_id, const std::string& checkpoint_id,
                             bool is_public);
  // A one-time download token for the checkpoint's tar (unauthenticated GET);
  // *expires_unix receives its expiry.
  Result<std::string> CreateArchiveToken(const Caller& caller, const std::string& run_id,
                                         const std::string& checkpoint_id, int64_t* expires_unix);
  // The tar bytes for a token (NotFound when unknown or expired).
  Result<std::string> ReadArchive(const std::string& token);
  Result<tinker::SessionsPage> ListSessions(const Caller& caller, tinker::PageParams page);
  Result<tinker::SessionInfo> GetSession(const Caller& caller, const std::string& session_id);

  // For tests and /metrics: slots currently bound to live models.
  int slots_in_use() const;
  // Counters other layers feed (router: responses; sampler: tokens).
  Metrics& metrics() { return metrics_; }
  // GET /metrics: Prometheus text with the live queue gauges.
  std::string MetricsText() const;

 private:
  enum class ModelState { kActive, kFailed, kExpired, kUnloaded };
  struct TrainingModel {
    std::string model_id;
    std::string owner;
    std::string session_id;
    std::string base_model;
    engine::LoraConfig lora;
    int slot = -1;
    ModelState state = ModelState::kActive;
    std::string state_reason;  // why it is not active
    Sequencer sequencer{0};    // create_model is seq 0
  };
  struct Session {
    std::string session_id;
    std::string owner;
    Clock::time_point last_seen;
    bool expired = false;
    std::vector<std::string> model_ids;
    std::vector<std::string> sampler_ids;
  };
  struct Sampler {
    std::string sampler_id;
    std::string owner;
    std::string base_model;
    std::optional<tinker::TinkerPath> model_path;  // unset: the base model
  };
  struct ArchiveGrant {
    tinker::TinkerPath path;  // resolved at download: an overwrite moves its files
    std::string prefix;
    Clock::time_point expires;
  };
  // A ready request handed to the planner; its datums leave it piece by
  // piece, and the outputs of finished pieces gather in `partial`.
  struct Planned {
    TrainingOp op;
    Clock::time_point ready_at;
    bool started = false;  // a piece has run (its queue wait is recorded)
    std::optional<engine::ForwardBackwardOutput> partial;
  };
  // One planned piece, with everything the engine thread needs to run it
  // outside the lock (see engine_loop.cpp).
  struct PieceWork {
    uint64_t plan_id = 0;
    sched::Piece piece;
    int slot = -1;
    TrainingOp op;  // exclusive/optim: the whole op; packable: call params + this piece's datums
    std::optional<engine::ForwardBackwardOutput> partial;  // last piece: outputs of earlier pieces
  };
  struct PassWork {
    sched::Pass pass;
    std::vector<PieceWork> pieces;
  };

  Result<Submitted> CreateModelLocked(const Caller& caller, const tinker::CreateModelRequest& request,
                                      std::optional<tinker::TinkerPath> load_path, bool with_optimizer);
  // Admits op on its model: dedup, expiry check, ordering. Holds mu_.
  Result<Submitted> AdmitLocked(const Caller& caller, TrainingModel& model, TrainingOp op);
  // Finds a live model of this tenant (NotFound / expired / failed errors).
  Result<TrainingModel*> FindModelLocked(const std::string& tenant, const std::string& model_id, bool must_be_active);
  // Locks mu_ and admits op on its model. A failed precheck (bad input found
  // before admission) is returned as is, and op.seq_id is skipped in the
  // model's sequencer: the SDK never resends a rejected seq_id.
  Result<Submitted> SubmitOnModel(const Caller& caller, const std::string& model_id, TrainingOp op,
                                  Status precheck = Status::Ok());
  // The first answer to caller's X-Idempotency-Key when it was used for the
  // same operation, route and body; the key used for another one is
  // InvalidArgument naming the header. `op` is the Service operation.
  Status IdempotentLocked(const Caller& caller, std::string_view op, std::optional<Submitted>* prior) const;
  void RememberLocked(const Caller& caller, std::string_view op, const Submitted& submitted);
  // Refuses a new model beyond the tenant's quota (Exhausted, 429) or the
  // slot count (Unavailable, 503); both say to retry.
  Status AdmitNewModelLocked(const std::string& tenant) const;
  void TouchSessionLocked(const std::string& session_id);

  void EngineLoop();
  bool AnyReadyLocked() const;
  void FeedPlannerLocked();
  PassWork TakePassLocked(sched::Pass pass);
  // Ends a piece on the engine thread: keeps or joins its output, answers the request.
  void FinishPiece(PieceWork& work, Result<engine::ForwardBackwardOutput> result);
  void FailPlannedLocked(uint64_t plan_id, const Status& status);
  void JanitorLocked(Clock::time_point now, std::vector<int>* slots_to_release);
  // True when the engine should wait for more arrivals before planning a
  // pass (ServiceOptions::batch_window); it has then waited, and the caller
  // loops to feed what arrived.
  bool BatchWindowOpenLocked(std::unique_lock<std::mutex>& lock);
  void ExpireSessionLocked(Session& session, std::vector<int>* slots_to_release);
  void RunPass(PassWork& work);
  void RunForwardBackwardPass(PassWork& work);
  void RunOptimPass(PassWork& work);
  void RunCreateModel(TrainingOp& op);
  void RunSaveWeights(TrainingOp& op);
  void RunLoadWeights(TrainingOp& op);
  void RunSaveForSampler(TrainingOp& op);
  // What the engine thread needs of a model, copied under mu_.
  struct ModelRef {
    std::string model_id;
    std::string owner;
    std::string session_id;
    std::string base_model;
    engine::LoraConfig lora;
    int slot = -1;
  };
  Result<ModelRef> ModelForRun(const std::string& model_id);
  void FailModelLocked(TrainingModel& model, ModelState state, const std::string& reason,
                       std::vector<int>* slots_to_release);

  Result<store::Checkpoint> OwnedCheckpoint(const Caller& caller, const std::string& run_id,
                                            const std::string& checkpoint_id);

  const ServiceOptions options_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<store::Registry> registry_;
  FutureTable futures_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool started_ = false;
  bool stopping_ = false;
  std::thread engine_thread_;
  uint64_t next_ticket_ = 1;
  sched::Planner planner_;
  std::map<uint64_t, Planned> planned_;  // planner request id -> payload
  uint64_t next_plan_id_ = 1;
  Metrics metrics_;
  std::map<std::string, Session> sessions_;
  std::map<std::string, std::unique_ptr<TrainingModel>> models_;
  std::map<std::string, Sampler> samplers_;
  // (tenant, X-Idempotency-Key) -> the first request's scope (operation,
  // route, body digest), its answer and when; pruned after an hour.
  struct Remembered {
    std::string scope;
    Submitted submitted;
    Clock::time_point at;
  };
  std::map<std::pair<std::string, std::string>, Remembered> idempotent_;
  std::map<std::string, ArchiveGrant> archives_;
  std::set<int> free_slots_;
  std::vector<int> slots_to_release_;  // released on the engine thread
  Clock::time_point last_janitor_{};
  Clock::time_point last_arrival_{};  // newest request fed to the planner
  // Declared last: its Sampler (whose callbacks complete futures_) stops first.
  SamplingState sampling_;
};

}  // namespace loom::service
