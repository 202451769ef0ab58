// FutureTable: every asynchronous Tinker request (create_model, forward_backward,
// optim_step, save/load, ...) is a Future here, found by its request_id and
// bound to the tenant that submitted it.
//
// Invariants: a Future goes pending -> done | failed exactly once; its result
// never changes after that. While pending it carries a queue state (active,
// or paused for capacity with a reason) that polls report (spec §6.3); it is
// only meaningful while pending. Another tenant's id answers exactly like an
// unknown one (NotFound), so ids leak nothing. Completed futures stay
// retrievable for `retention` after completion (the SDK may re-poll after a
// lost answer), then Sweep() drops them.
//
// Thread-safe: I/O threads create, read and watch; the engine thread completes.
// Watch callbacks run on the completing thread, outside the lock, and must only
// post work elsewhere (e.g. cancel a parked poll's timer on its executor).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "common/status.h"
#include "tinker/results.h"

namespace loom::service {

// What a finished request produced, typed per operation (http/ has wire/
// encode it).
using FutureResult = tinker::FutureResult;

enum class FutureState { kPending, kDone, kFailed };
// What a pending future waits for: its turn (active) or a free adapter slot
// (paused_capacity: a create_model queued for a slot, TrainingModels).
enum class QueueState { kActive, kPausedCapacity };

// A snapshot of one future, safe to read after the lock is gone.
struct FutureView {
  std::string request_id;
  std::string kind;  // "CreateModel", "ForwardBackward", ... (Tinker's request types)
  FutureState state = FutureState::kPending;
  Status error;                                // when kFailed
  QueueState queue_state = QueueState::kActive;  // when kPending
  std::string queue_reason;                      // when paused: why, for the client's log
  std::shared_ptr<const FutureResult> result;  // when kDone
};

class FutureTable {
 public:
  using Clock = std::chrono::steady_clock;

  // instance_tag prefixes every id, so ids of an earlier server process are
  // recognisable (IsFromEarlierInstance) and answered as expired, not unknown.
  explicit FutureTable(std::string instance_tag, std::chrono::seconds retention = std::chrono::hours(2));

  // A new pending future owned by owner.
  std::string Create(const std::string& owner, const std::string& kind);

  void Complete(const std::string& request_id, FutureResult result);
  // Sets a pending future's queue state (no effect once it is finished).
  void SetQueueState(const std::string& request_id, QueueState state, std::string reason = "");
  void Fail(const std::string& request_id, Status error);

  // NotFound for unknown ids and for other tenants' ids (same message).
  Result<FutureView> Get(const std::string& owner, const std::string& request_id) const;

  // If the future is still pending, registers on_done (called once when it
  // completes or fails) and returns a watch id > 0. Returns 0 when it is
  // already finished or unknown: the caller should look again instead of waiting.
  uint64_t Watch(const std::string& request_id, std::function<void()> on_done);
  void Unwatch(const std::string& request_id, uint64_t watch_id);

  // True when request_id looks like one of ours but from another process.
  bool IsFromEarlierInstance(const std::string& request_id) const;

  // Drops finished futures older than the retention; returns how many.
  size_t Sweep(Clock::time_point now);

  size_t size() const;

 private:
  struct Entry {
    std::string owner;
    FutureView view;
    Clock::time_point finished_at{};
    std::map<uint64_t, std::function<void()>> watchers;
  };
  void Finish(const std::string& request_id, FutureState state, Status error,
              std::shared_ptr<const FutureResult> result);

  const std::string tag_;
  const std::chrono::seconds retention_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> entries_;
  uint64_t next_id_ = 1;
  uint64_t next_watch_ = 1;
};

}  // namespace loom::service
