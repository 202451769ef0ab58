#include "service/usage.h"

namespace loom::service {

tinker::TenantUsage& Usage::EntryLocked(const std::string& tenant) {
  auto [it, added] = tenants_.try_emplace(tenant);
  if (added) {
    it->second.tenant = tenant;
    it->second.since_ms = since_ms_;
  }
  return it->second;
}

void Usage::AddTrainerTokens(const std::string& tenant, int64_t tokens, bool forward_only) {
  std::lock_guard<std::mutex> lock(mu_);
  tinker::TenantUsage& u = EntryLocked(tenant);
  (forward_only ? u.tokens_forward : u.tokens_trained) += tokens;
}

void Usage::AddPass(const std::string& tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  ++EntryLocked(tenant).passes;
}

void Usage::AddSample(const std::string& tenant, int64_t prompt_tokens, int64_t cached_tokens, int64_t generated) {
  std::lock_guard<std::mutex> lock(mu_);
  tinker::TenantUsage& u = EntryLocked(tenant);
  u.prompt_tokens += prompt_tokens;
  u.prompt_tokens_cached += cached_tokens;
  u.tokens_sampled += generated;
}

void Usage::AddSlotSeconds(const std::string& tenant, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  EntryLocked(tenant).slot_seconds += seconds;
}

tinker::TenantUsage Usage::Of(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tenants_.find(tenant);
  if (it != tenants_.end()) return it->second;
  tinker::TenantUsage none;
  none.tenant = tenant;
  none.since_ms = since_ms_;
  return none;
}

std::map<std::string, tinker::TenantUsage> Usage::All() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tenants_;
}

}  // namespace loom::service
