// MoE block (engine/model/moe.h): the grouped forward with per-slot expert
// LoRA against a token-by-token reference, values and gradients (into the
// hidden rows through the frozen router too, and into the bank's shared and
// per-expert factors); the sampler's cached forward of an MoE model against
// the trainer's; expert adapters through PEFT files.
#include "engine/model/moe.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/io/peft.h"
#include "engine/io/safetensors.h"
#include "engine/io/tensor_io.h"
#include "../common/temp_dir.h"
#include "cached_check.h"
#include "engine/model/cached_batch.h"
#include "testmodel/make_model.h"
#include "tiny_model.h"

namespace loom::engine {
namespace {

constexpr int64_t kE = 4, kH = 16, kI = 6, kR = 4;

std::vector<LoraTargetSpec> ExpertTargets(int64_t E = kE, int64_t H = kH, int64_t I = kI) {
  return {{"model.layers.0.mlp.experts.gate_up_proj", TargetGroup::kMlp, H, 2 * I, E, ExpertFactor::kB},
          {"model.layers.0.mlp.experts.down_proj", TargetGroup::kMlp, I, H, E, ExpertFactor::kA}};
}

MoeWeights RandomMoe(bool norm_topk) {
  at::manual_seed(3);
  MoeWeights w;
  w.router = at::randn({kE, kH});
  w.gate_up = 0.4 * at::randn({kE, 2 * kI, kH});
  w.down = 0.4 * at::randn({kE, kH, kI});
  w.top_k = 2;
  w.norm_topk = norm_topk;
  return w;
}

// One token's output, written out: probabilities over every expert, the
// top k (renormalised or not), each chosen expert's SwiGLU with its slot's
// LoRA (gate_up: B_e A, down: B A_e) at scale alpha/r.
at::Tensor ReferenceToken(const MoeWeights& w, const at::Tensor& h, const SlotBank& bank, int slot) {
  const LoraTarget& gu = bank.targets()[0];
  const LoraTarget& dn = bank.targets()[1];
  const at::Tensor probs = at::softmax(at::matmul(w.router, h), 0);
  const auto [top_p, top_e] = probs.topk(w.top_k);
  const at::Tensor weights = w.norm_topk ? top_p / top_p.sum() : top_p;
  at::Tensor out = at::zeros({kH});
  for (int64_t k = 0; k < w.top_k; ++k) {
    const int64_t e = top_e[k].item<int64_t>();
    at::Tensor g_u = at::matmul(w.gate_up[e], h);
    if (slot >= 0) {
      const double s = bank.scales()[slot].item<double>();
      g_u = g_u + s * at::matmul(gu.B[slot][e], at::matmul(gu.A[slot], h));
    }
    const at::Tensor g = g_u.narrow(0, 0, kI), u = g_u.narrow(0, kI, kI);
    const at::Tensor act = g * at::sigmoid(g) * u;
    at::Tensor y = at::matmul(w.down[e], act);
    if (slot >= 0) {
      const double s = bank.scales()[slot].item<double>();
      y = y + s * at::matmul(dn.B[slot], at::matmul(dn.A[slot][e], act));
    }
    out = out + weights[k] * y;
  }
  return out;
}

class MoeBlock : public ::testing::TestWithParam<bool> {
 protected:
  // Slots 0 (rank 4) and 2 (rank 2) bound, 1 not; sequences of slots 2,
  // none, 0, 2 (slot 2's runs apart), 20 tokens in all.
  MoeBlock() : bank(3, kR, at::kCPU, ExpertTargets()) {
    BindRandom(bank, 0, 4, 8.0, 11, 0.5);
    BindRandom(bank, 2, 2, 4.0, 12, 0.5);
  }
  SlotBank bank;
  const std::vector<int64_t> seq_begin = {0, 5, 9, 15, 20};
  const std::vector<int> seq_slot = {2, -1, 0, 2};
};

TEST_P(MoeBlock, GroupedForwardAndGradientsMatchTokenByToken) {
  const MoeWeights w = RandomMoe(GetParam());
  at::manual_seed(5);
  const at::Tensor h0 = at::randn({20, kH});
  const at::Tensor dy = at::randn({20, kH});

  at::Tensor h = h0.clone().requires_grad_();
  const ExpertLoraRouting routing = ExpertLoraRouting::Make(bank, seq_begin, seq_slot, at::kCPU);
  ASSERT_EQ(routing.num_slots(), 2);
  const at::Tensor got = MoeForward(w, h, bank, &bank.targets()[0], &bank.targets()[1], &routing);
  (got * dy).sum().backward();
  const at::Tensor got_dh = h.grad().clone();
  const at::Tensor got_flat = bank.flat_grad().clone();
  bank.flat_grad().zero_();

  at::Tensor hr = h0.clone().requires_grad_();
  std::vector<at::Tensor> rows;
  for (size_t i = 0; i + 1 < seq_begin.size(); ++i)
    for (int64_t t = seq_begin[i]; t < seq_begin[i + 1]; ++t) rows.push_back(ReferenceToken(w, hr[t], bank, seq_slot[i]));
  const at::Tensor want = at::stack(rows);
  (want * dy).sum().backward();

  EXPECT_LT(MaxDiff(got, want), 1e-5);
  EXPECT_LT(RelDiff(got_dh, hr.grad()), 1e-5);  // through the routing weights too
  EXPECT_LT(RelDiff(got_flat, bank.flat_grad()), 1e-5);
  // The slots that ran got gradients in every factor, beyond their rank none,
  // the unbound slot none at all.
  for (const LoraTarget& t : bank.targets()) {
    EXPECT_GT(t.A.grad()[2].abs().max().item<double>(), 0.0) << t.module;
    EXPECT_GT(t.B.grad()[0].abs().max().item<double>(), 0.0) << t.module;
    EXPECT_EQ(t.A.grad()[2].narrow(-2, 2, 2).abs().max().item<double>(), 0.0) << t.module;
  }
  EXPECT_EQ(got_flat[1].abs().max().item<double>(), 0.0);
}

TEST_P(MoeBlock, RoutesDependOnlyOnTheTokenAndBaseRowsIgnorePoisonedSlots) {
  const MoeWeights w = RandomMoe(GetParam());
  at::manual_seed(6);
  const at::Tensor h = at::randn({9, kH});
  c10::NoGradGuard no_grad;
  const auto run = [&](const std::vector<int64_t>& begin, const std::vector<int>& slot, const at::Tensor& x) {
    const ExpertLoraRouting r = ExpertLoraRouting::Make(bank, begin, slot, at::kCPU);
    return MoeForward(w, x, bank, &bank.targets()[0], &bank.targets()[1], &r);
  };
  const at::Tensor together = run({0, 4, 9}, {-1, 0}, h);
  // Alone or beside another tenant: the same routes, the same values up to
  // the rounding of expert segments of other sizes.
  EXPECT_LT(RelDiff(together.narrow(0, 0, 4), run({0, 4}, {-1}, h.narrow(0, 0, 4))), 1e-6);
  EXPECT_LT(RelDiff(together.narrow(0, 4, 5), run({0, 5}, {0}, h.narrow(0, 4, 5))), 1e-6);
  // A slot whose factors hold NaN leaves the base rows beside it exact.
  for (LoraTarget& t : bank.targets()) t.B.select(0, 0).fill_(std::nan(""));
  EXPECT_TRUE(at::equal(run({0, 4, 9}, {-1, 0}, h).narrow(0, 0, 4), together.narrow(0, 0, 4)));
}

// The pair form (each pair gathers its own factors; no host read), which the
// sampler takes for few rows: the same values as the token-by-token
// reference, from the batch's routing or from per-row slots on the device,
// and a poisoned slot still leaves the rows beside it exact.
TEST_P(MoeBlock, ThePairFormMatchesTokenByToken) {
  const MoeWeights w = RandomMoe(GetParam());
  at::manual_seed(5);
  const at::Tensor h = at::randn({20, kH});
  std::vector<int32_t> row_slot;
  for (size_t i = 0; i + 1 < seq_begin.size(); ++i)
    for (int64_t t = seq_begin[i]; t < seq_begin[i + 1]; ++t) row_slot.push_back(seq_slot[i]);
  c10::NoGradGuard no_grad;
  EXPECT_TRUE(PairFormFits(20 * w.top_k, at::kCPU));
  EXPECT_FALSE(PairFormFits(kPairFormMaxPairsCpu + 1, at::kCPU));
  const ExpertLoraRouting routing = ExpertLoraRouting::Make(bank, seq_begin, seq_slot, at::kCPU);
  const at::Tensor from_routing = MoeForward(w, h, bank, &bank.targets()[0], &bank.targets()[1], routing.rows);
  const ExpertLoraRows rows = ExpertLoraRows::FromSlots(bank, at::tensor(row_slot, at::kInt));
  const at::Tensor from_slots = MoeForward(w, h, bank, &bank.targets()[0], &bank.targets()[1], rows);
  std::vector<at::Tensor> want;
  for (int64_t t = 0; t < 20; ++t) want.push_back(ReferenceToken(w, h[t], bank, row_slot[static_cast<size_t>(t)]));
  EXPECT_LT(MaxDiff(from_routing, at::stack(want)), 1e-5);
  EXPECT_LT(MaxDiff(from_slots, at::stack(want)), 1e-5);
  // The factors gathered in runs of 3 pairs (the last run shorter): the same.
  ExpertLoraRows in_runs = rows;
  in_runs.run_bytes = 3 * 2 * kI * kR * static_cast<int64_t>(sizeof(float));
  EXPECT_LT(MaxDiff(MoeForward(w, h, bank, &bank.targets()[0], &bank.targets()[1], in_runs), at::stack(want)), 1e-5);
  // pair_gemv needs the CUDA kernels: on the CPU the block is the same.
  EXPECT_FALSE(PairGemvApplies(w, h.narrow(0, 0, 2)));
  EXPECT_TRUE(at::equal(MoeForward(w, h, bank, &bank.targets()[0], &bank.targets()[1], rows, true), from_slots));
  // The base block alone (undefined rows) is the block without LoRA.
  EXPECT_TRUE(at::equal(MoeForward(w, h, bank, &bank.targets()[0], &bank.targets()[1], ExpertLoraRows{}),
                        MoeForward(w, h, bank, nullptr, nullptr, nullptr)));
  // Slot 0 poisoned: the rows of slot 2 and of no slot stay as they were.
  for (LoraTarget& t : bank.targets()) t.A.select(0, 0).fill_(std::nan(""));
  const at::Tensor poisoned = MoeForward(w, h, bank, &bank.targets()[0], &bank.targets()[1], rows);
  EXPECT_TRUE(at::equal(poisoned.narrow(0, 0, 9), from_slots.narrow(0, 0, 9)));
  EXPECT_TRUE(at::equal(poisoned.narrow(0, 15, 5), from_slots.narrow(0, 15, 5)));
  EXPECT_TRUE(at::isnan(poisoned.narrow(0, 9, 6)).any().item<bool>());
}

INSTANTIATE_TEST_SUITE_P(NormTopK, MoeBlock, ::testing::Values(true, false));

// The sampler's cached forward (prefill, then one decode step) gives an MoE
// model's adapter rows the trainer's hidden states.
TEST(MoeModel, CachedForwardMatchesTheTrainer) {
  auto model = Tiny("qwen3_moe");
  auto bank = Bank(*model, 2, 4);
  BindRandom(*bank, 1, 4, 8.0, 21);
  const std::vector<int32_t> seq = Seq(9, 4);
  c10::NoGradGuard no_grad;
  const PackedBatch full = PackedBatch::Make({seq}, {1}, at::kCPU);
  const at::Tensor want = model->Hidden(full, *bank);

  const ModelConfig& c = model->config();
  KvCache cache = KvCache::Allocate(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim, at::kCPU, at::kFloat);
  const auto longs = [](std::vector<int64_t> v) { return at::tensor(v, at::TensorOptions().dtype(at::kLong)); };
  CachedBatch prefill;
  prefill.tokens = longs(std::vector<int64_t>(seq.begin(), seq.end() - 1));
  prefill.positions = at::arange(8, at::TensorOptions().dtype(at::kLong));
  prefill.seq_begin = {0, 8};
  prefill.seq_slot = {1};
  prefill.write_rows = at::arange(8, at::TensorOptions().dtype(at::kLong));
  prefill.prefill = true;
  EXPECT_LT(MaxDiff(model->ForwardCached(prefill, cache, *bank), want.narrow(0, 0, 8)), 1e-5);
  CachedBatch decode;
  decode.tokens = longs({seq.back()});
  decode.positions = longs({8});
  decode.seq_begin = {0, 1};
  decode.seq_slot = {1};
  decode.write_rows = longs({8});
  decode.context_rows = at::arange(9, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  decode.context_mask = at::ones({1, 9}, at::TensorOptions().dtype(at::kBool));
  EXPECT_LT(MaxDiff(model->ForwardCached(decode, cache, *bank), want.narrow(0, 8, 1)), 1e-5);
}

// qwen3_moe's small preset (the CUDA decode graphs' test model): layer 1 is
// dense (mlp_only_layers) beside three MoE layers, and the sampler's cached
// forward (its steps of few rows in the pair form) matches the trainer's
// hidden states (the segment form).
TEST(MoeModel, SmallPresetsDenseLayerAndCachedForwardMatchTheTrainer) {
  test::TempDir dir("loom-moe-small");
  testmodel::MakeModelOptions o;
  o.arch = "qwen3_moe";
  o.preset = "small";
  o.seed = 3;
  ASSERT_TRUE(testmodel::MakeModel(o, dir.path()).ok());
  auto loaded = Transformer::Load(dir.path(), at::kCPU, at::kFloat);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  const Transformer& m = **loaded;
  EXPECT_FALSE(m.config().IsMoeLayer(1));
  for (int64_t l : {0, 2, 3}) EXPECT_TRUE(m.config().IsMoeLayer(l)) << l;
  auto bank = Bank(m, 3, 4);
  EXPECT_NE(bank->find("model.layers.1.mlp.gate_proj"), nullptr);
  EXPECT_EQ(bank->find("model.layers.1.mlp.experts.gate_up_proj"), nullptr);
  EXPECT_NE(bank->find("model.layers.2.mlp.experts.gate_up_proj"), nullptr);
  BindRandom(*bank, 1, 4, 8.0, 21);
  const std::vector<int32_t> seq = {5, 900, 17, 4000, 33, 8000, 2, 77, 1234, 64, 3210, 9};
  c10::NoGradGuard no_grad;
  const at::Tensor want = m.Hidden(PackedBatch::Make({seq}, {1}, at::kCPU), *bank);
  ExpectCachedForwardMatches(m, *bank, seq, 1, want, 1e-4);
}

// make-model --zero-experts (the whole model's shapes on a small disk):
// the model loads and runs to finite hidden states, which differ from the
// same seed's model with its experts (they are zero, not missing).
TEST(MoeModel, ZeroExpertsModelLoadsAndItsExpertsAddNothing) {
  test::TempDir plain("loom-moe-plain"), zero("loom-moe-zero");
  testmodel::MakeModelOptions o;
  o.arch = "qwen3_moe";
  o.preset = "tiny";
  o.seed = 4;
  ASSERT_TRUE(testmodel::MakeModel(o, plain.path()).ok());
  o.zero_experts = true;
  ASSERT_TRUE(testmodel::MakeModel(o, zero.path()).ok());
  auto a = Transformer::Load(plain.path(), at::kCPU, at::kFloat);
  auto b = Transformer::Load(zero.path(), at::kCPU, at::kFloat);
  ASSERT_TRUE(a.ok() && b.ok()) << b.status().message();
  auto bank = Bank(**b, 1, 4);
  const std::vector<int32_t> seq = {5, 90, 17, 200, 33, 80, 2, 77};  // within the tiny vocabulary
  c10::NoGradGuard no_grad;
  const at::Tensor got = (*b)->Hidden(PackedBatch::Make({seq}, {-1}, at::kCPU), *bank);
  EXPECT_TRUE(at::isfinite(got).all().item<bool>());
  const at::Tensor with_experts = (*a)->Hidden(PackedBatch::Make({seq}, {-1}, at::kCPU), *bank);
  EXPECT_GT(MaxDiff(got, with_experts), 1e-3) << "the plain model's experts must matter";
}

// On the GPU, bf16 with widths the grouped GEMM takes: the same block as the
// fp32 reference path on the CPU, values and gradients, to bf16 rounding.
TEST(MoeCuda, GroupedGemmMatchesTheCpuPath) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const int64_t E = 8, H = 64, I = 32, R = 8;
  const std::vector<LoraTargetSpec> targets = ExpertTargets(E, H, I);
  at::manual_seed(9);
  MoeWeights cpu;
  cpu.router = at::randn({E, H});
  cpu.gate_up = 0.2 * at::randn({E, 2 * I, H});
  cpu.down = 0.2 * at::randn({E, H, I});
  cpu.top_k = 2;
  cpu.norm_topk = true;
  MoeWeights gpu = cpu;
  for (at::Tensor* t : {&gpu.router, &gpu.gate_up, &gpu.down}) *t = t->to(at::kCUDA, at::kBFloat16);
  const at::Tensor h0 = at::randn({40, H}), dy = at::randn({40, H});
  const std::vector<int64_t> seq_begin = {0, 17, 25, 40};
  const std::vector<int> seq_slot = {1, -1, 0};
  const auto run = [&](const MoeWeights& w, at::Device dev, at::ScalarType dt, at::Tensor* dh, at::Tensor* dflat) {
    SlotBank bank(2, R, dev, targets);
    BindRandom(bank, 0, 8, 16.0, 1, 0.3);
    BindRandom(bank, 1, 4, 8.0, 2, 0.3);
    at::Tensor h = h0.to(dev, dt).detach().clone().requires_grad_();
    const ExpertLoraRouting r = ExpertLoraRouting::Make(bank, seq_begin, seq_slot, dev);
    const at::Tensor y = MoeForward(w, h, bank, &bank.targets()[0], &bank.targets()[1], &r);
    (y.to(at::kFloat) * dy.to(dev)).sum().backward();
    *dh = h.grad().to(at::kCPU, at::kFloat);
    *dflat = bank.flat_grad().cpu();
    return y.to(at::kCPU, at::kFloat);
  };
  at::Tensor dh_cpu, dh_gpu, g_cpu, g_gpu;
  const at::Tensor y_cpu = run(cpu, at::kCPU, at::kFloat, &dh_cpu, &g_cpu);
  const at::Tensor y_gpu = run(gpu, at::kCUDA, at::kBFloat16, &dh_gpu, &g_gpu);
  // Within bf16's rounding of the chain (relative to the reference's largest
  // entry); the router's logits (randn weights) are far from ties here, so
  // bf16 routes as fp32 does.
  EXPECT_LT(RelDiff(y_gpu, y_cpu), 0.05);
  EXPECT_LT(RelDiff(dh_gpu, dh_cpu), 0.05);
  EXPECT_LT(RelDiff(g_gpu, g_cpu), 0.05);
}

// The decode graphs' pair_gemv (each pair's expert projections as
// matrix-vector products) against the same block on the sorted pairs'
// grouped GEMMs: with and without the rows' expert LoRA, and with
// gpt_oss's biases and clamped SwiGLU; past 32 pairs it is the grouped path.
// Where PairGemvApplies the gemv path runs or throws (no silent fallback).
TEST(MoeCuda, PairGemvMatchesTheGroupedPairForm) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const int64_t E = 8, H = 64, I = 32, R = 8;
  at::manual_seed(21);
  MoeWeights w;
  w.router = at::randn({E, H}).to(at::kCUDA, at::kBFloat16);
  w.gate_up = (0.2 * at::randn({E, 2 * I, H})).to(at::kCUDA, at::kBFloat16);
  w.down = (0.2 * at::randn({E, H, I})).to(at::kCUDA, at::kBFloat16);
  w.top_k = 2;
  w.norm_topk = true;
  SlotBank bank(2, R, at::kCUDA, ExpertTargets(E, H, I));
  BindRandom(bank, 0, 8, 16.0, 1, 0.3);
  BindRandom(bank, 1, 4, 8.0, 2, 0.3);
  c10::NoGradGuard no_grad;
  const auto check = [&](const MoeWeights& m, int64_t T, const std::string& what) {
    const at::Tensor h = at::randn({T, H}).to(at::kCUDA, at::kBFloat16);
    std::vector<int32_t> slots;
    for (int64_t t = 0; t < T; ++t) slots.push_back(static_cast<int32_t>(t % 3) - 1);  // -1, 0, 1, ...
    const ExpertLoraRows rows = ExpertLoraRows::FromSlots(bank, at::tensor(slots, at::kInt).to(at::kCUDA));
    EXPECT_EQ(PairGemvApplies(m, h), T * m.top_k <= kPairGemvMaxPairs) << what << " T=" << T;
    for (const ExpertLoraRows& r : {rows, ExpertLoraRows{}}) {
      const at::Tensor want = MoeForward(m, h, bank, &bank.targets()[0], &bank.targets()[1], r, false);
      const at::Tensor got = MoeForward(m, h, bank, &bank.targets()[0], &bank.targets()[1], r, true);
      const std::string label = what + " T=" + std::to_string(T) + (r.defined() ? " lora" : " base");
      if (T * m.top_k > 32) {
        EXPECT_TRUE(at::equal(got, want)) << label;
      } else {
        EXPECT_LT(RelDiff(got.to(at::kFloat).cpu(), want.to(at::kFloat).cpu()), 0.02) << label;
      }
    }
  };
  for (int64_t T : {1, 4, 16, 20}) check(w, T, "qwen3_moe");
  MoeWeights biased = w;
  biased.gate_up_bias = (0.1 * at::randn({E, 2 * I})).to(at::kCUDA, at::kBFloat16);
  biased.down_bias = (0.1 * at::randn({E, H})).to(at::kCUDA, at::kBFloat16);
  biased.activation = MoeActivation::kClampedSwiGlu;
  biased.router_kind = MoeRouter::kTopKSoftmax;
  biased.router_bias = (0.1 * at::randn({E})).to(at::kCUDA, at::kBFloat16);
  for (int64_t T : {1, 3}) check(biased, T, "gpt_oss");
}

class MoePeft : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("loom_moe_peft_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(MoePeft, ExpertFactorsRoundTripInPeftsLayout) {
  auto model = Tiny("qwen3_moe");
  auto bank = Bank(*model, 2, 8);
  BindRandom(*bank, 0, 4, 16.0, 31);
  ASSERT_TRUE(SavePeft(*bank, 0, dir_.string(), "tiny").ok());

  std::ifstream in(dir_ / "adapter_config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  EXPECT_EQ(config["target_parameters"], nlohmann::json({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  auto file = SafetensorsFile::Open((dir_ / "adapter_model.safetensors").string());
  ASSERT_TRUE(file.ok());
  const int64_t H = 32, I = 12;
  const std::string p = "base_model.model.model.layers.1.mlp.experts.";
  // PEFT's ParamWrapper shapes: lora_A [E * r, in], lora_B [out, r * E].
  EXPECT_EQ((*file)->find(p + "base_layer.lora_A.weight")->shape, (std::vector<int64_t>{kE * 4, H}));
  EXPECT_EQ((*file)->find(p + "base_layer.lora_B.weight")->shape, (std::vector<int64_t>{2 * I, 4 * kE}));
  EXPECT_EQ((*file)->find(p + "lora_A.weight")->shape, (std::vector<int64_t>{kE * 4, I}));
  EXPECT_EQ((*file)->find(p + "lora_B.weight")->shape, (std::vector<int64_t>{H, 4 * kE}));

  auto other = Bank(*model, 2, 8);
  ASSERT_TRUE(LoadPeft(*other, 1, dir_.string()).ok());
  EXPECT_TRUE(at::equal(other->flat()[1], bank->flat()[0]));
}

TEST_F(MoePeft, AnAdapterWhoseSharedFactorDiffersBetweenExpertsIsRefused) {
  auto model = Tiny("qwen3_moe");
  auto bank = Bank(*model, 1, 8);
  BindRandom(*bank, 0, 4, 16.0, 31);
  ASSERT_TRUE(SavePeft(*bank, 0, dir_.string(), "tiny").ok());
  // Rewrite the file with one expert's copy of layer 0's shared gate_up A changed.
  const std::string path = (dir_ / "adapter_model.safetensors").string();
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  SafetensorsWriter writer;
  for (const auto& [name, view] : (*file)->tensors()) {
    at::Tensor t = LoadTensor(view, at::kFloat, at::kCPU).value();
    if (name == "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight") t[5][0] += 1.0;
    ASSERT_TRUE(AddTensor(writer, name, t).ok());
  }
  file->reset();
  ASSERT_TRUE(writer.WriteAtomic(path).ok());
  auto other = Bank(*model, 1, 8);
  const Status s = LoadPeft(*other, 0, dir_.string());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("lora_A of mlp.experts.gate_up_proj differs between experts"), std::string::npos)
      << s.message();
  EXPECT_FALSE(other->slot(0).bound);
}

}  // namespace
}  // namespace loom::engine
