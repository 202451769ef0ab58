// AdapterCache: which LoRA snapshot sits in which slot of the sampler's
// SlotBank. A snapshot is named by its directory (snapshots are immutable,
// so the directory is the version). On first use it is installed from the
// trainer's in-memory copy when one was offered for that directory (no disk
// read), else loaded from disk; when every slot is taken the least recently
// used slot that no admitted request holds is evicted. An evicted snapshot
// simply loads again on its next use: eviction never makes a snapshot "not
// found".
// Invariants: a held slot (holds > 0) is never evicted or rebound; at most
// one offer per directory, and at most as many offers as slots (the oldest
// is dropped first).
//
// Threading: the decode thread only.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"
#include "engine/io/peft_snapshot.h"
#include "engine/lora/slot_bank.h"

namespace loom::engine::sample {

class AdapterCache {
 public:
  explicit AdapterCache(SlotBank* bank);

  // snapshot holds what dir holds (or will, once it is committed). Ignored
  // when dir is resident already; replaces an earlier offer for dir.
  void Offer(const std::string& dir, std::shared_ptr<const PeftSnapshot> snapshot);

  struct Acquired {
    int slot = -1;
    bool fresh = false;  // the slot was (re)bound now: its device copies are stale
  };
  // The slot holding dir, installed or loaded now if it is not cached (from
  // `own`, the call's in-memory snapshot, when given; else from an offer,
  // else from disk); takes a hold. Exhausted when every slot is held (the
  // caller retries later); a load error (missing or malformed snapshot) is
  // returned as is.
  Result<Acquired> Acquire(const std::string& dir, std::shared_ptr<const PeftSnapshot> own = nullptr);
  void Release(int slot);

  int64_t loads() const { return loads_; }
  int64_t installs() const { return installs_; }
  int64_t evictions() const { return evictions_; }

 private:
  struct Entry {
    std::string dir;     // empty = free
    int holds = 0;
    uint64_t last_use = 0;
  };
  // Fills slot with dir: from own when given, else from its offer (taken
  // out of offers_), else from disk.
  Status Fill(int slot, const std::string& dir, std::shared_ptr<const PeftSnapshot> own);

  SlotBank* bank_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, int> slot_of_;
  std::deque<std::pair<std::string, std::shared_ptr<const PeftSnapshot>>> offers_;  // oldest first
  uint64_t clock_ = 0;
  int64_t loads_ = 0, installs_ = 0, evictions_ = 0;
};

}  // namespace loom::engine::sample
