// Parity with Hugging Face transformers + PEFT: loom's packed multi-adapter
// pass must give the logprobs and LoRA gradients that HF computes for each
// sequence alone under its PEFT adapter.
//
// The golden files come from tools/reference/make_golden.py (run on a machine
// with torch/transformers/peft; see tools/reference/README.md) and live in
// tests/golden/<arch>/. The base model is regenerated here by make-model from
// the identity recorded in batch.json, so only the small adapters and numbers
// are stored. Without golden files the golden tests skip.
#include <cstdio>
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/io/peft.h"
#include "../common/temp_dir.h"
#include "engine/lora/slot_bank.h"
#include "testmodel/make_model.h"
#include "engine/io/safetensors.h"
#include "engine/io/tensor_io.h"
#include "engine/model/transformer.h"

namespace loom::engine {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr double kLogprobAbsTol = 1e-4;  // per token
constexpr double kGradRelTol = 1e-3;     // max |g - ref| <= tol * max |ref|, per tensor

using TempDir = loom::test::TempDir;

fs::path SourceDir() {
  if (const char* env = std::getenv("LOOM_SOURCE_DIR")) return env;
#ifdef LOOM_SOURCE_DIR
  return LOOM_SOURCE_DIR;
#else
  return ".";
#endif
}

class ParityTest : public ::testing::TestWithParam<std::string> {};

// The real-shape presets have the parameter counts their model cards state
// (billions): total, without the embeddings, and
// activated per token for MoE (the non-expert weights plus k of E experts).
// The issue-21 families' cards state total and activated only, rounded
// (Kimi K2.5's "1T"), and count the embeddings in their activated figure
// differently (DeepSeek-V2-Lite's 2.4 B leaves the input embedding out,
// GLM-4.5-Air's 12 B both): theirs is checked to 3% of the total and, for
// activated, to lie between the count without either embedding and with both.
TEST(PresetShapes, MatchTheModelCards) {
  struct Card {
    const char* arch;
    const char* preset;
    double total, non_embedding, active;  // non_embedding 0: the card states none
  };
  for (const Card& card : {Card{"qwen2", "qwen2.5-0.5b", 0.49, 0.36, 0.49}, Card{"qwen3", "qwen3-4b", 4.0, 3.6, 4.0},
                           Card{"qwen3_moe", "qwen3-30b-a3b", 30.5, 29.9, 3.3},
                           Card{"deepseek_v2", "deepseek-v2-lite", 15.7, 0, 2.4},
                           Card{"deepseek_v2", "deepseek-v2", 236, 0, 21},
                           Card{"deepseek_v3", "deepseek-v3", 671, 0, 37},
                           Card{"deepseek_v3", "kimi-k2.5", 1000, 0, 32},
                           Card{"glm4_moe", "glm-4.5-air", 106, 0, 12},
                           Card{"gpt_oss", "gpt-oss-20b", 21, 0, 3.6}, Card{"gpt_oss", "gpt-oss-120b", 117, 0, 5.1},
                           Card{"mimo_v2_flash", "mimo-v2-flash", 309, 0, 15},
                           Card{"glm_moe_dsa", "glm-5.2", 744, 0, 40},
                           Card{"qwen3_5_moe_text", "qwen3.5-35b-a3b", 35, 0, 3}}) {
    auto cfg = testmodel::PresetConfig(card.arch, card.preset);
    ASSERT_TRUE(cfg.ok()) << card.preset;
    const ModelConfig& c = cfg.value();
    double total = 0, embedding = 0, experts = 0;
    for (const auto& [name, shape] : Transformer::ExpectedWeights(c)) {
      double n = 1;
      for (int64_t d : shape) n *= static_cast<double>(d);
      total += n;
      if (name == "model.embed_tokens.weight" || name == "lm_head.weight") embedding += n;
      if (name.find(".mlp.experts.") != std::string::npos) experts += n;
    }
    const double active =
        total - experts + (c.num_experts > 0 ? experts * c.num_experts_per_tok / c.num_experts : 0.0);
    if (card.non_embedding == 0) {
      EXPECT_NEAR(total / 1e9, card.total, 0.03 * card.total) << card.preset;
      EXPECT_GE(card.active * 1.02, (active - embedding) / 1e9) << card.preset;
      EXPECT_LE(card.active * 0.98, active / 1e9) << card.preset;
      continue;
    }
    // Within the card's last digit (cards round some figures and cut others:
    // Qwen3-30B-A3B's 3.35 B activated is written 3.3).
    const double tol = card.total < 1 ? 0.006 : 0.06;
    EXPECT_NEAR(total / 1e9, card.total, tol) << card.preset;
    EXPECT_NEAR((total - embedding) / 1e9, card.non_embedding, tol) << card.preset;
    EXPECT_NEAR(active / 1e9, card.active, tol) << card.preset;
  }
}

// A made model round-trips through config.json and safetensors into the
// transformer and gives finite logprobs near uniform (HF init, std 0.02).
TEST_P(ParityTest, TransformerLoadsMadeModel) {
  TempDir dir;
  testmodel::MakeModelOptions o;
  o.arch = GetParam();
  o.preset = "tiny";
  o.seed = 4;
  ASSERT_TRUE(testmodel::MakeModel(o, dir.path()).ok());
  auto model = Transformer::Load(dir.path(), at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok()) << model.status().message();
  const ModelConfig& c = model.value()->config();
  EXPECT_EQ(c.model_type, GetParam());
  SlotBank bank(2, 4, at::kCPU, model.value()->LoraTargets());
  const PackedBatch batch = PackedBatch::Make({{1, 2, 3, 4}, {5, 6}}, {-1, -1}, at::kCPU);
  const at::Tensor hidden = model.value()->Hidden(batch, bank);
  const at::Tensor targets = at::tensor(std::vector<int64_t>{2, 3, 4, 5, 6, 7}, at::kLong);
  const at::Tensor lp = model.value()->TargetLogprobs(hidden, targets, batch, bank);
  ASSERT_EQ(lp.numel(), 6);
  EXPECT_TRUE(at::isfinite(lp).all().item<bool>());
  const double uniform = -std::log(static_cast<double>(c.vocab_size));
  EXPECT_LT((lp - uniform).abs().max().item<double>(), 1.0);
  EXPECT_GT((lp - uniform).abs().max().item<double>(), 1e-4);  // not constant: the weights were read
}

// Runs the golden batch on (device, dtype) and compares with HF+PEFT: the
// logprobs to lp_tol, and the gradients to grad_tol unless it is 0.
void RunGolden(const std::string& arch, at::Device dev, at::ScalarType dt, double lp_tol, double grad_tol) {
  const fs::path golden_dir = SourceDir() / "tests" / "golden" / arch;
  if (!fs::exists(golden_dir / "batch.json") || !fs::exists(golden_dir / "golden.safetensors")) {
    // Every family listed below has goldens in the tree: a missing one is a failure, not a skip.
    FAIL() << "no golden files in " << golden_dir << " (run tools/reference/make_golden.py)";
  }
  json batch_json;
  {
    std::ifstream in(golden_dir / "batch.json");
    batch_json = json::parse(in);
  }
  const json& ident = batch_json["model"];
  ASSERT_EQ(ident["arch"].get<std::string>(), arch);

  // The same base model the golden was computed on, regenerated bit-identically.
  TempDir model_dir;
  testmodel::MakeModelOptions o;
  o.arch = ident["arch"].get<std::string>();
  o.preset = ident["preset"].get<std::string>();
  o.seed = ident["seed"].get<uint64_t>();
  o.dtype = ident["dtype"].get<std::string>();
  ASSERT_TRUE(testmodel::MakeModel(o, model_dir.path()).ok());
  auto model = Transformer::Load(model_dir.path(), dev, dt);
  ASSERT_TRUE(model.ok()) << model.status().message();

  // One slot per adapter, loaded from the PEFT directories HF saved.
  int max_rank = 1;
  for (const auto& [name, a] : batch_json["adapters"].items()) max_rank = std::max(max_rank, a["r"].get<int>());
  const int num_slots = static_cast<int>(batch_json["adapters"].size()) + 1;
  SlotBank bank(num_slots, max_rank, dev, model.value()->LoraTargets());
  std::map<std::string, int> slot_of;
  int next_slot = 1;  // slot 0 stays unbound: its presence must not matter
  for (const auto& [name, a] : batch_json["adapters"].items()) {
    const int s = next_slot++;
    const Status st = LoadPeft(bank, s, (golden_dir / a["dir"].get<std::string>()).string());
    ASSERT_TRUE(st.ok()) << name << ": " << st.message();
    EXPECT_EQ(bank.slot(s).config.rank, a["r"].get<int>());
    slot_of[name] = s;
  }

  // All sequences in ONE packed pass.
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int> slots;
  std::vector<int64_t> targets;
  for (const json& s : batch_json["sequences"]) {
    seqs.push_back(s["tokens"].get<std::vector<int32_t>>());
    slots.push_back(slot_of.at(s["adapter"].get<std::string>()));
    const auto t = s["targets"].get<std::vector<int64_t>>();
    ASSERT_EQ(t.size(), seqs.back().size());
    targets.insert(targets.end(), t.begin(), t.end());
  }
  const PackedBatch batch = PackedBatch::Make(seqs, slots, dev);
  const at::Tensor hidden = model.value()->Hidden(batch, bank);
  const at::Tensor lp = model.value()->TargetLogprobs(hidden, at::tensor(targets, at::kLong).to(dev), batch, bank);
  ASSERT_EQ(lp.numel(), static_cast<int64_t>(targets.size()));

  auto golden = SafetensorsFile::Open((golden_dir / "golden.safetensors").string());
  ASSERT_TRUE(golden.ok()) << golden.status().message();
  const SafetensorsFile& g = *golden.value();
  double worst_lp = 0, worst_grad_rel = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const TensorView* v = g.find("seq" + std::to_string(i) + ".logprobs");
    ASSERT_NE(v, nullptr) << i;
    auto ref = LoadTensor(*v, at::kFloat, at::kCPU);
    ASSERT_TRUE(ref.ok());
    const at::Tensor got = lp.detach().cpu().narrow(0, batch.seq_begin[i], batch.seq_begin[i + 1] - batch.seq_begin[i]);
    ASSERT_EQ(got.numel(), ref->numel()) << "seq" << i;
    const double diff = (got - ref.value()).abs().max().item<double>();
    EXPECT_LE(diff, lp_tol) << "seq" << i << " logprobs differ from HF+PEFT by " << diff;
    worst_lp = std::max(worst_lp, diff);
  }

  if (grad_tol <= 0) {  // logprobs only
    std::printf("parity %s %s %s: max |logprob diff| %.3g (gradients not compared)\n", arch.c_str(), dev.str().c_str(),
                c10::toString(dt), worst_lp);
    return;
  }
  // Gradient of the summed cross-entropy into every adapter's A and B.
  (-lp.sum()).backward();
  const std::string prefix = "base_model.model.";
  int compared = 0;
  for (const auto& [name, s] : slot_of) {
    const int r = bank.slot(s).config.rank;
    const std::string gp = "grad." + name + "." + prefix;
    for (const auto& [key, view] : g.tensors()) {
      if (key.rfind(gp, 0) != 0) continue;
      std::string rest = key.substr(gp.size());  // <module>.lora_A.weight
      const bool is_a = rest.size() > 14 && rest.compare(rest.size() - 14, 14, ".lora_A.weight") == 0;
      const bool is_b = rest.size() > 14 && rest.compare(rest.size() - 14, 14, ".lora_B.weight") == 0;
      ASSERT_TRUE(is_a || is_b) << key;
      std::string module = rest.substr(0, rest.size() - 14);
      // PEFT's expert wrappers (io/peft.h): gate_up_proj under the inner
      // ".base_layer", down_proj the outer one on the experts module.
      const bool experts = module.size() > 12 && module.compare(module.size() - 12, 12, ".mlp.experts") == 0;
      const bool inner = module.size() > 23 && module.compare(module.size() - 23, 23, ".mlp.experts.base_layer") == 0;
      if (experts) module += ".down_proj";
      if (inner) module = module.substr(0, module.size() - 11) + ".gate_up_proj";
      const LoraTarget* t = bank.find(module);
      ASSERT_NE(t, nullptr) << "no bank target for " << module;
      auto ref = LoadTensor(view, at::kFloat, at::kCPU);
      ASSERT_TRUE(ref.ok());
      if (t->is_expert()) {
        // PEFT holds every expert's own A [E*r, in] (rows e*r+k) and B
        // [out, r*E] (columns k*E+e); the golden's shared factor was one
        // matrix copied into every expert, so its gradient in loom's shared
        // layout is the sum of the copies' gradients.
        const int64_t E = t->experts;
        // gpt_oss: PEFT's B rows interleave gate and up (HF row 2j is loom's
        // row j, 2j + 1 is row d_out/2 + j).
        const at::Tensor rows = !is_a && t->hf_interleaved
                                    ? at::cat({ref->slice(0, 0, t->d_out, 2), ref->slice(0, 1, t->d_out, 2)}, 0)
                                    : *ref;
        at::Tensor x = is_a ? rows.view({E, r, t->d_in}) : rows.reshape({t->d_out, r, E}).permute({2, 0, 1});
        const bool shared = t->per_expert != (is_a ? ExpertFactor::kA : ExpertFactor::kB);
        ref = shared ? x.sum(0) : x.contiguous();
      }
      const at::Tensor full = (is_a ? t->A.grad() : t->B.grad()).cpu();
      ASSERT_TRUE(full.defined()) << key << ": no gradient in the bank";
      const at::Tensor got = is_a ? full.select(0, s).narrow(-2, 0, r) : full.select(0, s).narrow(-1, 0, r);
      ASSERT_EQ(got.sizes(), ref->sizes()) << key;
      const double scale = ref->abs().max().item<double>();
      const double diff = (got - ref.value()).abs().max().item<double>();
      EXPECT_LE(diff, grad_tol * scale) << key << ": max diff " << diff << ", max |ref| " << scale;
      worst_grad_rel = std::max(worst_grad_rel, diff / scale);
      ++compared;
    }
  }
  // The figures docs/compatibility.md quotes.
  std::printf("parity %s %s %s: max |logprob diff| %.3g, max grad diff / max |ref grad| %.3g\n", arch.c_str(), dev.str().c_str(), c10::toString(dt), worst_lp,
              worst_grad_rel);
  ::testing::Test::RecordProperty("max_logprob_abs_diff", std::to_string(worst_lp));
  ::testing::Test::RecordProperty("max_grad_rel_diff", std::to_string(worst_grad_rel));
  // 3 adapters x every target (dense: 7 per layer, MoE: 6, + lm_head) x {A, B}.
  EXPECT_EQ(compared, static_cast<int>(slot_of.size() * 2 * bank.targets().size()));
  // The unbound slot got no gradient.
  for (const LoraTarget& t : bank.targets()) {
    if (t.A.grad().defined()) EXPECT_EQ(t.A.grad().select(0, 0).abs().max().item<double>(), 0.0) << t.module;
    if (t.B.grad().defined()) EXPECT_EQ(t.B.grad().select(0, 0).abs().max().item<double>(), 0.0) << t.module;
  }
}

// loom's PEFT snapshot of each golden adapter is PEFT's own file for it: the
// same keys, shapes and values (experts in ParamWrapper's layout, the shared
// factor written once per expert), and the same targets in adapter_config.
TEST_P(ParityTest, SnapshotOfAGoldenAdapterIsPeftsOwnFile) {
  const fs::path golden_dir = SourceDir() / "tests" / "golden" / GetParam();
  if (!fs::exists(golden_dir / "batch.json")) FAIL() << "no golden files in " << golden_dir;
  json batch_json;
  {
    std::ifstream in(golden_dir / "batch.json");
    batch_json = json::parse(in);
  }
  const json& ident = batch_json["model"];
  auto cfg = testmodel::PresetConfig(ident["arch"].get<std::string>(), ident["preset"].get<std::string>(),
                                     ident["dtype"].get<std::string>());
  ASSERT_TRUE(cfg.ok());
  auto model = Transformer::FromTensors(cfg.value(), [&] {
    std::map<std::string, at::Tensor> w;
    for (const auto& [name, shape] : Transformer::ExpectedWeights(cfg.value())) w[name] = at::zeros(shape);
    return w;
  }(), at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok()) << model.status().message();
  SlotBank bank(1, 64, at::kCPU, model.value()->LoraTargets());
  const auto targets = [](const json& c, const char* field) {
    std::set<std::string> s;
    if (c.contains(field) && c[field].is_array())
      for (const json& v : c[field]) s.insert(v.get<std::string>());
    return s;
  };
  for (const auto& [name, a] : batch_json["adapters"].items()) {
    const fs::path peft_dir = golden_dir / a["dir"].get<std::string>();
    ASSERT_TRUE(LoadPeft(bank, 0, peft_dir.string()).ok()) << name;
    TempDir ours;
    ASSERT_TRUE(SavePeft(bank, 0, ours.path(), "golden").ok()) << name;
    auto theirs_file = SafetensorsFile::Open((peft_dir / "adapter_model.safetensors").string());
    auto ours_file = SafetensorsFile::Open(ours.path() + "/adapter_model.safetensors");
    ASSERT_TRUE(theirs_file.ok() && ours_file.ok());
    ASSERT_EQ((*ours_file)->tensors().size(), (*theirs_file)->tensors().size()) << name;
    for (const auto& [key, view] : (*theirs_file)->tensors()) {
      const TensorView* mine = (*ours_file)->find(key);
      ASSERT_NE(mine, nullptr) << name << ": loom does not write " << key;
      ASSERT_EQ(mine->shape, view.shape) << key;
      EXPECT_TRUE(at::equal(LoadTensor(*mine, at::kFloat, at::kCPU).value(), LoadTensor(view, at::kFloat, at::kCPU).value()))
          << key;
    }
    std::ifstream theirs_in(peft_dir / "adapter_config.json"), ours_in(ours.path() + "/adapter_config.json");
    const json theirs = json::parse(theirs_in), mine = json::parse(ours_in);
    for (const char* field : {"target_modules", "target_parameters"})
      EXPECT_EQ(targets(mine, field), targets(theirs, field)) << name << " " << field;
    EXPECT_EQ(mine["r"], theirs["r"]);
    EXPECT_EQ(mine["lora_alpha"].get<double>(), theirs["lora_alpha"].get<double>());
  }
}

TEST_P(ParityTest, PackedMultiAdapterPassMatchesHuggingFacePeft) {
  RunGolden(GetParam(), at::kCPU, at::kFloat, kLogprobAbsTol, kGradRelTol);
}

// The same on the GPU (skipped without CUDA): fp32 with TF32 off must meet the
// CPU tolerances; bf16 base weights get the looser bound of bf16's 8-bit
// mantissa, and the printed figures go to docs/compatibility.md.
TEST_P(ParityTest, CudaPassMatchesHuggingFacePeft) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::globalContext().setAllowTF32CuBLAS(false);
  RunGolden(GetParam(), at::Device(at::kCUDA, 0), at::kFloat, kLogprobAbsTol, kGradRelTol);
  // In bf16 the tiny MoE routers' logits fall within rounding of each
  // other, so some tokens go to another expert than in HF's fp32 run: a real
  // change of the gradient, not an error (on the H200, gpt_oss's bf16
  // gradients were 1.1-5.5x the dense families' bound, its fp32 ones 1.7e-6).
  // MoE gradients are held to the fp32 runs; their bf16 logprobs still to
  // the bound.
  const std::string arch = GetParam();
  const bool moe = arch != "qwen2" && arch != "qwen3";
  // qwen3_5_moe_text's random tiny model is ill-conditioned (noise of 1e-7
  // on its embeddings moves its final hidden states by 4e-4): HF+PEFT's own
  // bf16 run lands 0.101 from this fp32 golden (tools/reference/
  // golden_drift.py, H200, session 23), against 0.0025 for qwen3 and 0.022
  // for glm_moe_dsa. loom's bf16 runs measured 1.3-2.4x HF's own drift on
  // those (0.0033, 0.053), 1.7x on this one (0.174): its bound is 2.5x HF's.
  const double lp_tol = arch == "qwen3_5_moe_text" ? 0.25 : 0.1;
  RunGolden(GetParam(), at::Device(at::kCUDA, 0), at::kBFloat16, lp_tol, moe ? 0.0 : 0.1);
}

INSTANTIATE_TEST_SUITE_P(Arch, ParityTest,
                         ::testing::Values("qwen2", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3",
                                           "glm4_moe", "mimo_v2_flash", "qwen3_5_moe_text", "glm_moe_dsa"));

}  // namespace
}  // namespace loom::engine
