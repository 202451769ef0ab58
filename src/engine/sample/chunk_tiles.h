// ChunkTiles: which rows of a step on the decode graphs attend together.
//
// A prefill chunk on the decode graphs is one row per new token: rows of one
// sequence at consecutive positions, row i seeing one context token more
// than row i - 1, all over the same block table (model_runner.h). Attended
// row by row (cuda::DecodeAttention), every row reads the whole cached
// context again: a cached 80-token turn over 4,500 tokens of history reads
// 80 x 4,500 K/V rows a layer. cuda::ChunkAttention instead serves a tile of
// such rows together with every query head of one K/V head, so that each
// K/V row it loads serves up to 16 queries (tile rows x the grouped-query
// group) on the tensor cores.
//
// PlanChunkTiles finds the runs (a row continues the one before it when
// its block table is the same object, its position is one more and its
// context one token longer), cuts each run of two rows or more whose last
// row's context is at least min_context tokens into tiles of at most
// tile_rows rows, and splits the contexts so that the launch has at least
// target_warps warps (a tile, a K/V head and a split: a warp), each split
// a whole number of kChunkSplitAlign tokens and at least min_split (unless
// the context is shorter). Rows outside every tile attend alone. No tile
// when there are more warps than max_warps even unsplit, or when no run
// qualifies.
//
// The decode graphs take runs of kChunkMinContext tokens of context or
// more, in splits of at least kChunkMinSplit: over short contexts a row
// reads little, and the tiles' second kernel (the splits' merge) cost more
// than they saved (on the H100, 64 prompts of 32 tokens prefilled in 59.9 ms
// tiled against 50.5 row by row; an 80-token turn over 4,500 tokens of
// history in 24 ms against 30; docs/benchmarks.md, session 33).
//
// Threading: plain functions. Torch-free.
#pragma once
#include <cstdint>
#include <vector>

namespace loom::engine {

// A split of a tile's context is a multiple of this many tokens (the
// kernel's step over the context).
inline constexpr int64_t kChunkSplitAlign = 16;
inline constexpr int64_t kChunkMinContext = 1024;
inline constexpr int64_t kChunkMinSplit = 256;

struct ChunkTilePlan {
  std::vector<int32_t> first;     // per tile: its first row
  std::vector<int32_t> rows;      // per tile: its rows, first .. first + rows - 1
  std::vector<int32_t> row_tile;  // per row of the step: its tile, or -1 (the row attends alone)
  int32_t splits = 1;             // each tile's context [0, its last row's) in splits of split_len tokens
  int32_t split_len = 0;
  int64_t tiles() const { return static_cast<int64_t>(first.size()); }
  int64_t warps(int64_t kv_heads) const { return tiles() * kv_heads * splits; }
};

ChunkTilePlan PlanChunkTiles(const std::vector<int64_t>& positions, const std::vector<int32_t>& ctx_len,
                             const std::vector<const std::vector<int>*>& tables, int64_t tile_rows,
                             int64_t kv_heads, int64_t target_warps, int64_t max_warps,
                             int64_t min_context = kChunkMinContext, int64_t min_split = kChunkMinSplit);

}  // namespace loom::engine
