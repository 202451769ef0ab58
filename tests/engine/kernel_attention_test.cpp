// DecodeAttention (engine/sample/cuda/attention.h) against ATen: one query
// per row over its paged context (blocks scattered over the pools,
// grouped-query heads), softmax in fp32, fp32 and bf16, head_dim 64 and 128.
#include <gtest/gtest.h>

#if LOOM_CUDA_KERNELS
#include <cmath>
#include <vector>

#include "engine/sample/cuda/attention.h"
#include "kernel_check.h"

namespace loom::engine {
namespace {

using namespace kernel_check;

constexpr int64_t kHeads = 4, kKvHeads = 2, kBlock = 16, kBlocks = 12, kTableWidth = 4;

void Check(at::ScalarType t, int64_t hd) {
  at::manual_seed(13);
  const std::vector<int32_t> ctx = {1, 17, 40, 64};
  const int64_t rows = static_cast<int64_t>(ctx.size());
  // Row r uses blocks table[r][0..): a permutation, so no row's blocks are adjacent.
  const std::vector<int32_t> perm = {7, 2, 11, 0, 5, 9, 3, 10, 1, 8, 6, 4, 7, 2, 11, 0};
  std::vector<int32_t> table(static_cast<size_t>(rows * kTableWidth));
  for (size_t i = 0; i < table.size(); ++i) table[i] = perm[i];
  const at::Tensor q = Randn({rows, kHeads, hd}, t);
  const at::Tensor k_pool = Randn({kBlocks * kBlock, kKvHeads, hd}, t), v_pool = Randn({kBlocks * kBlock, kKvHeads, hd}, t);
  const at::Tensor table_dev = at::tensor(table, On(at::kInt)), ctx_dev = at::tensor(ctx, On(at::kInt));
  at::Tensor out = at::zeros({rows, kHeads * hd}, On(t));
  cuda::DecodeAttention(t == at::kBFloat16, q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                        table_dev.data_ptr<int32_t>(), kTableWidth, ctx_dev.data_ptr<int32_t>(), kBlock,
                        out.data_ptr(), rows, kHeads, kKvHeads, hd, Stream());

  std::vector<at::Tensor> want;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int64_t> kv_rows;
    for (int64_t p = 0; p < ctx[static_cast<size_t>(r)]; ++p)
      kv_rows.push_back(table[static_cast<size_t>(r * kTableWidth + p / kBlock)] * kBlock + p % kBlock);
    const at::Tensor idx = at::tensor(kv_rows, On(at::kLong));
    // [KVH, n, hd] -> one copy per query head of its group: [H, n, hd].
    const at::Tensor k = k_pool.index_select(0, idx).to(at::kFloat).transpose(0, 1).repeat_interleave(kHeads / kKvHeads, 0);
    const at::Tensor v = v_pool.index_select(0, idx).to(at::kFloat).transpose(0, 1).repeat_interleave(kHeads / kKvHeads, 0);
    const at::Tensor qr = q.select(0, r).to(at::kFloat).unsqueeze(1);  // [H, 1, hd]
    const at::Tensor p = at::softmax(at::matmul(qr, k.transpose(1, 2)) / std::sqrt(static_cast<double>(hd)), -1);
    want.push_back(at::matmul(p, v).reshape({kHeads * hd}));
  }
  const std::string what = std::string(t == at::kBFloat16 ? "bf16" : "fp32") + " hd=" + std::to_string(hd);
  ExpectClose(out, Round(at::stack(want), t), Rtol(t), Atol(t), what);
}

TEST(DecodeAttentionKernel, MatchesATenOverPagedContexts) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (at::ScalarType t : {at::kFloat, at::kBFloat16})
    for (int64_t hd : {64, 128}) Check(t, hd);
}

}  // namespace
}  // namespace loom::engine
#else
TEST(DecodeAttentionKernel, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA kernels"; }
#endif
