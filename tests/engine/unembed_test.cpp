// The fused loss head (unembed.h, UnembedMode; model/cuda/unembed_kernels.h)
// against the plain one on the same inputs: the log-probabilities and the
// gradients into hidden and the unembed LoRA factors, for the runs layout
// and the uniform one, 1-D and top-K targets (with a repeated target), with
// the logits kept and recomputed, a vocabulary the 16-byte loads take and
// one they do not. CUDA only (the fused path exists only there); the
// largest gaps are printed for docs/compatibility.md.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "engine/model/unembed.h"

namespace loom::engine {
namespace {

// max |a - ref| over max |ref|.
double Gap(const at::Tensor& a, const at::Tensor& ref) {
  const double scale = ref.abs().max().item<double>();
  return (a.to(at::kFloat) - ref.to(at::kFloat)).abs().max().item<double>() / std::max(scale, 1e-30);
}

struct Inputs {
  at::Tensor hidden, lm_head, A, B, targets, g;
};

// hidden [T, H] fp32 holding bf16 values (as the final norm gives), the
// bf16 lm_head, two slots' factors at rank R (slot 1 at rank R / 2: its rows
// past that are zero, as the bank keeps them) and an upstream gradient.
Inputs Make(int64_t T, int64_t H, int64_t V, int64_t R, int64_t K) {
  at::manual_seed(11);
  const auto o = at::TensorOptions().device(at::kCUDA, 0);
  Inputs in;
  in.hidden = at::randn({T, H}, o).to(at::kBFloat16).to(at::kFloat);
  in.lm_head = (at::randn({V, H}, o) * 0.2).to(at::kBFloat16);
  in.A = at::randn({3, R, H}, o) * 0.1;
  in.B = at::randn({3, V, R}, o) * 0.1;
  in.A[1].narrow(0, R / 2, R - R / 2).zero_();
  in.B[1].narrow(1, R / 2, R - R / 2).zero_();
  in.targets = at::randint(V, K == 0 ? std::vector<int64_t>{T} : std::vector<int64_t>{T, K}, o.dtype(at::kLong));
  if (K > 1) in.targets.select(1, K - 1).copy_(in.targets.select(1, 0));  // a repeated target
  in.g = at::randn(in.targets.sizes(), o);
  in.g.narrow(0, 0, 3).zero_();  // rows the loss ignores
  return in;
}

struct Out {
  at::Tensor lp, gh, ga, gb;
};

template <typename F>
Out Differentiate(const Inputs& in, F&& logprobs) {
  const at::Tensor h = in.hidden.clone().requires_grad_(true);
  const at::Tensor A = in.A.clone().requires_grad_(true), B = in.B.clone().requires_grad_(true);
  const at::Tensor lp = logprobs(h, A, B);
  (lp * in.g).sum().backward();
  return {lp.detach(), h.grad(), A.grad(), B.grad()};
}

void ExpectClose(const Out& fused, const Out& plain, const char* what, double* worst) {
  const double gaps[4] = {Gap(fused.lp, plain.lp), Gap(fused.gh, plain.gh), Gap(fused.ga, plain.ga),
                          Gap(fused.gb, plain.gb)};
  EXPECT_LT(gaps[0], 1e-2) << what << " logprobs";
  for (int i = 1; i < 4; ++i) EXPECT_LT(gaps[i], 3e-2) << what << " gradient " << i;
  for (int i = 0; i < 4; ++i) worst[i] = std::max(worst[i], gaps[i]);
}

TEST(FusedUnembed, RunsLayoutMatchesThePlainPath) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  double worst[4] = {0, 0, 0, 0};
  for (const int64_t V : {1000, 1001})
    for (const int64_t K : {0, 3})
      for (const UnembedMode mode : {UnembedMode::kRecompute, UnembedMode::kKeep}) {
        const int64_t T = 40, H = 64, R = 8;
        const Inputs in = Make(T, H, V, R, K);
        auto with = [&](UnembedMode m) {
          return [&in, m, T](const at::Tensor& h, const at::Tensor& A, const at::Tensor& B) {
            UnembedSpec spec;
            spec.A = A;
            spec.B = B;
            // Rows 0-4 without LoRA, two runs of slot 0 and 1 across chunk edges, slot 0 again.
            spec.runs = {{5, 21, 0, 8, 2.0}, {21, 30, 1, 4, 0.5}, {30, T, 0, 8, 2.0}};
            return ChunkedTargetLogprobs(h, in.targets, in.lm_head, spec, 16, m);
          };
        };
        const Out plain = Differentiate(in, with(UnembedMode::kPlain)), fused = Differentiate(in, with(mode));
        ExpectClose(fused, plain, mode == UnembedMode::kKeep ? "runs, kept" : "runs, recomputed", worst);
      }
  std::printf("fused unembed, runs layout, largest gaps to the plain fp32 path: logprobs %.2e, hidden %.2e, "
              "A %.2e, B %.2e\n",
              worst[0], worst[1], worst[2], worst[3]);
}

TEST(FusedUnembed, UniformLayoutMatchesThePlainPath) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  double worst[4] = {0, 0, 0, 0};
  for (const int64_t K : {0, 2})
    for (const UnembedMode mode : {UnembedMode::kRecompute, UnembedMode::kKeep}) {
      const int64_t S = 4, L = 12, H = 64, V = 1024, R = 8;
      const Inputs in = Make(S * L, H, V, R, K);
      const auto o = at::TensorOptions().device(at::kCUDA, 0);
      LoraGroups groups;
      groups.slots = at::tensor(std::vector<int64_t>{1, 0, 2, 0}, o.dtype(at::kLong));
      // Sequence 2's slot does not train the unembed: scale 0.
      groups.scale = at::tensor(std::vector<float>{0.5f, 2.0f, 0.0f, 2.0f}, o.dtype(at::kFloat)).view({-1, 1, 1});
      groups.rows = S * L;
      groups.max_rows = L;
      auto with = [&](UnembedMode m) {
        return [&in, &groups, m, L](const at::Tensor& h, const at::Tensor& A, const at::Tensor& B) {
          return UniformTargetLogprobs(h, in.targets, in.lm_head, A, B, groups, 2 * L, m);
        };
      };
      const Out plain = Differentiate(in, with(UnembedMode::kPlain)), fused = Differentiate(in, with(mode));
      ExpectClose(fused, plain, mode == UnembedMode::kKeep ? "uniform, kept" : "uniform, recomputed", worst);
      // Slot 2 trains nothing here: its gradient stays exactly zero.
      EXPECT_EQ(fused.ga[2].abs().max().item<float>(), 0.0f);
      EXPECT_EQ(fused.gb[2].abs().max().item<float>(), 0.0f);
    }
  std::printf("fused unembed, uniform layout, largest gaps to the plain fp32 path: logprobs %.2e, hidden %.2e, "
              "A %.2e, B %.2e\n",
              worst[0], worst[1], worst[2], worst[3]);
}

// Without a gradient (the sampler's prompt logprobs): the same values.
TEST(FusedUnembed, ForwardOnlyMatchesThePlainPath) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Inputs in = Make(33, 64, 1000, 8, 0);
  UnembedSpec spec;
  spec.A = in.A;
  spec.B = in.B;
  spec.runs = {{0, 33, 1, 4, 0.5}};
  c10::NoGradGuard no_grad;
  const at::Tensor plain = ChunkedTargetLogprobs(in.hidden, in.targets, in.lm_head, spec, 8, UnembedMode::kPlain);
  const at::Tensor fused = ChunkedTargetLogprobs(in.hidden, in.targets, in.lm_head, spec, 8);
  EXPECT_LT(Gap(fused, plain), 1e-2);
}

}  // namespace
}  // namespace loom::engine
