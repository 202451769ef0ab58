#include "service/idempotency.h"

#include <fmt/format.h>

#include "common/hash.h"

namespace loom::service {

uint64_t BodyDigest(std::string_view body) { return Fnv1a64(body); }

namespace {
// What a key is bound to: the operation, the route it came by and its body.
std::string IdempotencyScope(const Caller& caller, std::string_view op) {
  return fmt::format("{} via '{}' body {:016x}", op, caller.route, caller.body_digest);
}
}  // namespace

Status IdempotencyMemory::IdempotentLocked(const Caller& caller, std::string_view op,
                                           std::optional<Submitted>* prior) const {
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

void IdempotencyMemory::RememberLocked(const Caller& caller, std::string_view op, const Submitted& submitted) {
  if (caller.idempotency_key.empty()) return;
  idempotent_[{caller.tenant, caller.idempotency_key}] = {IdempotencyScope(caller, op), submitted, Clock::now()};
}

void IdempotencyMemory::ExpireLocked(Clock::time_point now) {
  for (auto it = idempotent_.begin(); it != idempotent_.end();) {
    it = now - it->second.at > std::chrono::hours(1) ? idempotent_.erase(it) : std::next(it);
  }
}

}  // namespace loom::service
