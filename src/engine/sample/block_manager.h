// BlockManager: the free list and reference counts of the paged KV cache's
// blocks, plus admission reservations (as nano-vllm's block_manager.py).
//
// The KV cache is block-allocated: block b covers cache rows
// [b * block_size, (b + 1) * block_size). Admission control reserves a
// request's worst case up front (prompt + max_tokens for every sample, with
// the shared prompt blocks counted once), so a running sequence never waits
// for a block and nothing is ever preempted; a request that does not fit
// waits in the queue until running ones finish.
// Invariant: free_count() == blocks with refcount 0; reserved() <= free_count().
//
// Threading: the decode thread only. Torch-free.
#pragma once
#include <cstdint>
#include <vector>

namespace loom::engine::sample {

class BlockManager {
 public:
  BlockManager(int64_t num_blocks, int64_t block_size);

  int64_t num_blocks() const { return static_cast<int64_t>(refs_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t free_count() const { return static_cast<int64_t>(free_.size()); }
  int64_t reserved() const { return reserved_; }

  // Blocks one request needs at most: every sample holds prompt + max_tokens
  // - 1 positions (the last token is never fed back); the prompt's full
  // blocks are shared by all samples.
  int64_t WorstCase(int64_t prompt_len, int64_t max_tokens, int64_t num_samples) const;

  // Promises n free blocks to a request; false (and no change) when fewer
  // than n free blocks are unpromised.
  bool Reserve(int64_t n);
  void Unreserve(int64_t n);
  // Takes one promised block (refcount 1). Requires reserved() > 0.
  int Allocate();
  void Share(int block);    // one more owner
  void Release(int block);  // one owner fewer; free at zero

 private:
  int64_t block_size_;
  std::vector<int> refs_;
  std::vector<int> free_;
  int64_t reserved_ = 0;
};

}  // namespace loom::engine::sample
