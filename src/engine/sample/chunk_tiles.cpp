#include "engine/sample/chunk_tiles.h"

#include <algorithm>

namespace loom::engine {

ChunkTilePlan PlanChunkTiles(const std::vector<int64_t>& positions, const std::vector<int32_t>& ctx_len,
                             const std::vector<const std::vector<int>*>& tables, int64_t tile_rows,
                             int64_t kv_heads, int64_t target_warps, int64_t max_warps, int64_t min_context,
                             int64_t min_split) {
  ChunkTilePlan plan;
  const int64_t n = static_cast<int64_t>(positions.size());
  plan.row_tile.assign(static_cast<size_t>(n), -1);
  if (tile_rows < 1 || kv_heads < 1) return plan;
  const auto continues = [&](int64_t i) {
    return tables[i] == tables[i - 1] && positions[i] == positions[i - 1] + 1 && ctx_len[i] == ctx_len[i - 1] + 1;
  };
  int32_t longest = 0;
  for (int64_t b = 0; b < n;) {
    int64_t e = b + 1;
    while (e < n && continues(e)) ++e;
    if (e - b >= 2 && ctx_len[e - 1] >= min_context) {
      for (int64_t t = b; t < e; t += tile_rows) {
        const int64_t rows = std::min(tile_rows, e - t);
        for (int64_t r = t; r < t + rows; ++r) plan.row_tile[r] = static_cast<int32_t>(plan.first.size());
        plan.first.push_back(static_cast<int32_t>(t));
        plan.rows.push_back(static_cast<int32_t>(rows));
        longest = std::max(longest, ctx_len[t + rows - 1]);
      }
    }
    b = e;
  }
  const int64_t unsplit = plan.tiles() * kv_heads;
  if (unsplit == 0 || unsplit > max_warps) {
    ChunkTilePlan none;
    none.row_tile.assign(static_cast<size_t>(n), -1);
    return none;
  }
  // Splits: enough warps, no more than max_warps, each split of whole steps, none shorter than min_split.
  const int64_t steps = (longest + kChunkSplitAlign - 1) / kChunkSplitAlign;
  const int64_t min_steps = std::max<int64_t>(1, (min_split + kChunkSplitAlign - 1) / kChunkSplitAlign);
  int64_t splits = std::min({(target_warps + unsplit - 1) / unsplit, max_warps / unsplit, steps / min_steps});
  splits = std::max<int64_t>(splits, 1);
  const int64_t per = (steps + splits - 1) / splits;  // steps per split
  plan.split_len = static_cast<int32_t>(per * kChunkSplitAlign);
  plan.splits = static_cast<int32_t>((steps + per - 1) / per);  // no split left empty by the rounding
  return plan;
}

}  // namespace loom::engine
