#include "engine/sample/block_manager.h"

#include <algorithm>
#include <stdexcept>

namespace loom::engine::sample {

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size)
    : block_size_(block_size), refs_(static_cast<size_t>(num_blocks), 0) {
  free_.reserve(refs_.size());
  // Lowest block ids first (pop_back), for readable tests.
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int>(b));
}

int64_t BlockManager::WorstCase(int64_t prompt_len, int64_t max_tokens, int64_t num_samples) const {
  const int64_t ctx = std::max(prompt_len, prompt_len + max_tokens - 1);
  const int64_t per_sample = (ctx + block_size_ - 1) / block_size_;
  const int64_t shared = prompt_len / block_size_;
  return per_sample + (num_samples - 1) * (per_sample - shared);
}

bool BlockManager::Reserve(int64_t n) {
  if (n < 0 || reserved_ + n > free_count()) return false;
  reserved_ += n;
  return true;
}

void BlockManager::Unreserve(int64_t n) { reserved_ = std::max<int64_t>(0, reserved_ - n); }

int BlockManager::Allocate() {
  if (reserved_ <= 0 || free_.empty()) throw std::logic_error("BlockManager::Allocate without a reservation");
  --reserved_;
  const int b = free_.back();
  free_.pop_back();
  refs_[b] = 1;
  return b;
}

void BlockManager::Share(int block) { ++refs_.at(block); }

void BlockManager::Release(int block) {
  if (--refs_.at(block) == 0) free_.push_back(block);
}

}  // namespace loom::engine::sample
