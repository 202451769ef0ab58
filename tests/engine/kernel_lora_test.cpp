// LoraShrink and LoraExpand (engine/sample/cuda/lora.h) against ATen, rows
// of several adapters and the base mixed in two row tiles: the shrink on
// CUDA cores (fp32; bf16 with d_in not a multiple of 32) and on tensor
// cores (bf16), split over blocks or not; the expand in place, into a
// delta buffer and into fp32 logits, on CUDA cores (any rank) and tensor
// cores (bf16, rank 16).
#include <gtest/gtest.h>

#if LOOM_CUDA_KERNELS
#include <vector>

#include "engine/sample/cuda/lora.h"
#include "kernel_check.h"

namespace loom::engine {
namespace {

using namespace kernel_check;

const std::vector<int32_t> kSlots = {-1, 0, 0, 1, 1, 1, -1, 2, 0, 2};  // 10 rows: two tiles of 8
constexpr int64_t kNumSlots = 3;
const std::vector<float> kScales = {0.5f, 2.0f, 1.0f};

int64_t Rows() { return static_cast<int64_t>(kSlots.size()); }

// t[r] = scale[s] * A[s] x[r] for s = slot[r] >= 0, else 0.
at::Tensor ShrinkRef(const at::Tensor& x, const at::Tensor& A, int64_t r_total) {
  std::vector<at::Tensor> rows;
  for (int64_t r = 0; r < Rows(); ++r) {
    const int s = kSlots[static_cast<size_t>(r)];
    rows.push_back(s < 0 ? at::zeros({r_total}, On(at::kFloat))
                         : at::matmul(A.select(0, s).to(at::kFloat), x.select(0, r).to(at::kFloat)) *
                               kScales[static_cast<size_t>(s)]);
  }
  return at::stack(rows);
}

// split: hand the kernel scratch for a split d_in; returns its blocks per tile.
int Shrink(at::ScalarType t, int64_t d_in, bool split) {
  at::manual_seed(23);
  const int64_t rows = Rows(), r_total = 24;
  const at::Tensor x = Randn({rows, d_in}, t), A = Randn({kNumSlots, r_total, d_in}, t, 0.02);
  const at::Tensor slot = at::tensor(kSlots, On(at::kInt)), scale = at::tensor(kScales, On(at::kFloat));
  at::Tensor out = at::full({rows, r_total}, 7.0, On(at::kFloat));  // every cell is written
  at::Tensor part = at::zeros({rows * r_total * 8}, On(at::kFloat));
  at::Tensor tickets = at::zeros({((rows + 7) / 8) * ((r_total + 15) / 16)}, On(at::kInt));
  const cuda::ShrinkScratch scratch{part.data_ptr<float>(), part.numel(), tickets.data_ptr<int32_t>(), tickets.numel()};
  const int parts = cuda::LoraShrink(t == at::kBFloat16, x.data_ptr(), x.stride(0), A.data_ptr(),
                                     slot.data_ptr<int32_t>(), scale.data_ptr<float>(), out.data_ptr<float>(), rows,
                                     d_in, r_total, Stream(), split ? &scratch : nullptr);
  const std::string what = std::string(t == at::kBFloat16 ? "bf16" : "fp32") + " d_in=" + std::to_string(d_in) +
                           (split ? " split" : "");
  ExpectClose(out, ShrinkRef(x, A, r_total), 1e-4, 1e-4, what);
  EXPECT_EQ(tickets.sum().item<int64_t>(), 0) << what << ": the split's tickets are left 0";
  return parts;
}

TEST(LoraShrinkKernel, MatchesATenOnCudaCoresAndTensorCores) {
  LOOM_SKIP_WITHOUT_CUDA();
  EXPECT_EQ(Shrink(at::kFloat, 896, false), 1);
  EXPECT_EQ(Shrink(at::kFloat, 4864, false), 1);  // split over warps inside a block, not over blocks
  EXPECT_EQ(Shrink(at::kFloat, 898, false), 1);   // rows not 16-byte vectors: element by element
  EXPECT_EQ(Shrink(at::kBFloat16, 904, false), 1);  // d_in not a multiple of 32: CUDA cores
  EXPECT_EQ(Shrink(at::kBFloat16, 896, true), 1);   // tensor cores, too short to split
  EXPECT_EQ(Shrink(at::kBFloat16, 4864, false), 1);
  EXPECT_GT(Shrink(at::kBFloat16, 4864, true), 1);  // tensor cores, split over blocks
}

struct ExpandCase {
  at::ScalarType t;
  int64_t rank;
  std::vector<int64_t> widths;  // output width of each segment (target)
};

// delta[r, c] = B[s, c] . t[r, seg(c) * rank :+ rank] for s = slot[r] >= 0, else 0.
at::Tensor DeltaRef(const at::Tensor& B, const at::Tensor& t, const ExpandCase& c) {
  std::vector<at::Tensor> rows;
  for (int64_t r = 0; r < Rows(); ++r) {
    const int s = kSlots[static_cast<size_t>(r)];
    std::vector<at::Tensor> segs;
    int64_t col = 0;
    for (size_t k = 0; k < c.widths.size(); ++k) {
      const at::Tensor b = B.select(0, s < 0 ? 0 : s).narrow(0, col, c.widths[k]).to(at::kFloat);
      const at::Tensor tk = t.select(0, r).narrow(0, static_cast<int64_t>(k) * c.rank, c.rank);
      segs.push_back(s < 0 ? at::zeros({c.widths[k]}, On(at::kFloat)) : at::matmul(b, tk));
      col += c.widths[k];
    }
    rows.push_back(at::cat(segs));
  }
  return at::stack(rows);
}

void Expand(const ExpandCase& c) {
  at::manual_seed(29);
  const int64_t rows = Rows(), r_total = c.rank * static_cast<int64_t>(c.widths.size());
  int64_t d_total = 0;
  cuda::LoraArgs args;
  for (size_t k = 0; k < c.widths.size(); ++k) args.seg_end[k] = d_total += c.widths[k];
  const at::Tensor B = Randn({kNumSlots, d_total, c.rank}, c.t, 0.1), t = Randn({rows, r_total}, at::kFloat);
  const at::Tensor slot = at::tensor(kSlots, On(at::kInt)), y = Randn({rows, d_total}, c.t);
  args.B = B.data_ptr();
  args.t = t.data_ptr<float>();
  args.slot = slot.data_ptr<int32_t>();
  args.rank = c.rank;
  args.r_total = r_total;
  args.d_total = d_total;
  const bool bf16 = c.t == at::kBFloat16;
  const at::Tensor delta = DeltaRef(B, t, c), yf = y.to(at::kFloat);
  const at::Tensor adapter = (slot >= 0).unsqueeze(1);
  const std::string what = std::string(bf16 ? "bf16" : "fp32") + " rank=" + std::to_string(c.rank);
  // The delta's own error: fp32 sums in another order, or (tensor cores) t
  // carried as two bf16 terms.
  const double rtol = bf16 ? Rtol(c.t) : 1e-4, atol = bf16 ? Atol(c.t) : 1e-4, f32_rtol = bf16 ? 1e-3 : 1e-4;

  at::Tensor in_place = y.clone();  // rows with an adapter get y + T(delta), rounded; base rows stay
  cuda::LoraExpand(bf16, args, in_place.data_ptr(), in_place.data_ptr(), false, d_total, rows, Stream());
  ExpectClose(in_place, at::where(adapter, AddDelta(yf, delta, c.t), yf), rtol, atol, what + ": in place");

  at::Tensor only = at::full({rows, d_total}, 7.0, On(c.t));  // y null: T(delta), 0 for base rows
  cuda::LoraExpand(bf16, args, nullptr, only.data_ptr(), false, d_total, rows, Stream());
  ExpectClose(only, Round(delta, c.t), rtol, atol, what + ": delta only");

  at::Tensor logits = at::full({rows, d_total}, 7.0, On(at::kFloat));  // fp32 y + delta, unrounded
  cuda::LoraExpand(bf16, args, y.data_ptr(), logits.data_ptr(), true, d_total, rows, Stream());
  ExpectClose(logits, yf + delta, f32_rtol, 1e-3, what + ": fp32");
}

TEST(LoraExpandKernel, MatchesATenOnCudaCoresAndTensorCores) {
  LOOM_SKIP_WITHOUT_CUDA();
  Expand({at::kFloat, 8, {64, 32, 32}});     // a rank held in registers
  Expand({at::kFloat, 5, {40, 24}});         // any rank, element by element
  Expand({at::kBFloat16, 8, {64, 32, 32}});  // bf16 on CUDA cores
  Expand({at::kBFloat16, 16, {64, 32, 32}});  // tensor cores
}

}  // namespace
}  // namespace loom::engine
#else
TEST(LoraShrinkKernel, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA kernels"; }
TEST(LoraExpandKernel, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA kernels"; }
#endif
