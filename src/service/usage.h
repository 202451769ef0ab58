// Usage: what each tenant has used since the server started, for billing and
// caps (docs/usage.md): trainer tokens and passes, sampled and prompt tokens,
// and the seconds its models held adapter slots. The stored figures
// (checkpoints, bytes) are not counted here: the registry holds them, and
// Service::UsageOf reads them when asked.
//
// Recorded by: the train loop (each piece the engine ran, each pass), the
// sampler's completion callbacks (sampled and prompt tokens), and
// TrainingModels (slot-seconds of a model when it gives its slot back; a
// live model's running seconds are added when read).
//
// Invariants: counters only grow; a tenant appears once it has used
// something; the figures of all tenants add up to what the trainer and the
// sampler did (each piece and sample is charged to exactly one tenant, the
// owner of its model or sampling session).
//
// Threading: every method may be called from any thread (one internal
// mutex, taken after ServiceLock::mu when both are held, never around it).
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "tinker/results.h"

namespace loom::service {

class Usage {
 public:
  explicit Usage(int64_t since_ms) : since_ms_(since_ms) {}

  // Tokens of a forward_backward (or, forward_only, a forward) piece the engine ran.
  void AddTrainerTokens(const std::string& tenant, int64_t tokens, bool forward_only);
  // One trainer pass that ran at least one request of the tenant.
  void AddPass(const std::string& tenant);
  // One sample request answered: its prompt (and the part of it the prefix
  // cache served) and the tokens it generated over all its samples.
  void AddSample(const std::string& tenant, int64_t prompt_tokens, int64_t cached_tokens, int64_t generated);
  // Seconds a model of the tenant held an adapter slot, added when it gave it back.
  void AddSlotSeconds(const std::string& tenant, double seconds);

  // The counted figures (only the counters of tinker::TenantUsage are set).
  tinker::TenantUsage Of(const std::string& tenant) const;
  std::map<std::string, tinker::TenantUsage> All() const;
  int64_t since_ms() const { return since_ms_; }

 private:
  tinker::TenantUsage& EntryLocked(const std::string& tenant);

  const int64_t since_ms_;
  mutable std::mutex mu_;
  std::map<std::string, tinker::TenantUsage> tenants_;  // [mu_]
};

}  // namespace loom::service
