// BlockManager: the free list and reference counts of the paged KV cache's
// blocks, admission reservations (as nano-vllm's block_manager.py), and the
// prefix cache: full blocks stay cached after their last owner lets go and
// a later request with the same prefix reuses them (as vLLM's block hashing).
//
// The KV cache is block-allocated: block b covers cache rows
// [b * block_size, (b + 1) * block_size). Admission control reserves a
// request's worst case up front (prompt + max_tokens for every sample, with
// the shared prompt blocks counted once), so a running sequence never waits
// for a block and nothing is ever preempted; a request that does not fit
// waits in the queue until running ones finish.
//
// Prefix cache. A full block's K/V depend only on the adapter and on every
// token up to the block's end, so a published block is keyed by (its
// parent's tag, its own block_size tokens), where the parent's tag is the
// previous block's tag, or for block 0 the root tag of the adapter identity
// (a snapshot directory; "" = the base model). A block's tag is a serial
// number drawn anew each time the block is allocated, so a key whose parent
// was evicted and reused can never match again: lookups are exact (no hash
// collisions), chained block by block. Blocks no one holds are either plain
// free or idle-cached (published, in LRU order); both count as free, and
// Allocate() takes a plain one first, else evicts the least recently
// released idle one. Blocks held by a running sequence are never evicted.
// Owners release a sequence's blocks last block first, so a chain's tail is
// evicted before its head.
// Invariants: free_count() == blocks with refcount 0 (plain + idle cached);
// reserved() <= free_count(); every key maps to a block that holds it.
//
// Threading: the decode thread only. Torch-free.
#pragma once
#include <cstdint>
#include <list>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace loom::engine::sample {

class BlockManager {
 public:
  BlockManager(int64_t num_blocks, int64_t block_size);

  int64_t num_blocks() const { return static_cast<int64_t>(refs_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t free_count() const { return static_cast<int64_t>(free_.size() + idle_.size()); }
  int64_t reserved() const { return reserved_; }
  int64_t cached_count() const { return static_cast<int64_t>(idle_.size()); }  // idle, kept for reuse
  int64_t evictions() const { return evictions_; }

  // Blocks one request needs at most: every sample holds prompt + max_tokens
  // - 1 positions (the last token is never fed back); the prompt's full
  // blocks are shared by all samples.
  int64_t WorstCase(int64_t prompt_len, int64_t max_tokens, int64_t num_samples) const;

  // Promises n free blocks to a request; false (and no change) when fewer
  // than n free blocks are unpromised.
  bool Reserve(int64_t n);
  void Unreserve(int64_t n);
  // Takes one promised block (refcount 1), evicting an idle cached block
  // when no plain free one is left. Requires reserved() > 0.
  int Allocate();
  void Share(int block);    // one more owner (of a held block)
  void Release(int block);  // one owner fewer; free (or idle cached) at zero

  // --- prefix cache ---
  // The root tag of an adapter identity (stable for the manager's life).
  uint64_t RootTag(const std::string& adapter);
  // The tag a child block of `block` is keyed under.
  uint64_t Tag(int block) const { return tags_.at(block); }
  // The longest chain of published blocks holding tokens[0, n * block_size)
  // under root, n <= max_blocks. Changes nothing.
  std::vector<int> Match(uint64_t root, const int32_t* tokens, int64_t max_blocks) const;
  // How many of `blocks` no one holds (taking them lowers free_count()).
  int64_t Idle(const std::vector<int>& blocks) const;
  // Takes one hold on each of `hits` and promises n more blocks, or changes
  // nothing and returns false when the hits' idle blocks plus n do not fit.
  bool Acquire(const std::vector<int>& hits, int64_t n);
  // Publishes held, full block `block` as holding `tokens` (block_size of
  // them) after parent tag `parent`. No-op when the key is already cached in
  // another block (that one stays the cached copy) or `block` is published.
  void Publish(int block, uint64_t parent, const int32_t* tokens);

 private:
  struct Key {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    bool operator==(const Key& o) const { return parent == o.parent && tokens == o.tokens; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  Key MakeKey(uint64_t parent, const int32_t* tokens) const;
  void Unpublish(int block);

  int64_t block_size_;
  std::vector<int> refs_;
  std::vector<int> free_;  // refcount 0, not published
  int64_t reserved_ = 0;
  int64_t evictions_ = 0;
  uint64_t next_tag_ = 1;
  std::vector<uint64_t> tags_;                          // per block: drawn at each Allocate
  std::vector<Key> key_of_;                             // per block: its key while published
  std::vector<char> published_;                         // per block
  std::list<int> idle_;                                 // refcount 0 and published, LRU first
  std::vector<std::list<int>::iterator> idle_at_;       // per block, valid while in idle_
  std::unordered_map<Key, int, KeyHash> cached_;        // key -> published block
  std::map<std::string, uint64_t> roots_;               // adapter identity -> root tag
};

}  // namespace loom::engine::sample
