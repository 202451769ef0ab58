// ServiceLock: the one lock the Service's parts share, the engine thread's
// wake-up and the shutdown flag.
//
// Why one lock for sessions, training models, idempotency memory, the train
// loop's queues and the sampling sessions: their invariants span parts. A
// create_model checks its session is live, its idempotency key unused and the
// tenant's quota, then records the model in its session, as one step; a
// session's expiry fails its models and drops their planned pieces as one
// step. Separate locks would let an expiry slip between the check and the
// record (a live model in an expired session). Parts whose state stands alone
// keep their own lock instead: FutureTable, Metrics, Checkpoints' archive
// grants.
//
// Rules: never held across an Engine call (the engine thread unlocks around
// each); a part's method named *Locked expects the caller to hold `mu`, the
// others take it themselves. Lock order: mu before any part's own lock.
#pragma once
#include <condition_variable>
#include <mutex>

namespace loom::service {

struct ServiceLock {
  std::mutex mu;
  // The engine thread waits on it; notified (under mu) when a request becomes
  // ready, a slot is to be released, or the service stops.
  std::condition_variable work;
  bool stopping = false;  // [mu] Stop() was called: admission answers Unavailable
};

}  // namespace loom::service
