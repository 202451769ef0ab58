// AdapterCache: which LoRA snapshot sits in which slot of the sampler's
// SlotBank. A snapshot is named by its directory (snapshots are immutable,
// so the directory is the version); it loads from disk on first use, and
// when every slot is taken the least recently used slot that no admitted
// request holds is evicted. An evicted snapshot simply loads again on its
// next use: eviction never makes a snapshot "not found".
// Invariant: a held slot (holds > 0) is never evicted or rebound.
//
// Threading: the decode thread only.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "engine/lora/slot_bank.h"

namespace loom::engine::sample {

class AdapterCache {
 public:
  explicit AdapterCache(SlotBank* bank);

  // The slot holding dir, loaded now if it is not cached; takes a hold.
  // Exhausted when every slot is held (the caller retries later); a load
  // error (missing or malformed snapshot) is returned as is.
  Result<int> Acquire(const std::string& dir);
  void Release(int slot);

  int64_t loads() const { return loads_; }
  int64_t evictions() const { return evictions_; }

 private:
  struct Entry {
    std::string dir;     // empty = free
    int holds = 0;
    uint64_t last_use = 0;
  };
  SlotBank* bank_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, int> slot_of_;
  uint64_t clock_ = 0;
  int64_t loads_ = 0, evictions_ = 0;
};

}  // namespace loom::engine::sample
