// SlotBank: initialisation, routing of the segment-form delta, and isolation
// of gradients between slots.
#include "engine/lora/slot_bank.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cmath>

namespace loom::engine {
namespace {

std::vector<std::tuple<std::string, TargetGroup, int64_t, int64_t>> SmallTargets() {
  return {{"model.layers.0.self_attn.q_proj", TargetGroup::kAttn, 16, 24},
          {"model.layers.0.mlp.down_proj", TargetGroup::kMlp, 20, 16},
          {"lm_head", TargetGroup::kUnembed, 16, 40}};
}

LoraConfig Config(int rank, double alpha, uint64_t seed) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = alpha;
  c.seed = seed;
  return c;
}

// Gives every bound slot's B random values (B = 0 after Bind would make
// every delta zero and hide routing mistakes).
void RandomiseB(SlotBank& bank, int s) {
  c10::NoGradGuard no_grad;
  for (auto& t : bank.targets()) {
    const int r = bank.slot(s).config.rank;
    t.B.select(0, s).narrow(1, 0, r).copy_(at::randn({t.d_out, r}) * 0.3);
  }
}

TEST(SlotBank, BindIsDeterministicBoundedAndZeroBeyondRank) {
  SlotBank bank(4, 8, at::kCPU, SmallTargets());
  ASSERT_TRUE(bank.Bind(0, Config(3, 6.0, 42)).ok());
  ASSERT_TRUE(bank.Bind(1, Config(3, 6.0, 42)).ok());
  ASSERT_TRUE(bank.Bind(2, Config(3, 6.0, 43)).ok());
  for (const auto& t : bank.targets()) {
    const at::Tensor a0 = t.A.select(0, 0);
    EXPECT_TRUE(at::equal(a0, t.A.select(0, 1))) << t.module << ": same seed must give the same A";
    EXPECT_FALSE(at::equal(a0, t.A.select(0, 2))) << t.module << ": another seed must give another A";
    const double bound = 1.0 / std::sqrt(static_cast<double>(t.d_in));
    const at::Tensor used = a0.narrow(0, 0, 3);
    EXPECT_LE(used.abs().max().item<double>(), bound);
    EXPECT_GT(used.abs().max().item<double>(), 0.5 * bound);       // actually spread over the range
    EXPECT_LT(std::abs(used.mean().item<double>()), 0.25 * bound);  // roughly centred
    EXPECT_EQ(a0.narrow(0, 3, 5).abs().max().item<double>(), 0.0) << t.module << ": rows >= r";
    EXPECT_EQ(t.B.select(0, 0).abs().max().item<double>(), 0.0) << t.module << ": B starts at zero";
  }
  EXPECT_FLOAT_EQ(bank.scales()[0].item<float>(), 2.0f);
  EXPECT_EQ(bank.scales()[3].item<float>(), 0.0f);
  // Targets differ from each other (seeded by module name, not one stream).
  EXPECT_NE(bank.targets()[0].A[0][0][0].item<float>(), bank.targets()[2].A[0][0][0].item<float>());
}

TEST(SlotBank, UntrainedGroupsStayZero) {
  SlotBank bank(2, 4, at::kCPU, SmallTargets());
  LoraConfig c = Config(4, 8.0, 1);
  c.train_mlp = false;
  c.train_unembed = false;
  ASSERT_TRUE(bank.Bind(0, c).ok());
  EXPECT_GT(bank.find("model.layers.0.self_attn.q_proj")->A.select(0, 0).abs().max().item<double>(), 0.0);
  EXPECT_EQ(bank.find("model.layers.0.mlp.down_proj")->A.select(0, 0).abs().max().item<double>(), 0.0);
  EXPECT_EQ(bank.find("lm_head")->A.select(0, 0).abs().max().item<double>(), 0.0);
  EXPECT_TRUE(bank.trains(0, TargetGroup::kAttn));
  EXPECT_FALSE(bank.trains(0, TargetGroup::kMlp));
  EXPECT_FALSE(bank.trains(1, TargetGroup::kAttn));  // unbound
}

TEST(SlotBank, BindRejectsBadInputNamingTheField) {
  SlotBank bank(2, 4, at::kCPU, SmallTargets());
  Status s = bank.Bind(0, Config(5, 8.0, 0));
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("rank"), std::string::npos) << s.message();
  EXPECT_FALSE(bank.Bind(0, Config(0, 8.0, 0)).ok());
  s = bank.Bind(2, Config(2, 8.0, 0));
  EXPECT_NE(s.message().find("slot"), std::string::npos) << s.message();
  EXPECT_FALSE(bank.Bind(0, Config(2, 0.0, 0)).ok());
  EXPECT_FALSE(bank.slot(0).bound);
}

TEST(SlotBank, SegmentDeltaEqualsNaivePerTokenReference) {
  at::manual_seed(7);
  SlotBank bank(4, 4, at::kCPU, SmallTargets());
  ASSERT_TRUE(bank.Bind(0, Config(4, 8.0, 1)).ok());
  ASSERT_TRUE(bank.Bind(2, Config(2, 5.0, 2)).ok());
  LoraConfig no_attn = Config(3, 3.0, 3);
  no_attn.train_attn = false;
  ASSERT_TRUE(bank.Bind(3, no_attn).ok());
  for (int s : {0, 2, 3}) RandomiseB(bank, s);

  // Sequences: slot 0, slot 2, base, slot 0 again, slot 0 (a run), slot 3 (no attn), empty, slot 2.
  const std::vector<int64_t> seg_begin = {0, 5, 8, 12, 13, 19, 23, 23, 26};
  const std::vector<int> seg_slot = {0, 2, -1, 0, 0, 3, 1, 2};
  const LoraTarget& t = bank.targets()[0];  // attn group
  const at::Tensor x = at::randn({26, t.d_in});
  const at::Tensor got = bank.Delta(t, x, seg_begin, seg_slot);
  ASSERT_EQ(got.sizes(), (at::IntArrayRef{26, t.d_out}));

  at::Tensor want = at::zeros({26, t.d_out});
  for (size_t i = 0; i + 1 < seg_begin.size(); ++i)
    for (int64_t row = seg_begin[i]; row < seg_begin[i + 1]; ++row) {
      const int s = seg_slot[i];
      if (s != 0 && s != 2) continue;  // base, unbound, or a slot not training attn
      const LoraConfig& c = bank.slot(s).config;
      const at::Tensor a = t.A[s].narrow(0, 0, c.rank), b = t.B[s].narrow(1, 0, c.rank);
      want[row] = at::mv(b, at::mv(a, x[row])) * (c.alpha / c.rank);
    }
  EXPECT_LT((got - want).abs().max().item<double>(), 1e-5);
  EXPECT_GT(want.abs().max().item<double>(), 1e-2);  // the reference is not trivially zero

  // bf16 input: computed in fp32 from the cast input, as PEFT does.
  const at::Tensor got16 = bank.Delta(t, x.to(at::kBFloat16), seg_begin, seg_slot);
  EXPECT_EQ(got16.scalar_type(), at::kFloat);
  EXPECT_LT((got16 - bank.Delta(t, x.to(at::kBFloat16).to(at::kFloat), seg_begin, seg_slot)).abs().max().item<double>(),
            1e-6);
}

TEST(SlotBank, GradientsReachOnlyUsedSlotsAndRowsBelowRank) {
  at::manual_seed(8);
  SlotBank bank(4, 4, at::kCPU, SmallTargets());
  for (int s = 0; s < 4; ++s) {
    ASSERT_TRUE(bank.Bind(s, Config(s == 2 ? 2 : 4, 8.0, 10 + s)).ok());
    RandomiseB(bank, s);
  }
  const std::vector<int64_t> seg_begin = {0, 4, 9, 12};
  const std::vector<int> seg_slot = {0, 2, 0};  // slots 1 and 3 unused
  at::Tensor loss = at::zeros({});
  for (const auto& t : bank.targets()) {
    const at::Tensor x = at::randn({12, t.d_in});
    loss = loss + (bank.Delta(t, x, seg_begin, seg_slot) * at::randn({12, t.d_out})).sum();
  }
  loss.backward();
  for (const auto& t : bank.targets()) {
    ASSERT_TRUE(t.A.grad().defined());
    for (int s : {1, 3}) {
      EXPECT_EQ(t.A.grad()[s].abs().max().item<double>(), 0.0) << t.module << " slot " << s;
      EXPECT_EQ(t.B.grad()[s].abs().max().item<double>(), 0.0) << t.module << " slot " << s;
    }
    for (int s : {0, 2}) {
      const int r = bank.slot(s).config.rank;
      EXPECT_GT(t.A.grad()[s].narrow(0, 0, r).abs().min().item<double>(), 0.0) << t.module;
      EXPECT_GT(t.B.grad()[s].narrow(1, 0, r).abs().max().item<double>(), 0.0) << t.module;
    }
    // Slot 2 has rank 2 of 4: rows/columns >= 2 get exactly zero gradient.
    EXPECT_EQ(t.A.grad()[2].narrow(0, 2, 2).abs().max().item<double>(), 0.0) << t.module;
    EXPECT_EQ(t.B.grad()[2].narrow(1, 2, 2).abs().max().item<double>(), 0.0) << t.module;
  }

  // ZeroGrad touches only its slot; Release wipes weights and grads of its slot.
  bank.ZeroGrad(0);
  EXPECT_EQ(bank.targets()[0].B.grad()[0].abs().max().item<double>(), 0.0);
  EXPECT_GT(bank.targets()[0].B.grad()[2].abs().max().item<double>(), 0.0);
  bank.Release(2);
  EXPECT_FALSE(bank.slot(2).bound);
  EXPECT_EQ(bank.targets()[0].A[2].abs().max().item<double>(), 0.0);
  EXPECT_EQ(bank.targets()[0].B.grad()[2].abs().max().item<double>(), 0.0);
  EXPECT_EQ(bank.scales()[2].item<float>(), 0.0f);
  EXPECT_GT(bank.targets()[0].A[3].abs().max().item<double>(), 0.0);
}


// The routed form (fixed kernel count, for CUDA) against the segment form:
// values and gradients into A and B, with mixed ranks, a base-only sequence,
// a slot not training the group, an empty sequence and repeated slots.
TEST(SlotBank, RoutedDeltaEqualsSegmentDeltaWithGradients) {
  at::manual_seed(9);
  const std::vector<int64_t> seg_begin = {0, 5, 8, 12, 13, 19, 23, 23, 26};
  const std::vector<int> seg_slot = {0, 2, -1, 0, 1, 3, 1, 2};
  std::vector<at::Tensor> xs, gys;
  for (const auto& [m, g, d_in, d_out] : SmallTargets()) {
    xs.push_back(at::randn({26, d_in}));
    gys.push_back(at::randn({26, d_out}));
  }
  std::vector<std::vector<at::Tensor>> outs(2), grads(2);
  for (int routed = 0; routed < 2; ++routed) {
    SlotBank bank(4, 4, at::kCPU, SmallTargets());
    ASSERT_TRUE(bank.Bind(0, Config(4, 8.0, 1)).ok());
    ASSERT_TRUE(bank.Bind(1, Config(2, 3.0, 4)).ok());
    ASSERT_TRUE(bank.Bind(2, Config(3, 5.0, 2)).ok());
    LoraConfig no_attn = Config(3, 3.0, 3);
    no_attn.train_attn = false;
    ASSERT_TRUE(bank.Bind(3, no_attn).ok());
    at::manual_seed(11);
    for (int s : {0, 1, 2, 3}) RandomiseB(bank, s);
    // On the CPU the routed form is chosen only while U * R stays small.
    EXPECT_TRUE(bank.PreferRouted(TargetGroup::kAttn, seg_begin, seg_slot));  // 3 slots x rank 4
    SlotBank wide(40, 4, at::kCPU, SmallTargets());
    for (int s = 0; s < 17; ++s) ASSERT_TRUE(wide.Bind(s, Config(4, 8.0, 1 + s)).ok());
    std::vector<int64_t> wide_begin;
    std::vector<int> wide_slot;
    for (int s = 0; s < 17; ++s) {
      wide_begin.push_back(s);
      wide_slot.push_back(s);
    }
    wide_begin.push_back(17);
    EXPECT_FALSE(wide.PreferRouted(TargetGroup::kAttn, wide_begin, wide_slot));  // 17 x 4 > 64
    at::Tensor loss = at::zeros({});
    for (size_t i = 0; i < 2; ++i) {  // the attn and mlp targets
      const LoraTarget& t = bank.targets()[i];
      at::Tensor y;
      if (routed) {
        const LoraRouting r = bank.Route(t.group, seg_begin, seg_slot);
        EXPECT_EQ(r.num_slots(), t.group == TargetGroup::kAttn ? 3 : 4);
        y = bank.RoutedDelta(t, xs[i], r);
      } else {
        y = bank.Delta(t, xs[i], seg_begin, seg_slot);
      }
      outs[routed].push_back(y.detach());
      loss = loss + (y * gys[i]).sum();
    }
    loss.backward();
    for (size_t i = 0; i < 2; ++i) {
      grads[routed].push_back(bank.targets()[i].A.grad().clone());
      grads[routed].push_back(bank.targets()[i].B.grad().clone());
    }
    if (routed) {  // rows/columns beyond a slot's rank get exactly zero gradient
      EXPECT_EQ(bank.targets()[0].A.grad()[1].narrow(0, 2, 2).abs().max().item<double>(), 0.0);
      EXPECT_EQ(bank.targets()[1].B.grad()[2].narrow(1, 3, 1).abs().max().item<double>(), 0.0);
      EXPECT_EQ(bank.targets()[0].A.grad()[3].abs().max().item<double>(), 0.0);  // slot 3 trains no attn
    }
  }
  for (size_t i = 0; i < outs[0].size(); ++i) {
    EXPECT_GT(outs[0][i].abs().max().item<double>(), 1e-2);
    EXPECT_LT((outs[1][i] - outs[0][i]).abs().max().item<double>(), 1e-5) << "delta " << i;
  }
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_GT(grads[0][i].abs().max().item<double>(), 1e-2);
    EXPECT_LT((grads[1][i] - grads[0][i]).abs().max().item<double>(), 1e-5) << "grad " << i;
  }
}

}  // namespace
}  // namespace loom::engine
