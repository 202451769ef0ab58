#include "engine/sample/adapter_cache.h"

#include <algorithm>
#include <filesystem>

#include "engine/io/peft.h"

namespace loom::engine::sample {

namespace {
// One name per directory, however it was spelled.
std::string Canonical(const std::string& dir) {
  std::error_code ec;
  std::string canonical = std::filesystem::weakly_canonical(dir, ec).string();
  return ec ? dir : canonical;
}
}  // namespace

AdapterCache::AdapterCache(SlotBank* bank) : bank_(bank), entries_(static_cast<size_t>(bank->num_slots())) {}

void AdapterCache::Offer(const std::string& dir_in, std::shared_ptr<const PeftSnapshot> snapshot) {
  const std::string dir = Canonical(dir_in);
  if (slot_of_.count(dir)) return;
  std::erase_if(offers_, [&](const auto& offer) { return offer.first == dir; });
  offers_.emplace_back(dir, std::move(snapshot));
  while (offers_.size() > entries_.size()) offers_.pop_front();
}

Status AdapterCache::Fill(int slot, const std::string& dir, std::shared_ptr<const PeftSnapshot> own) {
  const auto offer = std::find_if(offers_.begin(), offers_.end(), [&](const auto& o) { return o.first == dir; });
  if (!own && offer == offers_.end()) {
    if (Status s = LoadPeft(*bank_, slot, dir); !s.ok()) return s;
    ++loads_;
    return Status::Ok();
  }
  std::shared_ptr<const PeftSnapshot> snapshot = std::move(own);
  if (offer != offers_.end()) {
    if (!snapshot) snapshot = std::move(offer->second);
    offers_.erase(offer);
  }
  snapshot->Ready();
  if (Status s = InstallPeft(*bank_, slot, snapshot->adapter()); !s.ok()) return s;
  ++installs_;
  return Status::Ok();
}

Result<AdapterCache::Acquired> AdapterCache::Acquire(const std::string& dir_in, std::shared_ptr<const PeftSnapshot> own) {
  const std::string dir = Canonical(dir_in);
  ++clock_;
  if (auto it = slot_of_.find(dir); it != slot_of_.end()) {
    Entry& e = entries_[it->second];
    ++e.holds;
    e.last_use = clock_;
    return Acquired{it->second, false};
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
  if (Status s = Fill(victim, dir, std::move(own)); !s.ok()) {
    bank_->Release(victim);
    return s;
  }
  e.dir = dir;
  e.holds = 1;
  e.last_use = clock_;
  slot_of_[dir] = victim;
  return Acquired{victim, true};
}

void AdapterCache::Release(int slot) {
  if (slot < 0 || slot >= static_cast<int>(entries_.size())) return;
  if (entries_[slot].holds > 0) --entries_[slot].holds;
}

}  // namespace loom::engine::sample
