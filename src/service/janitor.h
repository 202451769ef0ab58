// Janitor: the one periodic sweep. The engine thread calls it each turn (the
// train loop's chores, wired by Service); every janitor_period it asks each
// part to expire its own things, in this order: idle sessions (their models
// fail and give back their slots, their samples are cancelled), seq_id gaps
// that waited too long, create_model calls that waited --capacity-wait for a
// slot (each of these for every base model), finished futures past retention, idempotency keys
// older than an hour, archive grants past their TTL, and (every minute)
// checkpoints past their TTL.
//
// Owns: when it last swept and when it last swept checkpoint TTLs.
//
// Threading: only one engine thread (the first base model's) calls it, with ServiceLock::mu held (the
// parts it sweeps are guarded by it; see service_lock.h); its own members
// are touched by that thread alone.
#pragma once
#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include "service/base_model.h"
#include "service/checkpoint_catalog.h"
#include "service/future_table.h"
#include "service/idempotency.h"
#include "service/options.h"
#include "service/sessions.h"

namespace loom::service {

class Janitor {
 public:
  using Clock = std::chrono::steady_clock;

  Janitor(const ServiceOptions& options, FutureTable& futures, Sessions& sessions,
          const std::vector<std::unique_ptr<BaseModel>>& bases, IdempotencyMemory& idempotency,
          CheckpointCatalog& catalog)
      : options_(options),
        futures_(futures),
        sessions_(sessions),
        bases_(bases),
        idempotency_(idempotency),
        catalog_(catalog) {}

  // Sweeps when janitor_period has passed since the last sweep.
  void SweepIfDueLocked(Clock::time_point now);

 private:
  void SweepLocked(Clock::time_point now);
  // Fails the active models of a session that just expired (on every base
  // model) and cancels the samples of its sampling sessions.
  void ExpireSessionLocked(const Sessions::Session& session);

  const ServiceOptions& options_;
  FutureTable& futures_;
  Sessions& sessions_;
  const std::vector<std::unique_ptr<BaseModel>>& bases_;  // fixed after construction
  IdempotencyMemory& idempotency_;
  CheckpointCatalog& catalog_;
  Clock::time_point last_sweep_{};
  std::optional<Clock::time_point> last_ttl_sweep_;  // the first sweep's time until a TTL sweep
};

}  // namespace loom::service
