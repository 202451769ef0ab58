#include "engine/sample/block_manager.h"

#include "engine/sample_api.h"

#include <algorithm>
#include <stdexcept>

namespace loom::engine::sample {

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size)
    : block_size_(block_size),
      refs_(static_cast<size_t>(num_blocks), 0),
      tags_(static_cast<size_t>(num_blocks), 0),
      key_of_(static_cast<size_t>(num_blocks)),
      published_(static_cast<size_t>(num_blocks), 0),
      idle_at_(static_cast<size_t>(num_blocks)) {
  free_.reserve(refs_.size());
  // Lowest block ids first (pop_back), for readable tests.
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int>(b));
}

int64_t BlockManager::WorstCase(int64_t prompt_len, int64_t max_tokens, int64_t num_samples) const {
  return KvBlocksWorstCase(block_size_, prompt_len, max_tokens, num_samples);
}

bool BlockManager::Reserve(int64_t n) {
  if (n < 0 || reserved_ + n > free_count()) return false;
  reserved_ += n;
  return true;
}

void BlockManager::Unreserve(int64_t n) { reserved_ = std::max<int64_t>(0, reserved_ - n); }

int BlockManager::Allocate() {
  if (reserved_ <= 0 || free_count() == 0) throw std::logic_error("BlockManager::Allocate without a reservation");
  --reserved_;
  int b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    b = idle_.front();
    Unpublish(b);
    ++evictions_;
  }
  refs_[b] = 1;
  tags_[b] = next_tag_++;
  return b;
}

void BlockManager::Share(int block) {
  if (refs_.at(block) == 0) throw std::logic_error("BlockManager::Share of a block no one holds");
  ++refs_[block];
}

void BlockManager::Release(int block) {
  if (--refs_.at(block) != 0) return;
  if (published_[block]) {
    idle_at_[block] = idle_.insert(idle_.end(), block);
  } else {
    free_.push_back(block);
  }
}

uint64_t BlockManager::RootTag(const std::string& adapter) {
  auto [it, fresh] = roots_.emplace(adapter, 0);
  if (fresh) it->second = next_tag_++;
  return it->second;
}

size_t BlockManager::KeyHash::operator()(const Key& k) const {
  uint64_t h = k.parent * 0x9E3779B97F4A7C15ull;
  for (int32_t t : k.tokens) h = (h ^ static_cast<uint32_t>(t)) * 0x100000001B3ull;
  return static_cast<size_t>(h ^ (h >> 29));
}

BlockManager::Key BlockManager::MakeKey(uint64_t parent, const int32_t* tokens) const {
  return Key{parent, std::vector<int32_t>(tokens, tokens + block_size_)};
}

std::vector<int> BlockManager::Match(uint64_t root, const int32_t* tokens, int64_t max_blocks) const {
  std::vector<int> hits;
  uint64_t parent = root;
  for (int64_t i = 0; i < max_blocks; ++i) {
    auto it = cached_.find(MakeKey(parent, tokens + i * block_size_));
    if (it == cached_.end()) break;
    hits.push_back(it->second);
    parent = tags_[it->second];
  }
  return hits;
}

int64_t BlockManager::Idle(const std::vector<int>& blocks) const {
  return std::count_if(blocks.begin(), blocks.end(), [&](int b) { return refs_.at(b) == 0; });
}

bool BlockManager::Acquire(const std::vector<int>& hits, int64_t n) {
  if (n < 0 || reserved_ + n + Idle(hits) > free_count()) return false;
  for (int b : hits) {
    if (refs_[b]++ == 0) idle_.erase(idle_at_[b]);
  }
  reserved_ += n;
  return true;
}

void BlockManager::Publish(int block, uint64_t parent, const int32_t* tokens) {
  if (refs_.at(block) == 0) throw std::logic_error("BlockManager::Publish of a block no one holds");
  if (published_[block]) return;
  Key key = MakeKey(parent, tokens);
  if (cached_.count(key)) return;
  cached_.emplace(key, block);
  key_of_[block] = std::move(key);
  published_[block] = 1;
}

void BlockManager::Unpublish(int block) {
  idle_.erase(idle_at_[block]);
  cached_.erase(key_of_[block]);
  key_of_[block] = Key{};
  published_[block] = 0;
}

}  // namespace loom::engine::sample
