// TrainLoop: the engine thread. It feeds the requests the models' sequencers
// released to the planner, takes the planned passes (packed forward /
// forward_backward pieces, optimizer steps, exclusive ops), runs them on the
// Engine and answers their futures. Its loop body reads feed -> plan -> run
// -> finish; each turn also lets the janitor sweep and releases the slots of
// models that went away.
//
// Owns: planner_ (the requests not yet fully run), planned_ (planner request
// id -> the request, its datums leaving piece by piece, the outputs of
// finished pieces), the engine thread and its lifecycle.
//
// Invariants:
//  - only the engine thread calls the Engine (except the pure Validate*()),
//    and never with ServiceLock::mu held;
//  - a request split over passes takes effect whole or not at all (its
//    slot's gradient is marked before the first piece and rolled back if a
//    piece fails);
//  - a planned request's model is active and holds a slot when a piece of it
//    is taken (create_model: binds one), else the request fails;
//  - after Stop(), everything queued or planned fails with Unavailable.
//
// Threading: planner_, planned_, next_plan_id_, last_arrival_ and started_
// are guarded by ServiceLock::mu (shared with the models whose queues feed
// the planner: see service_lock.h). The engine thread waits on
// ServiceLock::work.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "engine/api.h"
#include "sched/planner.h"
#include "service/checkpoints.h"
#include "service/future_table.h"
#include "service/metrics.h"
#include "service/options.h"
#include "service/publisher.h"
#include "service/service_lock.h"
#include "service/sessions.h"
#include "service/training_models.h"
#include "service/training_op.h"
#include "service/usage.h"

namespace loom::service {

class TrainLoop {
 public:
  using Clock = std::chrono::steady_clock;
  using TrainingModel = TrainingModels::TrainingModel;
  using ModelState = TrainingModels::ModelState;

  TrainLoop(const ServiceOptions& options, engine::Engine& engine, FutureTable& futures, Metrics& metrics,
            Usage& usage, ServiceLock& lock, Sessions& sessions, TrainingModels& models, Checkpoints& checkpoints,
            Publisher& publisher);

  bool StartedLocked() const { return started_; }
  // The periodic chores the engine thread runs each turn, under the lock,
  // before it looks for work (the Janitor's sweep).
  using Chores = std::function<void(Clock::time_point now)>;
  // Starts the engine thread.
  void StartLocked(Chores chores);
  // Lets the batch in flight finish, fails everything still queued with
  // Unavailable ("server shutting down"), and joins the engine thread.
  void Stop();

  // Fails model (TrainingModels::FailModelLocked) and drops its planned pieces.
  void FailModelLocked(TrainingModel& model, ModelState state, const std::string& reason);
  // Adds the planner's queue depths, oldest waits and token budget.
  void QueueDepthsLocked(QueueSnapshot* live) const;

 private:
  // A ready request handed to the planner; its datums leave it piece by
  // piece, and the outputs of finished pieces gather in `partial`.
  struct Planned {
    TrainingOp op;
    Clock::time_point ready_at;
    bool started = false;  // a piece has run (its queue wait is recorded)
    std::optional<engine::ForwardBackwardOutput> partial;
  };
  // One planned piece, with everything the engine thread needs to run it
  // outside the lock.
  struct PieceWork {
    uint64_t plan_id = 0;
    sched::Piece piece;
    int slot = -1;
    std::string owner;  // the model's tenant, charged for the piece (Usage)
    TrainingOp op;  // exclusive/optim: the whole op; packable: call params + this piece's datums
    std::optional<engine::ForwardBackwardOutput> partial;  // last piece: outputs of earlier pieces
  };
  struct PassWork {
    sched::Pass pass;
    std::vector<PieceWork> pieces;
  };

  void EngineLoop();
  // Sleeps until there is work, a slot to release, a stop, or janitor_period.
  void WaitForWorkLocked(std::unique_lock<std::mutex>& lock);
  // Hands released slots back to the engine (outside the lock), then frees them.
  void ReleaseSlots(std::unique_lock<std::mutex>& lock);
  // Stop(): fails everything planned or queued.
  void FailAllLocked();
  // feed: everything the sequencers released goes to the planner.
  void FeedLocked();
  // plan: the next pass with its pieces taken out, or nothing (the batch
  // window is open, or nothing can run).
  std::optional<PassWork> PlanLocked(std::unique_lock<std::mutex>& lock);
  // True when the engine should wait for more arrivals before planning a
  // pass (ServiceOptions::batch_window); it has then waited, and the caller
  // loops to feed what arrived.
  bool BatchWindowOpenLocked(std::unique_lock<std::mutex>& lock);
  PassWork TakePassLocked(sched::Pass pass);
  void FailPlannedLocked(uint64_t plan_id, const Status& status);
  // run: the pass on the engine, answering each piece (a forward_backward or
  // optim pass after FinishPass, so that a client that has its answer also
  // sees the pass in the metrics and the dashboard).
  void RunPass(PassWork& work, Clock::time_point started);
  void RunForwardBackwardPass(PassWork& work, Clock::time_point started);
  void RunOptimPass(PassWork& work, Clock::time_point started);
  void RunCreateModel(TrainingOp& op);
  void RunSave(TrainingOp& op);            // save_weights: written and committed here
  void RunSaveForSampler(TrainingOp& op);  // the slot's snapshot, handed to the publisher
  void RunLoadWeights(TrainingOp& op);
  // Ends a piece on the engine thread: keeps or joins its output, answers the request.
  void FinishPiece(PieceWork& work, Result<engine::ForwardBackwardOutput> result);
  // finish: the pass's metrics and log line (its usage is charged before it
  // runs), once the engine is done.
  void FinishPass(const PassWork& work, Clock::time_point started);
  // The tenants with a piece in the pass (each charged one pass).
  static std::set<std::string> PassOwners(const PassWork& work);

  const ServiceOptions& options_;
  engine::Engine& engine_;
  FutureTable& futures_;
  Metrics& metrics_;
  Usage& usage_;
  ServiceLock& lock_;
  Sessions& sessions_;          // [lock_.mu]
  TrainingModels& models_;      // [lock_.mu]
  Checkpoints& checkpoints_;
  Publisher& publisher_;
  Chores chores_;  // set by StartLocked, run by the engine thread under lock_.mu

  bool started_ = false;                 // [lock_.mu]
  std::thread engine_thread_;
  sched::Planner planner_;               // [lock_.mu]
  std::map<uint64_t, Planned> planned_;  // [lock_.mu] planner request id -> payload
  uint64_t next_plan_id_ = 1;            // [lock_.mu]
  Clock::time_point last_arrival_{};     // [lock_.mu] newest request fed to the planner
};

}  // namespace loom::service
