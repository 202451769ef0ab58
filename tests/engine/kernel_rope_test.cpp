// QkNormRopeWrite (engine/sample/cuda/rope.h) against ATen: q and k heads
// (with qwen3's per-head norm or without) rotated at each row's position,
// q to q_out, k and v into the pools' write rows, with and without the
// projection's LoRA delta, with YaRN's scale on cos and sin and without,
// fp32 and bf16.
#include <gtest/gtest.h>

#if LOOM_CUDA_KERNELS
#include "engine/sample/cuda/rope.h"
#include "kernel_check.h"

namespace loom::engine {
namespace {

using namespace kernel_check;

constexpr float kEps = 1e-6f;
constexpr int64_t kHeads = 4, kKvHeads = 2, kPoolRows = 16;

// rotate_half(v) * sin + v * cos, each product rounded to T as eager RoPE does.
at::Tensor Rope(const at::Tensor& v, const at::Tensor& cs, const at::Tensor& sn, at::ScalarType t) {
  const int64_t half = v.size(-1) / 2;
  const at::Tensor rot = at::cat({-v.narrow(-1, half, half), v.narrow(-1, 0, half)}, -1);
  return Round(Round(v * cs, t) + Round(rot * sn, t), t);
}

at::Tensor HeadNorm(const at::Tensor& v, const at::Tensor& w, at::ScalarType t) {
  const at::Tensor inv = at::rsqrt(v.pow(2).mean({-1}, /*keepdim=*/true) + kEps);
  return Round(w.to(at::kFloat) * Round(v * inv, t), t);
}

void Check(at::ScalarType t, int64_t hd, bool norms, bool delta, float scale = 1.0f) {
  at::manual_seed(11);
  const int64_t rows = 3, width = (kHeads + 2 * kKvHeads) * hd;
  const at::Tensor qkv = Randn({rows, width}, t), d = Randn({rows, width}, t, 0.1);
  const at::Tensor qn = Randn({hd}, t), kn = Randn({hd}, t);
  const at::Tensor positions = at::tensor(std::vector<int64_t>{0, 7, 100}, On(at::kLong));
  const at::Tensor write_rows = at::tensor(std::vector<int64_t>{5, 0, 9}, On(at::kLong));
  const at::Tensor inv_freq = at::pow(10000.0, at::arange(0, hd, 2, On(at::kFloat)) / static_cast<double>(hd)).reciprocal();
  at::Tensor q_out = at::zeros({rows, kHeads, hd}, On(t));
  at::Tensor k_pool = at::zeros({kPoolRows, kKvHeads, hd}, On(t)), v_pool = at::zeros_like(k_pool);
  cuda::QkNormRopeWrite(t == at::kBFloat16, qkv.data_ptr(), delta ? d.data_ptr() : nullptr,
                        norms ? qn.data_ptr() : nullptr, norms ? kn.data_ptr() : nullptr,
                        positions.data_ptr<int64_t>(), inv_freq.data_ptr<float>(), scale,
                        write_rows.data_ptr<int64_t>(), q_out.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), rows,
                        kHeads, kKvHeads, hd, kEps, Stream());

  const at::Tensor all = delta ? AddDelta(qkv.to(at::kFloat), d.to(at::kFloat), t) : qkv.to(at::kFloat);
  at::Tensor q = all.narrow(1, 0, kHeads * hd).view({rows, kHeads, hd});
  at::Tensor k = all.narrow(1, kHeads * hd, kKvHeads * hd).view({rows, kKvHeads, hd});
  const at::Tensor v = all.narrow(1, (kHeads + kKvHeads) * hd, kKvHeads * hd).view({rows, kKvHeads, hd});
  if (norms) {
    q = HeadNorm(q, qn, t);
    k = HeadNorm(k, kn, t);
  }
  const at::Tensor angle = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);  // [rows, hd / 2]
  const at::Tensor cs = Round(at::cat({angle, angle}, 1).cos() * scale, t).unsqueeze(1);
  const at::Tensor sn = Round(at::cat({angle, angle}, 1).sin() * scale, t).unsqueeze(1);
  at::Tensor k_want = at::zeros({kPoolRows, kKvHeads, hd}, On(at::kFloat)), v_want = at::zeros_like(k_want);
  k_want.index_copy_(0, write_rows, Rope(k, cs, sn, t));
  v_want.index_copy_(0, write_rows, Round(v, t));
  const std::string what = std::string(t == at::kBFloat16 ? "bf16" : "fp32") + " hd=" + std::to_string(hd) +
                           (norms ? " norms" : "") + (delta ? " delta" : "") +
                           (scale != 1.0f ? " scale " + std::to_string(scale) : "");
  ExpectClose(q_out, Rope(q, cs, sn, t), Rtol(t), Atol(t), what + ": q");
  ExpectClose(k_pool, k_want, Rtol(t), Atol(t), what + ": k pool");
  ExpectClose(v_pool, v_want, Rtol(t), Atol(t), what + ": v pool");
}

TEST(QkNormRopeKernel, MatchesATenForQueriesKeysAndValues) {
  LOOM_SKIP_WITHOUT_CUDA();
  for (at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    for (int64_t hd : {64, 96, 128}) {  // 96: the block form (hd / 32 odd)
      Check(t, hd, false, false);
      Check(t, hd, true, false);
      Check(t, hd, true, true);
      Check(t, hd, true, true, 1.1386294f);  // YaRN's 0.1 ln(4) + 1 (factor 4)
    }
  }
}

}  // namespace
}  // namespace loom::engine
#else
TEST(QkNormRopeKernel, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA kernels"; }
#endif
