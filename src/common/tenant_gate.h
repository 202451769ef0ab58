// TenantGate: a counted bound on work in flight, `capacity` places in all and
// at most half of them (at least 1) for one tenant, so one tenant's flood
// cannot take every place. Used by the HTTP decode pool (--decode-queue) and
// by asample's admission to the sampler (--sample-queue); each caller words
// its own refusals.
//
// Invariant: held() == the sum of held(tenant) <= capacity; a tenant holding
// nothing has no entry.
// Threading: thread-safe (one mutex); Leave may run on another thread than
// Enter (e.g. a sampler's completion callback).
#pragma once
#include <algorithm>
#include <map>
#include <mutex>
#include <string>

namespace loom {

class TenantGate {
 public:
  enum class Verdict { kEntered, kFull, kTenantFull };

  explicit TenantGate(int capacity) : capacity_(std::max(1, capacity)), share_(std::max(1, capacity_ / 2)) {}

  // Takes a place for tenant, or says which bound refuses it; *held gets the
  // count at that bound (all places, or the tenant's) before this call.
  Verdict Enter(const std::string& tenant, int* held) {
    std::lock_guard<std::mutex> lock(mu_);
    if (held_ >= capacity_) {
      *held = held_;
      return Verdict::kFull;
    }
    int& mine = by_tenant_[tenant];
    *held = mine;
    if (mine >= share_) {
      if (mine == 0) by_tenant_.erase(tenant);
      return Verdict::kTenantFull;
    }
    ++mine;
    ++held_;
    return Verdict::kEntered;
  }
  void Leave(const std::string& tenant) {
    std::lock_guard<std::mutex> lock(mu_);
    --held_;
    if (--by_tenant_[tenant] <= 0) by_tenant_.erase(tenant);
  }

  int capacity() const { return capacity_; }
  int share() const { return share_; }  // the most one tenant may hold
  int held() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }

 private:
  const int capacity_;
  const int share_;
  mutable std::mutex mu_;
  int held_ = 0;
  std::map<std::string, int> by_tenant_;
};

}  // namespace loom
