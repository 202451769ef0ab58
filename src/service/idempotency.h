// IdempotencyMemory: what each (tenant, X-Idempotency-Key) was first used for
// and answered, so that a repeat returns the first request's answer (as in
// Stripe). Serves create_session and every training-model request.
//
// Owns: the remembered keys. Invariants: a key is bound to one scope
// (operation, route, body digest); reusing it for another scope is a 400
// naming the header; a key is forgotten an hour after its first use.
//
// Threading: guarded by ServiceLock::mu (every method is *Locked in spirit:
// the caller holds it), because checking a key and remembering its answer are
// one step with the admission they guard.
#pragma once
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"
#include "service/caller.h"

namespace loom::service {

class IdempotencyMemory {
 public:
  using Clock = std::chrono::steady_clock;

  // The first answer to caller's X-Idempotency-Key when it was used for the
  // same operation, route and body; the key used for another one is
  // InvalidArgument naming the header. `op` is the Service operation.
  Status IdempotentLocked(const Caller& caller, std::string_view op, std::optional<Submitted>* prior) const;
  void RememberLocked(const Caller& caller, std::string_view op, const Submitted& submitted);
  // The janitor: forgets keys older than an hour.
  void ExpireLocked(Clock::time_point now);

 private:
  // (tenant, X-Idempotency-Key) -> the first request's scope (operation,
  // route, body digest), its answer and when; pruned after an hour.
  struct Remembered {
    std::string scope;
    Submitted submitted;
    Clock::time_point at;
  };
  std::map<std::pair<std::string, std::string>, Remembered> idempotent_;
};

}  // namespace loom::service
