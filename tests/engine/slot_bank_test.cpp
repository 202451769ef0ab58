// SlotBank: initialisation, the three forms of the delta (segment, routed,
// grouped) and the rule choosing between them, and isolation of gradients
// between slots.
#include "engine/lora/slot_bank.h"

#include "engine/lora/lora_nodes.h"
#include "engine/lora/slot_rows.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <tuple>

namespace loom::engine {
namespace {

std::vector<LoraTargetSpec> SmallTargets() {
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

  // bf16 input: computed in bf16 (the factors cast down), within bf16
  // rounding of the fp32 value of the same input.
  const at::Tensor x16 = x.to(at::kBFloat16);
  const at::Tensor ref16 = bank.Delta(t, x16.to(at::kFloat), seg_begin, seg_slot);
  const at::Tensor got16 = bank.Delta(t, x16, seg_begin, seg_slot);
  EXPECT_EQ(got16.scalar_type(), at::kBFloat16);
  EXPECT_LT((got16.to(at::kFloat) - ref16).abs().max().item<double>(), 2e-2 * ref16.abs().max().item<double>());
  // With fp32 LoRA asked for: computed in fp32 from the cast input, as PEFT does.
  bank.set_lora_fp32(true);
  const at::Tensor got32 = bank.Delta(t, x16, seg_begin, seg_slot);
  bank.set_lora_fp32(false);
  EXPECT_EQ(got32.scalar_type(), at::kFloat);
  EXPECT_LT((got32 - ref16).abs().max().item<double>(), 1e-6);
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
  for (const auto& [m, g, d_in, d_out, experts, per_expert, interleaved, a_shard, b_shard] : SmallTargets()) {
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
    EXPECT_EQ(bank.ChooseForm(TargetGroup::kAttn, seg_begin, seg_slot), LoraForm::kRouted);  // 3 slots x rank 4
    SlotBank wide(40, 4, at::kCPU, SmallTargets());
    for (int s = 0; s < 17; ++s) ASSERT_TRUE(wide.Bind(s, Config(4, 8.0, 1 + s)).ok());
    std::vector<int64_t> wide_begin;
    std::vector<int> wide_slot;
    for (int s = 0; s < 17; ++s) {
      wide_begin.push_back(s);
      wide_slot.push_back(s);
    }
    wide_begin.push_back(17);
    EXPECT_EQ(wide.ChooseForm(TargetGroup::kAttn, wide_begin, wide_slot), LoraForm::kSegment);  // 17 x 4 > 64
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

// max |got - want| relative to max |want| (want must not be zero).
double RelErr(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).abs().max().item<double>() / want.abs().max().item<double>();
}

// A batch for the grouped form: slots with different ranks, all below the
// bank's R = 8; slot 0 in two non-adjacent sequences; base rows (-1); slot 3
// which trains the mlp group but not attn; an empty sequence; an unbound slot.
struct GroupedCase {
  std::vector<int64_t> seg_begin = {0, 5, 9, 12, 15, 19, 19, 26, 28, 30};
  std::vector<int> seg_slot = {0, 1, -1, 0, 3, 2, 2, 4, 1};
  int64_t T = 30;

  static SlotBank MakeBank(const std::vector<LoraTargetSpec>& targets = SmallTargets()) {
    SlotBank bank(6, 8, at::kCPU, targets);
    EXPECT_TRUE(bank.Bind(0, Config(3, 6.0, 1)).ok());
    EXPECT_TRUE(bank.Bind(1, Config(5, 4.0, 2)).ok());
    EXPECT_TRUE(bank.Bind(2, Config(6, 9.0, 3)).ok());
    LoraConfig no_attn = Config(4, 3.0, 4);
    no_attn.train_attn = false;
    EXPECT_TRUE(bank.Bind(3, no_attn).ok());
    at::manual_seed(21);
    for (int s : {0, 1, 2, 3}) RandomiseB(bank, s);
    return bank;  // slots 4 and 5 stay unbound
  }
};

// Values and gradients (into x, A and B) of one form over the attn and mlp
// targets; grouped uses one routing per group, shared by its targets.
struct FormResult {
  std::vector<at::Tensor> out, grad_x, grad_a, grad_b;
};

// grouped: GroupedDelta (with cast: over factors cast once and gradients
// written to the pass's buffer, SlotBank::PassGroup), else Delta.
FormResult RunForm(bool grouped, SlotBank& bank, const std::vector<int64_t>& seg_begin,
                   const std::vector<int>& seg_slot, const std::vector<at::Tensor>& xs,
                   const std::vector<at::Tensor>& gys, bool cast = false) {
  FormResult r;
  at::Tensor loss = at::zeros({});
  std::vector<at::Tensor> leaves;
  std::vector<PassFactors> passes;
  passes.reserve(2);
  const LoraGroups attn = bank.Group(TargetGroup::kAttn, seg_begin, seg_slot);
  const LoraGroups mlp = bank.Group(TargetGroup::kMlp, seg_begin, seg_slot);
  for (size_t i = 0; i < 2; ++i) {  // the attn and mlp targets
    const LoraTarget& t = bank.targets()[i];
    at::Tensor x = xs[i].detach().clone().requires_grad_();
    leaves.push_back(x);
    const LoraGroups& groups = t.group == TargetGroup::kAttn ? attn : mlp;
    // Cast once, with the gradients through the pass's buffer and its flush.
    passes.push_back(cast && groups.num_slots() > 0
                         ? bank.PassGroup(t.group, groups.slots, bank.ComputeType(x), /*grads=*/true)
                         : PassFactors{});
    const PassFactors* pass = passes.back().cast.defined() ? &passes.back() : nullptr;
    if (pass) EXPECT_TRUE(pass->token.defined());
    const at::Tensor y = grouped ? bank.GroupedDelta(t, x, groups, pass) : bank.Delta(t, x, seg_begin, seg_slot);
    EXPECT_EQ(y.scalar_type(), at::kFloat);
    r.out.push_back(y.detach());
    loss = loss + (y * gys[i]).sum();
  }
  loss.backward();
  for (size_t i = 0; i < 2; ++i) {
    r.grad_x.push_back(leaves[i].grad().clone());
    r.grad_a.push_back(bank.targets()[i].A.grad().clone());
    r.grad_b.push_back(bank.targets()[i].B.grad().clone());
  }
  return r;
}

// The same values and gradients through ATen's op-by-op graph, from leaf
// copies of the bank's factors (the reference for the forms' autograd nodes,
// whose backwards are written out and add into .grad in place).
FormResult RunGraph(SlotBank& bank, const std::vector<int64_t>& seg_begin, const std::vector<int>& seg_slot,
                    const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& gys) {
  FormResult r;
  at::Tensor loss = at::zeros({});
  std::vector<at::Tensor> xl, al, bl;
  for (size_t i = 0; i < 2; ++i) {
    const LoraTarget& t = bank.targets()[i];
    xl.push_back(xs[i].detach().clone().requires_grad_());
    al.push_back(t.A.detach().clone().requires_grad_());
    bl.push_back(t.B.detach().clone().requires_grad_());
    std::vector<at::Tensor> rows;
    for (size_t q = 0; q + 1 < seg_begin.size(); ++q) {
      const int64_t len = seg_begin[q + 1] - seg_begin[q];
      const int s = seg_slot[q];
      const at::Tensor xr = xl[i].narrow(0, seg_begin[q], len);
      if (!bank.trains(s, t.group)) {
        rows.push_back(at::zeros({len, t.d_out}));
        continue;
      }
      const LoraConfig& c = bank.slot(s).config;
      const at::Tensor a = al[i][s].narrow(0, 0, c.rank), b = bl[i][s].narrow(1, 0, c.rank);
      rows.push_back(at::linear(at::linear(xr, a) * (c.alpha / c.rank), b));
    }
    const at::Tensor y = at::cat(rows, 0);
    r.out.push_back(y.detach());
    loss = loss + (y * gys[i]).sum();
  }
  loss.backward();
  for (size_t i = 0; i < 2; ++i) {
    r.grad_x.push_back(xl[i].grad());
    r.grad_a.push_back(al[i].grad());
    r.grad_b.push_back(bl[i].grad());
  }
  return r;
}

// Both forms' nodes against the graph: values, and gradients into x, A and
// B (only the used slots' rows, and none past a slot's rank).
TEST(SlotBank, FormNodesHaveTheGraphsGradients) {
  at::manual_seed(19);
  const GroupedCase c;
  std::vector<at::Tensor> xs, gys;
  for (const auto& [m, g, d_in, d_out, experts, per_expert, interleaved, a_shard, b_shard] : SmallTargets()) {
    xs.push_back(at::randn({c.T, d_in}));
    gys.push_back(at::randn({c.T, d_out}));
  }
  SlotBank ref_bank = GroupedCase::MakeBank();
  const FormResult want = RunGraph(ref_bank, c.seg_begin, c.seg_slot, xs, gys);
  for (bool grouped : {false, true}) {
    SlotBank bank = GroupedCase::MakeBank();
    const FormResult got = RunForm(grouped, bank, c.seg_begin, c.seg_slot, xs, gys);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_GT(want.grad_a[i].abs().max().item<double>(), 1e-2);
      EXPECT_LT(RelErr(got.out[i], want.out[i]), 1e-5) << grouped << " delta " << i;
      EXPECT_LT(RelErr(got.grad_x[i], want.grad_x[i]), 1e-5) << grouped << " grad x " << i;
      EXPECT_LT(RelErr(got.grad_a[i], want.grad_a[i]), 1e-5) << grouped << " grad A " << i;
      EXPECT_LT(RelErr(got.grad_b[i], want.grad_b[i]), 1e-5) << grouped << " grad B " << i;
      // The nodes leave the factors' own autograd path alone: nothing but
      // their in-place rows reached .grad, so unbound slot 4 and 5 stay zero.
      for (int s : {4, 5}) {
        EXPECT_EQ(got.grad_a[i][s].abs().max().item<double>(), 0.0);
        EXPECT_EQ(got.grad_b[i][s].abs().max().item<double>(), 0.0);
      }
    }
  }
}

// The grouped form (segmented, padded bmm) against the segment form.
TEST(SlotBank, GroupedDeltaEqualsSegmentDeltaWithGradients) {
  at::manual_seed(17);
  const GroupedCase c;
  std::vector<at::Tensor> xs, gys;
  for (const auto& [m, g, d_in, d_out, experts, per_expert, interleaved, a_shard, b_shard] : SmallTargets()) {
    xs.push_back(at::randn({c.T, d_in}));
    gys.push_back(at::randn({c.T, d_out}));
  }

  // The routing: attn groups slots 0 (5 + 3 rows, Lmax = 8), 1 (4 + 2) and
  // 2 (7); mlp also slot 3 (4 rows). Rows 9-11 (base), 26-27 (unbound) and,
  // for attn, 15-18 (slot 3) read the zero row at U * Lmax = 24.
  {
    SlotBank bank = GroupedCase::MakeBank();
    const LoraGroups attn = bank.Group(TargetGroup::kAttn, c.seg_begin, c.seg_slot);
    ASSERT_EQ(attn.num_slots(), 3);
    EXPECT_TRUE(at::equal(attn.slots, at::tensor(std::vector<int64_t>{0, 1, 2}, at::kLong)));
    EXPECT_EQ(attn.max_rows, 8);
    EXPECT_EQ(attn.rows, c.T);
    EXPECT_TRUE(attn.base_rows);
    // Slot 0's group is its two non-adjacent sequences; pads repeat a group's first row.
    const std::vector<int64_t> gather = {0,  1,  2,  3,  4,  12, 13, 14,   // slot 0
                                         5,  6,  7,  8,  28, 29, 5,  5,    // slot 1 + 2 pads
                                         19, 20, 21, 22, 23, 24, 25, 19};  // slot 2 + 1 pad
    EXPECT_TRUE(at::equal(attn.gather, at::tensor(gather, at::kLong))) << attn.gather;
    ASSERT_EQ(attn.scatter.size(0), c.T);
    for (int64_t p = 0; p < 24; ++p)  // every real padded position maps back to its row
      if (p != 14 && p != 15 && p != 23) EXPECT_EQ(attn.scatter[gather[p]].item<int64_t>(), p) << p;
    for (int64_t row : {9, 10, 11, 15, 16, 17, 18, 26, 27}) EXPECT_EQ(attn.scatter[row].item<int64_t>(), 24) << row;
    EXPECT_TRUE(at::equal(attn.pads, at::tensor(std::vector<int64_t>{14, 15, 23}, at::kLong))) << attn.pads;
    EXPECT_FLOAT_EQ(attn.scale[1].item<float>(), 4.0f / 5.0f);
    const LoraGroups mlp = bank.Group(TargetGroup::kMlp, c.seg_begin, c.seg_slot);
    EXPECT_EQ(mlp.num_slots(), 4);
    EXPECT_EQ(mlp.max_rows, 8);
  }

  SlotBank want_bank = GroupedCase::MakeBank(), bank = GroupedCase::MakeBank(), cast_bank = GroupedCase::MakeBank();
  const FormResult want = RunForm(false, want_bank, c.seg_begin, c.seg_slot, xs, gys);
  const FormResult got = RunForm(true, bank, c.seg_begin, c.seg_slot, xs, gys);
  // Factors cast once per pass give the same bits as gathering them per use.
  const FormResult cast = RunForm(true, cast_bank, c.seg_begin, c.seg_slot, xs, gys, /*cast=*/true);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::equal(cast.out[i], got.out[i])) << "delta " << i;
    EXPECT_TRUE(at::equal(cast.grad_x[i], got.grad_x[i])) << "grad x " << i;
    EXPECT_TRUE(at::equal(cast.grad_a[i], got.grad_a[i])) << "grad A " << i;
    EXPECT_TRUE(at::equal(cast.grad_b[i], got.grad_b[i])) << "grad B " << i;
  }
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_GT(want.out[i].abs().max().item<double>(), 1e-2);  // the reference is not trivially zero
    EXPECT_LT(RelErr(got.out[i], want.out[i]), 1e-5) << "delta " << i;
    EXPECT_LT(RelErr(got.grad_x[i], want.grad_x[i]), 1e-5) << "grad x " << i;
    EXPECT_LT(RelErr(got.grad_a[i], want.grad_a[i]), 1e-5) << "grad A " << i;
    EXPECT_LT(RelErr(got.grad_b[i], want.grad_b[i]), 1e-5) << "grad B " << i;
    // Rows without a training slot get exactly zero delta.
    EXPECT_EQ(got.out[i].narrow(0, 9, 3).abs().max().item<double>(), 0.0);
    EXPECT_EQ(got.out[i].narrow(0, 26, 2).abs().max().item<double>(), 0.0);
    // Rows/columns beyond a slot's rank, and slots not training the group, get exactly zero gradient.
    for (int s : {0, 1, 2, 3}) {
      if (!bank.trains(s, bank.targets()[i].group)) {
        EXPECT_EQ(got.grad_a[i][s].abs().max().item<double>(), 0.0) << "target " << i << " slot " << s;
        EXPECT_EQ(got.grad_b[i][s].abs().max().item<double>(), 0.0) << "target " << i << " slot " << s;
        continue;
      }
      const int r = bank.slot(s).config.rank;
      EXPECT_GT(got.grad_a[i][s].narrow(0, 0, r).abs().max().item<double>(), 0.0) << "target " << i << " slot " << s;
      EXPECT_GT(got.grad_b[i][s].narrow(1, 0, r).abs().max().item<double>(), 0.0) << "target " << i << " slot " << s;
      EXPECT_EQ(got.grad_a[i][s].narrow(0, r, 8 - r).abs().max().item<double>(), 0.0) << "target " << i << " slot " << s;
      EXPECT_EQ(got.grad_b[i][s].narrow(1, r, 8 - r).abs().max().item<double>(), 0.0) << "target " << i << " slot " << s;
    }
    for (int s : {4, 5}) {  // unbound, and unused
      EXPECT_EQ(got.grad_a[i][s].abs().max().item<double>(), 0.0);
      EXPECT_EQ(got.grad_b[i][s].abs().max().item<double>(), 0.0);
    }
  }
  EXPECT_EQ(got.grad_a[0][3].abs().max().item<double>(), 0.0);  // slot 3 trains no attn
  EXPECT_GT(got.grad_a[1][3].abs().max().item<double>(), 0.0);  // but it trains mlp

  // bf16 input: gathered, then computed in bf16 as Delta computes it; with
  // fp32 LoRA asked for, cast to fp32 as Delta casts it.
  const LoraTarget& t = bank.targets()[0];
  const at::Tensor x16 = xs[0].to(at::kBFloat16);
  const LoraGroups groups = bank.Group(t.group, c.seg_begin, c.seg_slot);
  const at::Tensor got16 = bank.GroupedDelta(t, x16, groups);
  EXPECT_EQ(got16.scalar_type(), at::kBFloat16);
  EXPECT_LT(RelErr(got16.to(at::kFloat), bank.Delta(t, x16, c.seg_begin, c.seg_slot).to(at::kFloat)), 2e-2);
  bank.set_lora_fp32(true);
  const at::Tensor got32 = bank.GroupedDelta(t, x16, groups);
  EXPECT_EQ(got32.scalar_type(), at::kFloat);
  EXPECT_LT(RelErr(got32, bank.Delta(t, x16, c.seg_begin, c.seg_slot)), 1e-5);
  bank.set_lora_fp32(false);
}

// The comparison above catches a wrong grouped path: a wrong scale, a
// group reading another group's rows, or a row read back from the wrong
// padded position all move the value far beyond the tolerance.
TEST(SlotBank, GroupedDeltaComparisonCatchesWrongRouting) {
  at::manual_seed(18);
  const GroupedCase c;
  SlotBank bank = GroupedCase::MakeBank();
  const LoraTarget& t = bank.targets()[0];
  const at::Tensor x = at::randn({c.T, t.d_in});
  const at::Tensor want = bank.Delta(t, x, c.seg_begin, c.seg_slot).detach();
  const LoraGroups good = bank.Group(t.group, c.seg_begin, c.seg_slot);
  EXPECT_LT(RelErr(bank.GroupedDelta(t, x, good).detach(), want), 1e-5);

  LoraGroups bad = good;
  bad.scale = good.scale.flip({0});  // slots' scales swapped
  EXPECT_GT(RelErr(bank.GroupedDelta(t, x, bad).detach(), want), 1e-2);
  bad = good;
  bad.scale = good.scale * 1.01;  // 1% off
  EXPECT_GT(RelErr(bank.GroupedDelta(t, x, bad).detach(), want), 1e-3);
  bad = good;
  bad.slots = good.slots.flip({0});  // groups multiplied by another slot's factors
  EXPECT_GT(RelErr(bank.GroupedDelta(t, x, bad).detach(), want), 1e-2);
  bad = good;
  bad.gather = good.gather.roll({1});  // rows shifted by one within the padded layout
  EXPECT_GT(RelErr(bank.GroupedDelta(t, x, bad).detach(), want), 1e-2);
}

// One group only: a single slot over two sequences around base rows, and a
// batch that is one sequence of one slot (no padding, no zero row).
TEST(SlotBank, GroupedDeltaSingleGroup) {
  at::manual_seed(19);
  // (seg_begin, seg_slot, slots U, identity: rows already in padded order).
  const std::vector<std::tuple<std::vector<int64_t>, std::vector<int>, int64_t, bool>> cases = {
      {{0, 6, 9, 13}, {2, -1, 2}, 1, false},
      {{0, 11}, {1}, 1, true},
      {{0, 5, 10}, {1, 2}, 2, true},   // two tenants, equal lengths: no gather or scatter
      {{0, 5, 9}, {1, 2}, 2, false},   // unequal: padded
  };
  for (const auto& [seg_begin, seg_slot, want_slots, want_identity] : cases) {
    const int64_t T = seg_begin.back();
    std::vector<at::Tensor> xs, gys;
    for (const auto& [m, g, d_in, d_out, experts, per_expert, interleaved, a_shard, b_shard] : SmallTargets()) {
      xs.push_back(at::randn({T, d_in}));
      gys.push_back(at::randn({T, d_out}));
    }
    SlotBank bank = GroupedCase::MakeBank();
    const LoraGroups r = bank.Group(TargetGroup::kAttn, seg_begin, seg_slot);
    EXPECT_EQ(r.num_slots(), want_slots);
    EXPECT_EQ(r.base_rows, std::find(seg_slot.begin(), seg_slot.end(), -1) != seg_slot.end());
    EXPECT_EQ(r.identity, want_identity) << "T " << T;
    SlotBank want_bank = GroupedCase::MakeBank(), got_bank = GroupedCase::MakeBank();
    const FormResult want = RunForm(false, want_bank, seg_begin, seg_slot, xs, gys);
    const FormResult got = RunForm(true, got_bank, seg_begin, seg_slot, xs, gys);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_GT(want.out[i].abs().max().item<double>(), 1e-2);
      EXPECT_LT(RelErr(got.out[i], want.out[i]), 1e-5) << "delta " << i << " T " << T;
      EXPECT_LT(RelErr(got.grad_x[i], want.grad_x[i]), 1e-5) << "grad x " << i << " T " << T;
      EXPECT_LT(RelErr(got.grad_a[i], want.grad_a[i]), 1e-5) << "grad A " << i << " T " << T;
      EXPECT_LT(RelErr(got.grad_b[i], want.grad_b[i]), 1e-5) << "grad B " << i << " T " << T;
    }
  }
  // No training slot at all: zeros of the right shape.
  SlotBank bank = GroupedCase::MakeBank();
  const LoraGroups none = bank.Group(TargetGroup::kAttn, {0, 4, 7}, {-1, 3});
  EXPECT_EQ(none.num_slots(), 0);
  const at::Tensor z = bank.GroupedDelta(bank.targets()[0], at::randn({7, 16}), none);
  EXPECT_EQ(z.sizes(), (at::IntArrayRef{7, 24}));
  EXPECT_EQ(z.abs().max().item<double>(), 0.0);
}

// The selection rule as a pure function of the batch's shape, and the shape
// of a batch as the bank computes it.
TEST(SlotBank, FormSelectionRule) {
  auto shape = [](int64_t T, int64_t runs, int64_t U, int64_t Lmax) {
    LoraBatchShape s;
    s.rows = T;
    s.runs = runs;
    s.slots = U;
    s.max_rows = Lmax;
    return s;
  };
  const bool cuda = true, cpu = false;
  // The measured H200 case: 16 tenants x 512 tokens at R = 32 (U*R = 512).
  EXPECT_EQ(SlotBank::SelectForm(cuda, shape(8192, 16, 16, 512), 32), LoraForm::kGrouped);
  EXPECT_EQ(SlotBank::SelectForm(cpu, shape(8192, 16, 16, 512), 32), LoraForm::kSegment);
  // Grouped first on CUDA (4 tenants x 2048: no padding at all); routed
  // while U*R <= 128 on CUDA when the padding is too much, <= 64 on the CPU.
  EXPECT_EQ(SlotBank::SelectForm(cuda, shape(8192, 4, 4, 2048), 32), LoraForm::kGrouped);  // 4*2048 <= 2T
  EXPECT_EQ(SlotBank::SelectForm(cuda, shape(8192, 5, 5, 2048), 32), LoraForm::kGrouped);  // 5*2048 <= 2T
  EXPECT_EQ(SlotBank::SelectForm(cuda, shape(1000, 8, 4, 600), 32), LoraForm::kRouted);    // 2400 > 2T; U*R = 128
  EXPECT_EQ(SlotBank::SelectForm(cuda, shape(1000, 8, 5, 600), 32), LoraForm::kSegment);   // 3000 > 2T; U*R = 160
  EXPECT_EQ(SlotBank::SelectForm(cpu, shape(8192, 4, 4, 2048), 16), LoraForm::kRouted);    // 64
  EXPECT_EQ(SlotBank::SelectForm(cpu, shape(8192, 5, 5, 2048), 16), LoraForm::kSegment);   // 80
  EXPECT_EQ(SlotBank::SelectForm(cpu, shape(8192, 5, 5, 1639), 16), LoraForm::kSegment);   // never grouped
  // Grouped only while the padding at most doubles the rows: U*Lmax <= 2T.
  EXPECT_EQ(SlotBank::SelectForm(cuda, shape(1000, 8, 8, 250), 32), LoraForm::kGrouped);   // 2000 = 2T
  EXPECT_EQ(SlotBank::SelectForm(cuda, shape(1000, 8, 8, 251), 32), LoraForm::kSegment);   // 2008 > 2T
  // One run: the segment form is one matmul pair already.
  EXPECT_EQ(SlotBank::SelectForm(cuda, shape(8192, 1, 1, 8192), 32), LoraForm::kSegment);
  EXPECT_EQ(SlotBank::SelectForm(cuda, shape(8192, 1, 1, 8192), 4), LoraForm::kSegment);
  EXPECT_EQ(SlotBank::SelectForm(cpu, shape(8192, 1, 1, 8192), 4), LoraForm::kSegment);
  EXPECT_EQ(SlotBank::SelectForm(cuda, shape(100, 1, 0, 0), 4), LoraForm::kSegment);  // base rows only

  // Shape: runs of equal effective slots (a slot not training the group
  // counts as base; empty sequences are skipped), distinct training slots,
  // and the largest slot's rows over all its sequences.
  const GroupedCase c;
  SlotBank bank = GroupedCase::MakeBank();
  LoraBatchShape s = bank.Shape(TargetGroup::kAttn, c.seg_begin, c.seg_slot);
  EXPECT_EQ(s.rows, 30);
  // 0 | 1 | base (-1) | 0 | base (slot 3) | 2 | base (unbound 4) | 1
  EXPECT_EQ(s.runs, 8);
  EXPECT_EQ(s.slots, 3);
  EXPECT_EQ(s.max_rows, 8);  // slot 0: 5 + 3 rows
  s = bank.Shape(TargetGroup::kMlp, c.seg_begin, c.seg_slot);
  EXPECT_EQ(s.slots, 4);
  // On this CPU bank (R = 8): 3 * 8 = 24 <= 64 routed; the choice follows the rule.
  EXPECT_EQ(bank.ChooseForm(TargetGroup::kAttn, c.seg_begin, c.seg_slot), LoraForm::kRouted);
  EXPECT_EQ(bank.ChooseForm(TargetGroup::kAttn, {0, 5, 9}, {0, 0}), LoraForm::kSegment);  // one run
}


// The projected node (ProjectedJointLora: the frozen base projection and the
// targets' deltas as one node, each delta accumulated into the base GEMM's
// output and x's gradient into the base's) against at::linear plus the
// grouped delta over the same cast-once factors: the same values and the
// same gradients into x, A and B, with and without a bias.
TEST(SlotBank, ProjectedJointLoraIsTheBaseProjectionPlusTheDelta) {
  const std::vector<int64_t> seg_begin = {0, 6, 12, 18};
  const std::vector<int> seg_slot = {0, 1, 2};  // one equal run a slot: the identity routing
  for (const bool with_bias : {false, true}) {
    FormResult got[2];
    for (int projected = 0; projected < 2; ++projected) {
      SlotBank bank(4, 8, at::kCPU, SmallTargets());
      ASSERT_TRUE(bank.Bind(0, Config(3, 6.0, 1)).ok());
      ASSERT_TRUE(bank.Bind(1, Config(5, 4.0, 2)).ok());
      ASSERT_TRUE(bank.Bind(2, Config(8, 9.0, 3)).ok());
      at::manual_seed(31);
      for (int s : {0, 1, 2}) RandomiseB(bank, s);
      const LoraTarget& t = bank.targets()[0];  // q_proj, 16 -> 24
      const at::Tensor w = at::randn({t.d_out, t.d_in}) * 0.2;
      const at::Tensor b = with_bias ? at::randn({t.d_out}) : at::Tensor();
      const at::Tensor x = at::randn({18, t.d_in}).requires_grad_();
      const at::Tensor gy = at::randn({18, t.d_out});
      const LoraGroups groups = bank.Group(t.group, seg_begin, seg_slot);
      ASSERT_TRUE(groups.identity && !groups.base_rows);
      const PassFactors pass = bank.PassGroup(t.group, groups.slots, bank.ComputeType(x), /*grads=*/true);
      const at::Tensor y =
          projected ? ProjectedJointLora(x, w, b, {bank.CastFactors(t, pass)}, groups, pass.token)
                    : at::linear(x, w, b) + bank.GroupedDelta(t, x, groups, &pass);
      (y * gy).sum().backward();
      got[projected] = {{y.detach()}, {x.grad()}, {t.A.grad().clone()}, {t.B.grad().clone()}};
    }
    EXPECT_GT(got[0].grad_a[0].abs().max().item<double>(), 1e-2);
    EXPECT_LT(RelErr(got[1].out[0], got[0].out[0]), 1e-6) << with_bias;
    EXPECT_LT(RelErr(got[1].grad_x[0], got[0].grad_x[0]), 1e-6) << with_bias;
    EXPECT_LT(RelErr(got[1].grad_a[0], got[0].grad_a[0]), 1e-6) << with_bias;
    EXPECT_LT(RelErr(got[1].grad_b[0], got[0].grad_b[0]), 1e-6) << with_bias;
  }
}

// The joint node of several targets that read the same rows, over a routing
// that is not an identity (the rows gathered into padded order once, with
// pads, base rows and a slot in two non-adjacent sequences): the same values
// and gradients into x, A and B as each target's grouped delta, side by side.
TEST(SlotBank, JointGroupedDeltaGathersUnpaddedRowsOnce) {
  const std::vector<LoraTargetSpec> targets = {{"model.layers.0.self_attn.q_proj", TargetGroup::kAttn, 16, 24},
                                               {"model.layers.0.self_attn.k_proj", TargetGroup::kAttn, 16, 8}};
  const GroupedCase c;
  at::manual_seed(41);
  const at::Tensor x0 = at::randn({c.T, 16});
  const at::Tensor gy = at::randn({c.T, 32});
  FormResult got[2];
  for (int joint = 0; joint < 2; ++joint) {
    SlotBank bank = GroupedCase::MakeBank(targets);
    const at::Tensor x = x0.clone().requires_grad_();
    const LoraGroups groups = bank.Group(TargetGroup::kAttn, c.seg_begin, c.seg_slot);
    ASSERT_TRUE(!groups.identity && groups.base_rows && groups.pads.defined());
    const PassFactors pass = bank.PassGroup(TargetGroup::kAttn, groups.slots, bank.ComputeType(x), /*grads=*/true);
    const LoraTarget &q = bank.targets()[0], &k = bank.targets()[1];
    const at::Tensor y =
        joint ? JointGroupedLoraDelta(x, {bank.CastFactors(q, pass), bank.CastFactors(k, pass)}, groups,
                                      bank.ComputeType(x), pass.token)
              : at::cat({bank.GroupedDelta(q, x, groups, &pass), bank.GroupedDelta(k, x, groups, &pass)}, 1);
    (y * gy).sum().backward();
    got[joint] = {{y.detach()}, {x.grad()}, {q.A.grad().clone(), k.A.grad().clone()}, {q.B.grad().clone(), k.B.grad().clone()}};
  }
  EXPECT_EQ(got[1].out[0].narrow(0, 9, 3).abs().max().item<double>(), 0.0);  // base rows: no delta
  EXPECT_LT(RelErr(got[1].out[0], got[0].out[0]), 1e-6);
  EXPECT_LT(RelErr(got[1].grad_x[0], got[0].grad_x[0]), 1e-6);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_GT(got[0].grad_a[i].abs().max().item<double>(), 1e-2) << i;
    EXPECT_LT(RelErr(got[1].grad_a[i], got[0].grad_a[i]), 1e-6) << i;
    EXPECT_LT(RelErr(got[1].grad_b[i], got[0].grad_b[i]), 1e-6) << i;
    EXPECT_EQ(got[1].grad_a[i][3].abs().max().item<double>(), 0.0) << i;  // slot 3 trains no attn
  }
}

// The ragged order (LoraGroups::ragged): routings whose groups tile the rows
// in group order, each group its own length, run the grouped form over the
// rows as they are. Group marks exactly those (where the bank allows it),
// and their deltas and gradients are the padded order's and the segment
// form's, through GroupedDelta, the joint node and the projected node.
TEST(SlotBank, RaggedRowsRunAsTheyAre) {
  // (seg_begin, seg_slot, ragged, ends).
  const std::vector<std::tuple<std::vector<int64_t>, std::vector<int>, bool, std::vector<int64_t>>> cases = {
      {{0, 5, 9}, {1, 2}, true, {5, 9}},
      {{0, 3, 6, 9}, {1, 1, 2}, true, {6, 9}},        // one slot's two adjacent sequences: one group
      {{0, 4, 11, 11, 13}, {2, 0, 1, 1}, true, {4, 11, 13}},  // an empty sequence
      {{0, 3, 6, 9}, {1, 2, 1}, false, {}},            // slot 1 in two runs
      {{0, 6, 9, 13}, {2, -1, 2}, false, {}},          // base rows
      {{0, 5, 10}, {1, 2}, false, {}},                 // equal lengths: the identity
  };
  for (const auto& [seg_begin, seg_slot, want_ragged, want_ends] : cases) {
    SlotBank bank = GroupedCase::MakeBank();
    EXPECT_FALSE(bank.Group(TargetGroup::kAttn, seg_begin, seg_slot).ragged);  // off on the CPU by default
    bank.AllowRagged(true);
    const LoraGroups r = bank.Group(TargetGroup::kAttn, seg_begin, seg_slot);
    EXPECT_EQ(r.ragged, want_ragged) << seg_slot.size();
    EXPECT_EQ(r.ends_host, want_ends);
    if (!r.ragged) continue;
    EXPECT_TRUE(at::equal(r.ends, at::tensor(std::vector<int32_t>(want_ends.begin(), want_ends.end()), at::kInt)));
    for (int64_t u = 0, row = 0; u < r.num_slots(); ++u)
      for (; row < want_ends[u]; ++row) EXPECT_EQ(r.row_scale[row][0].item<float>(), r.scale[u][0][0].item<float>());

    // Through GroupedDelta over cast factors (the ragged rows take the
    // joint node of one target) against the segment form.
    const int64_t T = seg_begin.back();
    at::manual_seed(43);
    std::vector<at::Tensor> xs, gys;
    for (const auto& [m, g, d_in, d_out, experts, per_expert, interleaved, a_shard, b_shard] : SmallTargets()) {
      xs.push_back(at::randn({T, d_in}));
      gys.push_back(at::randn({T, d_out}));
    }
    SlotBank want_bank = GroupedCase::MakeBank();
    const FormResult want = RunForm(false, want_bank, seg_begin, seg_slot, xs, gys);
    const FormResult got = RunForm(true, bank, seg_begin, seg_slot, xs, gys, /*cast=*/true);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_GT(want.grad_a[i].abs().max().item<double>(), 1e-2);
      EXPECT_LT(RelErr(got.out[i], want.out[i]), 1e-5) << "delta " << i;
      EXPECT_LT(RelErr(got.grad_x[i], want.grad_x[i]), 1e-5) << "grad x " << i;
      EXPECT_LT(RelErr(got.grad_a[i], want.grad_a[i]), 1e-5) << "grad A " << i;
      EXPECT_LT(RelErr(got.grad_b[i], want.grad_b[i]), 1e-5) << "grad B " << i;
    }
  }

  // The joint node of two targets and the projected node, ragged against
  // the padded order over the same rows.
  const std::vector<LoraTargetSpec> targets = {{"model.layers.0.self_attn.q_proj", TargetGroup::kAttn, 16, 24},
                                               {"model.layers.0.self_attn.k_proj", TargetGroup::kAttn, 16, 8}};
  const std::vector<int64_t> seg_begin = {0, 4, 11, 13};
  const std::vector<int> seg_slot = {2, 0, 1};
  at::manual_seed(44);
  const at::Tensor x0 = at::randn({13, 16}), gy = at::randn({13, 32});
  const at::Tensor w = at::randn({32, 16}) * 0.2, bias = at::randn({32});
  for (const bool projected : {false, true}) {
    FormResult got[2];
    for (int ragged = 0; ragged < 2; ++ragged) {
      SlotBank bank = GroupedCase::MakeBank(targets);
      bank.AllowRagged(ragged == 1);
      const at::Tensor x = x0.clone().requires_grad_();
      const LoraGroups groups = bank.Group(TargetGroup::kAttn, seg_begin, seg_slot);
      ASSERT_EQ(groups.ragged, ragged == 1);
      const PassFactors pass = bank.PassGroup(TargetGroup::kAttn, groups.slots, bank.ComputeType(x), /*grads=*/true);
      const LoraTarget &q = bank.targets()[0], &k = bank.targets()[1];
      const std::vector<JointTarget> joint = {bank.CastFactors(q, pass), bank.CastFactors(k, pass)};
      const at::Tensor y =
          projected && ragged ? ProjectedJointLora(x, w, bias, joint, groups, pass.token)
                              : at::linear(x, w, bias) * (projected ? 1 : 0) +
                                    JointGroupedLoraDelta(x, joint, groups, bank.ComputeType(x), pass.token);
      (y * gy).sum().backward();
      got[ragged] = {{y.detach()}, {x.grad()}, {q.A.grad().clone(), k.A.grad().clone()},
                     {q.B.grad().clone(), k.B.grad().clone()}};
    }
    EXPECT_LT(RelErr(got[1].out[0], got[0].out[0]), 1e-6) << projected;
    EXPECT_LT(RelErr(got[1].grad_x[0], got[0].grad_x[0]), 1e-6) << projected;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_GT(got[0].grad_a[i].abs().max().item<double>(), 1e-2) << i;
      EXPECT_LT(RelErr(got[1].grad_a[i], got[0].grad_a[i]), 1e-6) << projected << " " << i;
      EXPECT_LT(RelErr(got[1].grad_b[i], got[0].grad_b[i]), 1e-6) << projected << " " << i;
    }
  }
}

// On CUDA in bf16 the ragged rows run through at::_grouped_mm (both the
// rows' products and the factors' per-group sums): against the padded
// order's batched GEMMs in bf16 and an fp32 reference, at the trainer's
// shapes (widths that are multiples of 8, rank 32, unequal groups).
TEST(SlotBank, RaggedGroupedGemmsOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const std::vector<LoraTargetSpec> targets = {{"model.layers.0.self_attn.q_proj", TargetGroup::kAttn, 256, 512},
                                               {"model.layers.0.self_attn.k_proj", TargetGroup::kAttn, 256, 128}};
  const std::vector<int64_t> seg_begin = {0, 300, 357, 1000, 1100, 1537};
  const std::vector<int> seg_slot = {3, 0, 1, 1, 2};
  const int64_t T = seg_begin.back();
  at::manual_seed(45);
  const at::Tensor x0 = at::randn({T, 256}), gy = at::randn({T, 640}) * 0.1;
  const at::Tensor w = at::randn({640, 256}) * 0.05;
  // 0: fp32 reference (padded), 1: bf16 padded, 2: bf16 ragged.
  FormResult got[3];
  for (int run = 0; run < 3; ++run) {
    const at::ScalarType dt = run == 0 ? at::kFloat : at::kBFloat16;
    SlotBank bank(4, 32, at::kCUDA, targets);
    bank.AllowRagged(run == 2);
    const auto rank = [](int s) { return s == 1 ? 16 : 32; };
    for (int s = 0; s < 4; ++s) ASSERT_TRUE(bank.Bind(s, Config(rank(s), 64.0, 10 + s)).ok());
    {
      c10::NoGradGuard no_grad;
      at::manual_seed(46);
      for (auto& t : bank.targets())
        for (int s = 0; s < 4; ++s) t.B.select(0, s).narrow(1, 0, rank(s)).normal_(0.0, 0.05);
    }
    const auto cuda = [&](const at::Tensor& t) { return t.to(at::kCUDA).to(dt); };
    const at::Tensor x = cuda(x0).requires_grad_();
    const LoraGroups groups = bank.Group(TargetGroup::kAttn, seg_begin, seg_slot);
    ASSERT_EQ(groups.ragged, run == 2);
    const PassFactors pass = bank.PassGroup(TargetGroup::kAttn, groups.slots, bank.ComputeType(x), /*grads=*/true);
    const LoraTarget &q = bank.targets()[0], &k = bank.targets()[1];
    const std::vector<JointTarget> joint = {bank.CastFactors(q, pass), bank.CastFactors(k, pass)};
    const at::Tensor y = run == 2 ? ProjectedJointLora(x, cuda(w), at::Tensor(), joint, groups, pass.token)
                                  : at::linear(x, cuda(w)) +
                                        JointGroupedLoraDelta(x, joint, groups, bank.ComputeType(x), pass.token);
    (y.to(at::kFloat) * gy.to(at::kCUDA)).sum().backward();
    got[run] = {{y.detach().to(at::kFloat).cpu()}, {x.grad().to(at::kFloat).cpu()},
                {q.A.grad().cpu(), k.A.grad().cpu()}, {q.B.grad().cpu(), k.B.grad().cpu()}};
  }
  const auto report = [&](const char* what, double padded, double ragged) {
    std::cout << "[ ragged bf16 ] " << what << ": padded bf16 " << padded << ", ragged bf16 " << ragged
              << " (max rel. err. against fp32)\n";
    EXPECT_LT(ragged, 2e-2) << what;
    EXPECT_LT(ragged, 2 * padded + 1e-3) << what;  // no worse than the padded order's rounding
  };
  report("output", RelErr(got[1].out[0], got[0].out[0]), RelErr(got[2].out[0], got[0].out[0]));
  report("grad x", RelErr(got[1].grad_x[0], got[0].grad_x[0]), RelErr(got[2].grad_x[0], got[0].grad_x[0]));
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_GT(got[0].grad_a[i].abs().max().item<double>(), 1e-2) << i;
    report("grad A", RelErr(got[1].grad_a[i], got[0].grad_a[i]), RelErr(got[2].grad_a[i], got[0].grad_a[i]));
    report("grad B", RelErr(got[1].grad_b[i], got[0].grad_b[i]), RelErr(got[2].grad_b[i], got[0].grad_b[i]));
    // Slot 1's rank is 16: its rows and columns past it get no gradient.
    EXPECT_EQ(got[2].grad_a[i][1].narrow(0, 16, 16).abs().max().item<double>(), 0.0);
    EXPECT_EQ(got[2].grad_b[i][1].narrow(1, 16, 16).abs().max().item<double>(), 0.0);
  }
}

// The grouped GEMMs keep a slot's non-finite factors to its own rows: with
// slot 3's A holding inf and its B NaN, the other slots' outputs, x's
// gradient on their rows and their factors' gradients are those of a run
// where slot 3 is finite, bit for bit (the isolation table's ragged row,
// reliability.md, on the GPU's kernels).
TEST(SlotBank, RaggedGroupedGemmsKeepAPoisonedSlotToItsRows) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const std::vector<LoraTargetSpec> targets = {{"model.layers.0.self_attn.q_proj", TargetGroup::kAttn, 256, 512},
                                               {"model.layers.0.self_attn.k_proj", TargetGroup::kAttn, 256, 128}};
  const std::vector<int64_t> seg_begin = {0, 300, 357, 1000, 1100, 1537};
  const std::vector<int> seg_slot = {3, 0, 1, 1, 2};  // slot 3 holds rows 0-299
  at::manual_seed(47);
  const at::Tensor x0 = at::randn({1537, 256}).to(at::kCUDA).to(at::kBFloat16);
  const at::Tensor gy = at::randn({1537, 640}).to(at::kCUDA) * 0.1;
  const at::Tensor w = (at::randn({640, 256}) * 0.05).to(at::kCUDA).to(at::kBFloat16);
  FormResult got[2];
  for (int poison = 0; poison < 2; ++poison) {
    SlotBank bank(4, 32, at::kCUDA, targets);
    for (int s = 0; s < 4; ++s) ASSERT_TRUE(bank.Bind(s, Config(32, 64.0, 10 + s)).ok());
    {
      c10::NoGradGuard no_grad;
      at::manual_seed(48);
      for (auto& t : bank.targets())
        for (int s = 0; s < 4; ++s) t.B.select(0, s).normal_(0.0, 0.05);
      if (poison)
        for (auto& t : bank.targets()) {
          t.A.select(0, 3).narrow(0, 0, 8).fill_(std::numeric_limits<float>::infinity());
          t.B.select(0, 3).narrow(1, 8, 8).fill_(std::numeric_limits<float>::quiet_NaN());
        }
    }
    const at::Tensor x = x0.clone().requires_grad_();
    const LoraGroups groups = bank.Group(TargetGroup::kAttn, seg_begin, seg_slot);
    ASSERT_TRUE(groups.ragged);
    const PassFactors pass = bank.PassGroup(TargetGroup::kAttn, groups.slots, bank.ComputeType(x), /*grads=*/true);
    const LoraTarget &q = bank.targets()[0], &k = bank.targets()[1];
    const at::Tensor y = ProjectedJointLora(x, w, at::Tensor(), {bank.CastFactors(q, pass), bank.CastFactors(k, pass)},
                                            groups, pass.token);
    y.backward(gy.to(y.scalar_type()));
    got[poison] = {{y.detach().to(at::kFloat).cpu()}, {x.grad().to(at::kFloat).cpu()},
                   {q.A.grad().cpu(), k.A.grad().cpu()}, {q.B.grad().cpu(), k.B.grad().cpu()}};
  }
  const auto same = [](const at::Tensor& a, const at::Tensor& b) { return at::equal(a, b); };
  EXPECT_FALSE(got[1].out[0].narrow(0, 0, 300).isfinite().all().item<bool>());  // the poison took
  EXPECT_TRUE(got[1].out[0].narrow(0, 300, 1237).isfinite().all().item<bool>());
  EXPECT_TRUE(same(got[1].out[0].narrow(0, 300, 1237), got[0].out[0].narrow(0, 300, 1237)));
  EXPECT_TRUE(same(got[1].grad_x[0].narrow(0, 300, 1237), got[0].grad_x[0].narrow(0, 300, 1237)));
  for (size_t i = 0; i < 2; ++i)
    for (int s : {0, 1, 2}) {
      EXPECT_TRUE(same(got[1].grad_a[i][s], got[0].grad_a[i][s])) << "target " << i << " slot " << s;
      EXPECT_TRUE(same(got[1].grad_b[i][s], got[0].grad_b[i][s])) << "target " << i << " slot " << s;
    }
}

// The row copies of PassGroup and the gradient flush (slot_rows.h): on CUDA
// one kernel each, which must give the ATen ops' bits, for the 16-byte path
// (aligned columns) and the element-wise one (an odd column offset), and
// add a repeated slot's rows without losing any (a race did, at first).
TEST(SlotRows, CudaKernelsGiveTheAtenOpsBits) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  const at::Tensor flat = at::randn({7, 1030}, f32);
  const at::Tensor slots = at::tensor(std::vector<int64_t>{5, 0, 3}, at::TensorOptions().dtype(at::kLong)).to(at::kCUDA);
  for (const auto& [begin, len] : {std::pair<int64_t, int64_t>{4, 1024}, {1, 1021}}) {
    const at::Tensor cols = flat.narrow(1, begin, len);
    for (at::ScalarType ct : {at::kBFloat16, at::kFloat}) {
      const at::Tensor got = GatherSlotRows(cols, slots, ct);
      const at::Tensor want = cols.index_select(0, slots).to(ct);
      EXPECT_TRUE(at::equal(got, want)) << "gather " << begin << " " << ct;
      const at::Tensor rows = at::randn({3, len}, f32).to(ct);
      at::Tensor into = flat.clone(), ref = flat.clone();
      AddSlotRows(into.narrow(1, begin, len), slots, rows);
      ref.narrow(1, begin, len).index_add_(0, slots, rows.to(at::kFloat));
      EXPECT_TRUE(at::equal(into, ref)) << "add " << begin << " " << ct;
      // A repeated slot (the uniform layout's sequences of one slot): its
      // rows add in turn, as a sequential sum gives them.
      const at::Tensor repeated = at::tensor(std::vector<int64_t>{5, 0, 5}, at::kLong).to(at::kCUDA);
      into = flat.clone();
      ref = flat.clone();
      AddSlotRows(into.narrow(1, begin, len), repeated, rows);
      for (int64_t u = 0; u < 3; ++u)
        ref.narrow(1, begin, len).select(0, repeated[u].item<int64_t>()).add_(rows.select(0, u).to(at::kFloat));
      EXPECT_TRUE(at::equal(into, ref)) << "repeated add " << begin << " " << ct;
    }
  }
}

}  // namespace
}  // namespace loom::engine
