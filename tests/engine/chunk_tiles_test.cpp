// PlanChunkTiles (engine/sample/chunk_tiles.h): which rows of a decode-graph
// step attend together, and how their contexts split.
#include "engine/sample/chunk_tiles.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace loom::engine {
namespace {

// A step's rows: per row its position and block table (context = position + 1).
struct Rows {
  std::vector<int64_t> positions;
  std::vector<int32_t> ctx;
  std::vector<const std::vector<int>*> tables;
  void Add(const std::vector<int>* table, int64_t from, int64_t n) {
    for (int64_t p = from; p < from + n; ++p) {
      positions.push_back(p);
      ctx.push_back(static_cast<int32_t>(p + 1));
      tables.push_back(table);
    }
  }
};

TEST(ChunkTiles, RunsOfOneSequenceBecomeTilesAndDecodeRowsStayAlone) {
  const std::vector<int> a(8), b(8), c(8), d(8);
  Rows r;
  r.Add(&a, 40, 1);   // row 0: a decode row
  r.Add(&b, 0, 9);    // rows 1-9: a fresh prompt's chunk
  r.Add(&c, 100, 1);  // row 10: a decode row
  r.Add(&d, 60, 5);   // rows 11-15: a chunk over a cached prefix
  r.Add(&d, 70, 2);   // rows 16-17: the same table, but positions jump: a run of its own
  const ChunkTilePlan p = PlanChunkTiles(r.positions, r.ctx, r.tables, 4, 8, 1, 2048, 0, 16);
  EXPECT_EQ(p.first, (std::vector<int32_t>{1, 5, 9, 11, 15, 16}));
  EXPECT_EQ(p.rows, (std::vector<int32_t>{4, 4, 1, 4, 1, 2}));
  EXPECT_EQ(p.row_tile, (std::vector<int32_t>{-1, 0, 0, 0, 0, 1, 1, 1, 1, 2, -1, 3, 3, 3, 3, 4, 5, 5}));
  EXPECT_EQ(p.splits, 1);  // a target of one warp: no split
  EXPECT_EQ(p.split_len, 80);  // the longest tile context (72) in whole steps of 16
}

TEST(ChunkTiles, ContextsSplitToReachTheTargetWithinTheCap) {
  const std::vector<int> a(400);
  Rows r;
  r.Add(&a, 4000, 8);  // an 8-token turn over 4,000 tokens of history: 2 tiles of 4
  ChunkTilePlan p = PlanChunkTiles(r.positions, r.ctx, r.tables, 4, 8, 528, 2048, 0, 16);
  ASSERT_EQ(p.tiles(), 2);
  // 16 unsplit warps; 528 wanted: 33 splits of whole 16-token steps over 4,008 tokens (251 steps: 8 each)
  EXPECT_EQ(p.split_len, 128);
  EXPECT_EQ(p.splits, 32);  // 251 steps in splits of 8: 32 (none left empty by the rounding)
  EXPECT_GE(static_cast<int64_t>(p.splits) * p.split_len, 4008);
  EXPECT_LT(static_cast<int64_t>(p.splits - 1) * p.split_len, 4008);
  EXPECT_LE(p.warps(8), 2048);
  // The cap wins over the target.
  p = PlanChunkTiles(r.positions, r.ctx, r.tables, 4, 8, 528, 64, 0, 16);
  EXPECT_LE(p.warps(8), 64);
  EXPECT_EQ(p.splits, 4);
  // No split is shorter than a step: a short context stays whole.
  Rows s;
  s.Add(&a, 0, 8);
  p = PlanChunkTiles(s.positions, s.ctx, s.tables, 4, 8, 528, 2048, 0, 16);
  EXPECT_EQ(p.splits, 1);
  EXPECT_EQ(p.split_len, 16);
}

TEST(ChunkTiles, NoTileWithoutARunOrBeyondTheCap) {
  const std::vector<int> a(8), b(8);
  Rows r;
  r.Add(&a, 10, 1);
  r.Add(&b, 10, 1);  // the same position, another table: decode rows of two sequences
  ChunkTilePlan p = PlanChunkTiles(r.positions, r.ctx, r.tables, 4, 8, 528, 2048, 0, 16);
  EXPECT_EQ(p.tiles(), 0);
  EXPECT_EQ(p.row_tile, (std::vector<int32_t>{-1, -1}));
  Rows big;
  big.Add(&a, 0, 64);  // 16 tiles x 8 K/V heads = 128 warps unsplit
  p = PlanChunkTiles(big.positions, big.ctx, big.tables, 4, 8, 528, 100, 0, 16);
  EXPECT_EQ(p.tiles(), 0);
  EXPECT_EQ(p.row_tile, std::vector<int32_t>(64, -1));
}

// The decode graphs' defaults: a run is tiled only over kChunkMinContext
// tokens of context or more, and no split is shorter than kChunkMinSplit.
TEST(ChunkTiles, ShortContextsStayRowByRowAndSplitsAreLong) {
  const std::vector<int> a(400), b(400);
  Rows r;
  r.Add(&a, 0, 32);     // a fresh 32-token prompt: rows 0-31
  r.Add(&b, 900, 100);  // 100 rows over 901-1,000 tokens: its last row's context is 1,000
  ChunkTilePlan p = PlanChunkTiles(r.positions, r.ctx, r.tables, 4, 8, 528, 2048);
  EXPECT_EQ(p.tiles(), 0);
  Rows t;
  t.Add(&a, 0, 32);
  t.Add(&b, 4000, 8);  // an 8-token turn over 4,000 tokens of history
  p = PlanChunkTiles(t.positions, t.ctx, t.tables, 4, 8, 528, 2048);
  ASSERT_EQ(p.tiles(), 2);
  EXPECT_EQ(p.first, (std::vector<int32_t>{32, 36}));
  EXPECT_EQ(std::count(p.row_tile.begin(), p.row_tile.begin() + 32, -1), 32);
  // 251 steps over 4,008 tokens, at least 16 a split: 15 splits of 17 steps (272 tokens).
  EXPECT_EQ(p.splits, 15);
  EXPECT_EQ(p.split_len, 272);
  EXPECT_GE(p.split_len, kChunkMinSplit);
}

}  // namespace
}  // namespace loom::engine
