// DecodeAttention (engine/sample/cuda/attention.h) against ATen: one query
// per row over its paged context (blocks scattered over the pools,
// grouped-query heads), softmax in fp32, fp32 and bf16, head_dim 64 and 128,
// in both forms (kDims; kTokens where it applies: bf16, head_dim 128, many
// rows, each of its head groupings).
#include <gtest/gtest.h>

#if LOOM_CUDA_KERNELS
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/sample/cuda/attention.h"
#include "kernel_check.h"

namespace loom::engine {
namespace {

using namespace kernel_check;

constexpr int64_t kBlock = 16;

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

  std::vector<at::Tensor> want;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int64_t> kv_rows;
    for (int64_t p = 0; p < sh.ctx[static_cast<size_t>(r)]; ++p)
      kv_rows.push_back(table[static_cast<size_t>(r * width + p / kBlock)] * kBlock + p % kBlock);
    const at::Tensor idx = at::tensor(kv_rows, On(at::kLong));
    // [KVH, n, hd] -> one copy per query head of its group: [H, n, hd].
    const int64_t group = sh.heads / sh.kv_heads;
    const at::Tensor k = k_pool.index_select(0, idx).to(at::kFloat).transpose(0, 1).repeat_interleave(group, 0);
    const at::Tensor v = v_pool.index_select(0, idx).to(at::kFloat).transpose(0, 1).repeat_interleave(group, 0);
    const at::Tensor qr = q.select(0, r).to(at::kFloat).unsqueeze(1);  // [H, 1, hd]
    const at::Tensor p = at::softmax(at::matmul(qr, k.transpose(1, 2)) / std::sqrt(static_cast<double>(sh.hd)), -1);
    want.push_back(at::matmul(p, v).reshape({sh.heads * sh.hd}));
  }
  const std::string what = std::string(t == at::kBFloat16 ? "bf16" : "fp32") + " hd=" + std::to_string(sh.hd) +
                           " rows=" + std::to_string(rows) +
                           (form == cuda::AttentionForm::kTokens ? " tokens" : " dims");
  ExpectClose(out, Round(at::stack(want), t), Rtol(t), Atol(t), what);
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

}  // namespace
}  // namespace loom::engine
#else
TEST(DecodeAttentionKernel, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA kernels"; }
#endif
