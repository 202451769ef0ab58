// The sampler's cached forward (Transformer::ForwardCached over a paged
// KvCache) against the trainer's hidden states, for the family tests.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "engine/model/cached_batch.h"
#include "tiny_model.h"

namespace loom::engine {

// One 12-token sequence `seq` under `slot`, whose trainer hidden states are
// `want` [12, hidden]: a prefill of positions 0..7, a decode step at 8 (two
// masked pad columns in its context), and a prefill of 9..11 over the
// cached 0..8 written elsewhere in the pool; each within tol of `want`.
inline void ExpectCachedForwardMatches(const Transformer& m, const SlotBank& bank, const std::vector<int32_t>& seq,
                                       int slot, const at::Tensor& want, double tol) {
  ASSERT_EQ(seq.size(), 12u);
  KvCache cache = KvCache::Allocate(Transformer::KvShapes(m.config()), 32, at::kCPU, at::kFloat);
  const auto longs = [](std::vector<int64_t> v) { return at::tensor(v, at::TensorOptions().dtype(at::kLong)); };
  const auto range = [](int64_t a, int64_t b) { return at::arange(a, b, at::TensorOptions().dtype(at::kLong)); };
  CachedBatch prefill;
  prefill.tokens = longs(std::vector<int64_t>(seq.begin(), seq.begin() + 8));
  prefill.positions = range(0, 8);
  prefill.seq_begin = {0, 8};
  prefill.seq_slot = {slot};
  prefill.write_rows = range(0, 8);
  prefill.prefill = true;
  EXPECT_LT(MaxDiff(m.ForwardCached(prefill, cache, bank), want.narrow(0, 0, 8)), tol) << "prefill";
  CachedBatch decode;
  decode.tokens = longs({seq[8]});
  decode.positions = longs({8});
  decode.seq_begin = {0, 1};
  decode.seq_slot = {slot};
  decode.write_rows = longs({8});
  decode.context_rows = at::cat({range(0, 9), longs({0, 0})}).unsqueeze(0);  // two pad columns, masked
  decode.context_mask = at::cat({at::ones({9}), at::zeros({2})}).to(at::kBool).unsqueeze(0);
  EXPECT_LT(MaxDiff(m.ForwardCached(decode, cache, bank), want.narrow(0, 8, 1)), tol) << "decode";
  CachedBatch over;
  over.tokens = longs(std::vector<int64_t>(seq.begin() + 9, seq.end()));
  over.positions = range(9, 12);
  over.seq_begin = {0, 3};
  over.seq_slot = {slot};
  over.write_rows = range(20, 23);
  over.prefill = true;
  over.seq_cached = {9};
  over.cached_rows = range(0, 9);
  EXPECT_LT(MaxDiff(m.ForwardCached(over, cache, bank), want.narrow(0, 9, 3)), tol) << "prefill over a cached prefix";
}

}  // namespace loom::engine
