// TrainingModels: the training models (owner, session, LoRA config, adapter
// slot, state) with their sequencers, the free adapter slots, the queue of
// create_model calls waiting for a slot, and the admission of requests onto a
// model (ownership, dedup, ordering, quota).
//
// Owns: models_ (model id -> TrainingModel, each with the Sequencer that puts
// its requests into seq_id order), free_slots_, slots_to_release_ (slots of
// failed/expired/unloaded models, released on the engine thread, then free
// again), slot_waiters_ (models waiting for a slot, oldest first),
// next_ticket_ (arrival order across models).
//
// Invariants:
//  - a model's requests take effect in seq_id order; a repeated (model_id,
//    seq_id) returns the first request's future, and so does a repeated
//    X-Idempotency-Key on the same route with the same body
//    (IdempotencyMemory);
//  - a tenant holds at most max_models_per_tenant live models (holding a
//    slot, granted one, or waiting for one): create_model beyond it is
//    refused up front (429) before a model is recorded;
//  - at most max_slots models are granted a slot (bound, or about to bind
//    one); a create_model beyond that waits in slot_waiters_ (its future
//    reports paused_capacity) unless capacity_wait is 0 or the queue holds
//    kWaitersPerSlot x max_slots already (then 503 up front);
//  - waiters are granted in arrival order, whatever their tenant, as soon as
//    a granted model goes away (unload, expiry, failure): a later
//    create_model never overtakes an earlier waiter. A waiter that waited
//    capacity_wait fails naming the limit; one that goes away (its session
//    expires, it is unloaded) leaves the queue;
//  - a waiting model's requests stay in its sequencer: none reaches the
//    train loop before it is granted;
//  - a model belongs to its creating tenant; another tenant gets NotFound
//    with the text for an unknown id;
//  - a slot is in exactly one of: free_slots_, bound to one active model,
//    slots_to_release_ (or on its way from there to free_slots_);
//  - a model that is not active has no slot and nothing queued; later calls
//    on it fail with a FailedPrecondition saying why (e.g. "expired").
//
// Threading: everything is guarded by ServiceLock::mu (shared with sessions
// and the train loop: see service_lock.h). Methods named *Locked expect it
// held; the others take it. None calls the Engine except its pure info().
#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/api.h"
#include "service/caller.h"
#include "service/future_table.h"
#include "service/idempotency.h"
#include "service/metrics.h"
#include "service/options.h"
#include "service/sequencer.h"
#include "service/service_lock.h"
#include "service/sessions.h"
#include "service/usage.h"
#include "store/registry.h"
#include "tinker/path.h"
#include "tinker/requests.h"

namespace loom::service {

class TrainingModels {
 public:
  using Clock = std::chrono::steady_clock;
  enum class ModelState { kActive, kFailed, kExpired, kUnloaded };
  // What the engine thread needs of a model, copied under the lock.
  struct ModelRef {
    std::string model_id;
    std::string owner;
    std::string session_id;
    std::string base_model;
    engine::LoraConfig lora;
    int slot = -1;
  };
  struct TrainingModel : ModelRef {
    ModelState state = ModelState::kActive;
    std::string state_reason;  // why it is not active
    Sequencer sequencer{0};    // create_model is seq 0
    bool waiting_for_slot = false;     // in slot_waiters_: active, but nothing of it runs yet
    Clock::time_point waiting_since{};
    Clock::time_point bound_at{};      // when slot was bound (slot-seconds)
  };
  // The wait queue holds at most this many models per slot.
  static constexpr int kWaitersPerSlot = 4;

  TrainingModels(const ServiceOptions& options, const engine::ModelInfo& info, store::Registry& registry,
                 FutureTable& futures, ServiceLock& lock, Sessions& sessions, IdempotencyMemory& idempotency,
                 Usage& usage);

  // ---- admission (I/O threads) ----
  // Checks and records a new model and admits its create_model as seq 0
  // (load_path: created from that checkpoint, already parsed). The Service
  // calls it with the lock held, after checking model ids across base models.
  Result<Submitted> CreateModelLocked(const Caller& caller, const tinker::CreateModelRequest& request,
                                      std::optional<tinker::TinkerPath> load_path, bool with_optimizer);
  // Locks and admits op on its model. A failed precheck (bad input found
  // before admission) is returned as is, and op.seq_id is skipped in the
  // model's sequencer: the SDK never resends a rejected seq_id.
  Result<Submitted> SubmitOnModel(const Caller& caller, const std::string& model_id, TrainingOp op,
                                  Status precheck = Status::Ok());
  // Finds a live model of this tenant (NotFound / expired / failed errors).
  Result<TrainingModel*> FindModelLocked(const std::string& tenant, const std::string& model_id,
                                         bool must_be_active);
  // Marks model failed/expired/unloaded: its slot goes to be released (and
  // the oldest waiter is granted its place), or it leaves the wait queue; its
  // queued requests fail with `reason`. Its planned pieces are the train
  // loop's (TrainLoop::FailModelLocked does both).
  void FailModelLocked(TrainingModel& model, ModelState state, const std::string& reason);

  // ---- the engine thread ----
  bool AnyReadyLocked() const;
  // Everything the sequencers released, each model's in seq_id order, models
  // oldest ready head first (so tickets follow arrival across models).
  std::vector<TrainingOp> PopReadyLocked();
  // Any model (any tenant), or null.
  TrainingModel* FindLocked(const std::string& model_id);
  Result<ModelRef> ModelForRun(const std::string& model_id);
  // A free slot, taken; -1 when none.
  int TakeFreeSlotLocked();
  // Records that model now holds `slot` (from TakeFreeSlotLocked).
  void BindLocked(TrainingModel& model, int slot);
  std::vector<int> TakeSlotsToReleaseLocked();
  bool HasSlotsToReleaseLocked() const { return !slots_to_release_.empty(); }
  void FreeSlotsLocked(const std::vector<int>& released);
  // Stop(): removes and returns every model's queued requests.
  std::vector<TrainingOp> DrainAllLocked();

  // ---- the janitor ----
  // Fails the requests that waited longer than seq_gap_timeout for a gap.
  void ExpireGapsLocked(Clock::time_point now);
  // The waiters that waited capacity_wait: their create_model fails naming
  // the limit. Returns them for the caller to fail (TrainLoop::FailModelLocked).
  std::vector<TrainingModel*> OverdueWaitersLocked(Clock::time_point now);
  // The error such a waiter's create_model fails with.
  Status CapacityWaitExpired(const TrainingModel& model) const;

  // ---- gauges ----
  int SlotsInUseLocked() const;
  int WaitersLocked() const { return static_cast<int>(slot_waiters_.size()); }
  void QueueDepthsLocked(QueueSnapshot* live) const;  // active models' queued requests
  // The tenant's active models (the dashboard's list), by model id.
  std::vector<ModelRef> TenantModelsLocked(const std::string& tenant, std::vector<bool>* waiting_for_slot) const;
  // The tenant's models holding a slot and waiting for one, and the seconds
  // its live models have held theirs so far (not yet in Usage).
  void TenantSlotsLocked(const std::string& tenant, Clock::time_point now, tinker::TenantUsage* into) const;
  // The tenants with an active model (holding, granted or waiting for a slot).
  std::set<std::string> TenantsLocked() const;

 private:
  // Admits op on its model: dedup, expiry check, ordering.
  Result<Submitted> AdmitLocked(const Caller& caller, TrainingModel& model, TrainingOp op);
  // Refuses a new model beyond the tenant's quota (Exhausted, 429), or the
  // slot count when it may not wait (Unavailable, 503); both say to retry.
  // *wait: it must wait for a slot.
  Status AdmitNewModelLocked(const std::string& tenant, bool* wait) const;
  // Models granted a slot (bound or about to bind): active and not waiting.
  int GrantedLocked() const;
  // Grants the oldest waiters the places granted models left.
  void GrantWaitersLocked();
  // Tells every waiter its place in the queue (its future's queue_state_reason).
  void RefreshWaitersLocked();

  const ServiceOptions& options_;
  const engine::ModelInfo& info_;
  store::Registry& registry_;
  FutureTable& futures_;
  ServiceLock& lock_;
  Sessions& sessions_;              // [lock_.mu]
  IdempotencyMemory& idempotency_;  // [lock_.mu]
  Usage& usage_;

  std::map<std::string, std::unique_ptr<TrainingModel>> models_;  // [lock_.mu]
  std::set<int> free_slots_;                                      // [lock_.mu]
  std::vector<int> slots_to_release_;                             // [lock_.mu] released on the engine thread
  std::deque<TrainingModel*> slot_waiters_;                       // [lock_.mu] oldest first
  uint64_t next_ticket_ = 1;                                      // [lock_.mu]
};

}  // namespace loom::service
