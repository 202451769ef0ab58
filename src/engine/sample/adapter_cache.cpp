#include "engine/sample/adapter_cache.h"

#include <filesystem>

#include "engine/io/peft.h"

namespace loom::engine::sample {

AdapterCache::AdapterCache(SlotBank* bank) : bank_(bank), entries_(static_cast<size_t>(bank->num_slots())) {}

Result<int> AdapterCache::Acquire(const std::string& dir_in) {
  std::error_code ec;
  std::string dir = std::filesystem::weakly_canonical(dir_in, ec).string();
  if (ec) dir = dir_in;
  ++clock_;
  if (auto it = slot_of_.find(dir); it != slot_of_.end()) {
    Entry& e = entries_[it->second];
    ++e.holds;
    e.last_use = clock_;
    return it->second;
  }
  int victim = -1;
  for (int s = 0; s < static_cast<int>(entries_.size()); ++s) {
    const Entry& e = entries_[s];
    if (e.holds > 0) continue;
    if (e.dir.empty()) {
      victim = s;
      break;
    }
    if (victim < 0 || e.last_use < entries_[victim].last_use) victim = s;
  }
  if (victim < 0) return Status::Exhausted("every sampler adapter slot is in use");
  Entry& e = entries_[victim];
  if (!e.dir.empty()) {
    slot_of_.erase(e.dir);
    bank_->Release(victim);
    e.dir.clear();
    ++evictions_;
  }
  if (Status s = LoadPeft(*bank_, victim, dir); !s.ok()) {
    bank_->Release(victim);
    return s;
  }
  ++loads_;
  e.dir = dir;
  e.holds = 1;
  e.last_use = clock_;
  slot_of_[dir] = victim;
  return victim;
}

void AdapterCache::Release(int slot) {
  if (slot < 0 || slot >= static_cast<int>(entries_.size())) return;
  if (entries_[slot].holds > 0) --entries_[slot].holds;
}

}  // namespace loom::engine::sample
