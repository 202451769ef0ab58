// DecodeAttention (engine/sample/cuda/attention.h) against ATen: one query
// per row over its paged context (blocks scattered over the pools,
// grouped-query heads), softmax in fp32, fp32 and bf16, head_dim 64 and 128,
// in both forms (kDims; kTokens where it applies: bf16, head_dim 128, many
// rows, each of its head groupings). ChunkAttention (bf16) on the rows of
// prefill chunks, tiled by PlanChunkTiles, beside DecodeAttention on the
// others, against the same reference.
#include <gtest/gtest.h>

#if LOOM_CUDA_KERNELS
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/sample/chunk_tiles.h"
#include "engine/sample/cuda/attention.h"
#include "kernel_check.h"

namespace loom::engine {
namespace {

using namespace kernel_check;

constexpr int64_t kBlock = 16;

// What the kernels compute, in fp32 ATen: row r's query over its context
// [0, ctx[r]), read through its row of table (width blocks a row); [rows, heads * hd].
at::Tensor Reference(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const std::vector<int32_t>& table, int64_t width, const std::vector<int32_t>& ctx,
                     int64_t heads, int64_t kv_heads, int64_t hd) {
  std::vector<at::Tensor> want;
  for (int64_t r = 0; r < static_cast<int64_t>(ctx.size()); ++r) {
    std::vector<int64_t> kv_rows;
    for (int64_t p = 0; p < ctx[static_cast<size_t>(r)]; ++p)
      kv_rows.push_back(table[static_cast<size_t>(r * width + p / kBlock)] * kBlock + p % kBlock);
    const at::Tensor idx = at::tensor(kv_rows, On(at::kLong));
    // [KVH, n, hd] -> one copy per query head of its group: [H, n, hd].
    const int64_t group = heads / kv_heads;
    const at::Tensor k = k_pool.index_select(0, idx).to(at::kFloat).transpose(0, 1).repeat_interleave(group, 0);
    const at::Tensor v = v_pool.index_select(0, idx).to(at::kFloat).transpose(0, 1).repeat_interleave(group, 0);
    const at::Tensor qr = q.select(0, r).to(at::kFloat).unsqueeze(1);  // [H, 1, hd]
    const at::Tensor p = at::softmax(at::matmul(qr, k.transpose(1, 2)) / std::sqrt(static_cast<double>(hd)), -1);
    want.push_back(at::matmul(p, v).reshape({heads * hd}));
  }
  return at::stack(want);
}

struct Shape {
  int64_t heads, kv_heads, hd;
  std::vector<int32_t> ctx;  // per row
};

void Check(at::ScalarType t, const Shape& sh, cuda::AttentionForm form) {
  at::manual_seed(13);
  const int64_t rows = static_cast<int64_t>(sh.ctx.size());
  int64_t width = 1;
  for (int32_t c : sh.ctx) width = std::max<int64_t>(width, (c + kBlock - 1) / kBlock);
  // Row r's blocks: a stride through the pool, so no row's blocks are adjacent
  // and rows share some (as prefix-cached prompts do).
  const int64_t pool_blocks = 2 * width + 3;
  std::vector<int32_t> table(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < width; ++b)
      table[static_cast<size_t>(r * width + b)] = static_cast<int32_t>((r * 5 + b * 7) % pool_blocks);
  const at::Tensor q = Randn({rows, sh.heads, sh.hd}, t);
  const at::Tensor k_pool = Randn({pool_blocks * kBlock, sh.kv_heads, sh.hd}, t);
  const at::Tensor v_pool = Randn({pool_blocks * kBlock, sh.kv_heads, sh.hd}, t);
  const at::Tensor table_dev = at::tensor(table, On(at::kInt)), ctx_dev = at::tensor(sh.ctx, On(at::kInt));
  at::Tensor out = at::zeros({rows, sh.heads * sh.hd}, On(t));
  cuda::DecodeAttention(t == at::kBFloat16, q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                        table_dev.data_ptr<int32_t>(), width, ctx_dev.data_ptr<int32_t>(), kBlock, out.data_ptr(), rows,
                        sh.heads, sh.kv_heads, sh.hd, Stream(), form);

  const at::Tensor want = Reference(q, k_pool, v_pool, table, width, sh.ctx, sh.heads, sh.kv_heads, sh.hd);
  const std::string what = std::string(t == at::kBFloat16 ? "bf16" : "fp32") + " hd=" + std::to_string(sh.hd) +
                           " rows=" + std::to_string(rows) +
                           (form == cuda::AttentionForm::kTokens ? " tokens" : " dims");
  ExpectClose(out, Round(want, t), Rtol(t), Atol(t), what);
}

TEST(DecodeAttentionKernel, MatchesATenOverPagedContexts) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (at::ScalarType t : {at::kFloat, at::kBFloat16})
    for (int64_t hd : {64, 128})
      for (auto form : {cuda::AttentionForm::kDims, cuda::AttentionForm::kTokens})
        Check(t, Shape{4, 2, hd, {1, 17, 40, 64}}, form);  // few rows: kTokens runs as kDims
}

// qwen3-4b's heads (32 query, 8 K/V, head_dim 128) at row counts that take
// each head grouping of the token form (1, 2 and 4 heads a block), contexts
// from 1 token (a half warp with no token) past a step's 32 tokens a warp.
TEST(DecodeAttentionKernel, TheTokenFormMatchesATenAtManyRows) {
  LOOM_SKIP_WITHOUT_CUDA();
  const std::vector<int32_t> lengths = {1, 2, 3, 16, 17, 33, 100, 255, 300};
  for (int64_t rows : {12, 20, 40}) {
    ASSERT_TRUE(cuda::TokenLanesApply(true, rows, 32, 8, 128)) << rows;
    Shape sh{32, 8, 128, {}};
    for (int64_t r = 0; r < rows; ++r) sh.ctx.push_back(lengths[static_cast<size_t>(r) % lengths.size()]);
    for (auto form : {cuda::AttentionForm::kTokens, cuda::AttentionForm::kDims}) Check(at::kBFloat16, sh, form);
  }
  EXPECT_FALSE(cuda::TokenLanesApply(true, 4, 32, 8, 128));  // a few rows: too few blocks
  EXPECT_FALSE(cuda::TokenLanesApply(false, 40, 32, 8, 128));  // fp32
  EXPECT_FALSE(cuda::TokenLanesApply(true, 40, 32, 8, 64));  // head_dim 64
}

// A step as the decode graphs see one with prefill chunks: runs of rows of
// one sequence at consecutive positions (the chunk's new tokens) over one
// block table, beside single rows (decode rows). Each run is `runs[k]`
// rows starting at context `starts[k]` + 1.
struct ChunkStep {
  int64_t heads, kv_heads, hd;
  std::vector<int64_t> runs, starts;
  int64_t target_warps;  // PlanChunkTiles' (small: one split; large: many)
};

void CheckChunks(const ChunkStep& cs) {
  at::manual_seed(29);
  const at::ScalarType t = at::kBFloat16;
  std::vector<int64_t> positions;
  std::vector<int32_t> ctx;
  std::vector<std::vector<int>> seq_tables;
  std::vector<size_t> row_seq;
  int64_t width = 1;
  for (size_t k = 0; k < cs.runs.size(); ++k) {
    for (int64_t i = 0; i < cs.runs[k]; ++i) {
      positions.push_back(cs.starts[k] + i);
      ctx.push_back(static_cast<int32_t>(cs.starts[k] + i + 1));
      row_seq.push_back(k);
    }
    width = std::max<int64_t>(width, (cs.starts[k] + cs.runs[k] + kBlock - 1) / kBlock);
  }
  const int64_t rows = static_cast<int64_t>(positions.size());
  const int64_t pool_blocks = 3 * width + 5;
  for (size_t k = 0; k < cs.runs.size(); ++k) {  // scattered, some blocks shared between sequences
    std::vector<int> tab(static_cast<size_t>(width));
    for (int64_t b = 0; b < width; ++b) tab[static_cast<size_t>(b)] = static_cast<int>((k * 7 + b * 11) % pool_blocks);
    seq_tables.push_back(tab);
  }
  std::vector<const std::vector<int>*> tables;
  std::vector<int32_t> table;
  for (int64_t r = 0; r < rows; ++r) {
    tables.push_back(&seq_tables[row_seq[static_cast<size_t>(r)]]);
    for (int b : *tables.back()) table.push_back(b);
  }
  const ChunkTilePlan plan = PlanChunkTiles(positions, ctx, tables, cuda::ChunkTileRows(cs.heads, cs.kv_heads),
                                            cs.kv_heads, cs.target_warps, cuda::kChunkMaxWarps, 0, kChunkSplitAlign);
  ASSERT_GT(plan.tiles(), 0);
  std::vector<int32_t> single(ctx), plan_ints = {static_cast<int32_t>(plan.tiles()), plan.splits, plan.split_len};
  for (int64_t r = 0; r < rows; ++r)
    if (plan.row_tile[static_cast<size_t>(r)] >= 0) single[static_cast<size_t>(r)] = 0;
  for (int64_t k = 0; k < rows; ++k) plan_ints.push_back(k < plan.tiles() ? plan.first[static_cast<size_t>(k)] : 0);
  for (int64_t k = 0; k < rows; ++k) plan_ints.push_back(k < plan.tiles() ? plan.rows[static_cast<size_t>(k)] : 0);

  const at::Tensor q = Randn({rows, cs.heads, cs.hd}, t);
  const at::Tensor k_pool = Randn({pool_blocks * kBlock, cs.kv_heads, cs.hd}, t);
  const at::Tensor v_pool = Randn({pool_blocks * kBlock, cs.kv_heads, cs.hd}, t);
  const at::Tensor table_dev = at::tensor(table, On(at::kInt)), ctx_dev = at::tensor(ctx, On(at::kInt));
  const at::Tensor single_dev = at::tensor(single, On(at::kInt)), plan_dev = at::tensor(plan_ints, On(at::kInt));
  const at::Tensor row_tile_dev = at::tensor(plan.row_tile, On(at::kInt));
  const at::Tensor scratch = at::empty({cuda::ChunkScratchFloats(cs.hd)}, On(at::kFloat));
  at::Tensor out = at::full({rows, cs.heads * cs.hd}, std::nan(""), On(t));  // every row must be written
  cuda::DecodeAttention(true, q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table_dev.data_ptr<int32_t>(),
                        width, single_dev.data_ptr<int32_t>(), kBlock, out.data_ptr(), rows, cs.heads, cs.kv_heads,
                        cs.hd, Stream(), cuda::AttentionForm::kTokens);
  cuda::ChunkAttention(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table_dev.data_ptr<int32_t>(), width,
                       ctx_dev.data_ptr<int32_t>(), plan_dev.data_ptr<int32_t>(), rows,
                       row_tile_dev.data_ptr<int32_t>(), kBlock, out.data_ptr(), scratch.data_ptr<float>(), rows,
                       cs.heads, cs.kv_heads, cs.hd, Stream());

  const at::Tensor want = Reference(q, k_pool, v_pool, table, width, ctx, cs.heads, cs.kv_heads, cs.hd);
  const std::string what = "heads " + std::to_string(cs.heads) + "/" + std::to_string(cs.kv_heads) +
                           " hd=" + std::to_string(cs.hd) + " rows=" + std::to_string(rows) + " tiles=" +
                           std::to_string(plan.tiles()) + " splits=" + std::to_string(plan.splits);
  std::printf("chunk attention %s\n", what.c_str());
  ExpectClose(out, Round(want, t), Rtol(t), Atol(t), what);
}

// Runs of 1 (decode rows), 2, 7 and 37 rows, from contexts 0 to 300 (a
// chunk at a prompt's start and over a cached prefix), the last tile of a
// run partial; the contexts in one split and in many (splits past a short
// tile's context are empty).
TEST(DecodeAttentionKernel, ChunkTilesMatchATen) {
  LOOM_SKIP_WITHOUT_CUDA();
  const std::vector<int64_t> runs = {1, 7, 1, 37, 2, 1, 20};
  const std::vector<int64_t> starts = {40, 0, 5, 300, 17, 250, 130};
  for (int64_t target : {int64_t{1}, int64_t{4096}}) {
    CheckChunks({32, 8, 128, runs, starts, target});  // qwen3-4b: tiles of 4 rows
    CheckChunks({8, 2, 32, runs, starts, target});    // the small preset
    CheckChunks({8, 4, 64, runs, starts, target});    // group 2: tiles of 8 rows
    CheckChunks({4, 4, 128, runs, starts, target});   // no grouping: tiles of 16 rows
  }
  EXPECT_TRUE(cuda::ChunkAttentionApplies(true, 32, 8, 128));
  EXPECT_FALSE(cuda::ChunkAttentionApplies(false, 32, 8, 128));  // fp32
  EXPECT_FALSE(cuda::ChunkAttentionApplies(true, 14, 2, 64));    // qwen2.5-0.5b: a group of 7
  EXPECT_FALSE(cuda::ChunkAttentionApplies(true, 32, 8, 256));
}

}  // namespace
}  // namespace loom::engine
#else
TEST(DecodeAttentionKernel, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA kernels"; }
#endif
