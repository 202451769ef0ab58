// The two export layouts of a PEFT adapter (`loom export`):
//  - merged (engine/io/peft_merge.h): the merged model with no adapter gives
//    base+adapter's logprobs (fp32, 1e-4) for a dense model with tied
//    embeddings written in shards, qwen3_moe's per-expert tensors and
//    gpt_oss's fused interleaved experts; an adapter of another model is
//    refused naming the module, and nothing is written;
//  - vllm (engine/io/peft_vllm.h): a trained lm_head is refused unless
//    dropped; qwen3_moe experts become one plain LoRA per expert and
//    projection whose products are the expert's own.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/io/peft.h"
#include "engine/io/peft_merge.h"
#include "engine/io/peft_vllm.h"
#include "engine/io/safetensors.h"
#include "testmodel/make_model.h"
#include "tiny_model.h"

namespace loom::engine {
namespace {

namespace fs = std::filesystem;

class PeftExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    for (char& c : name) c = c == '/' ? '_' : c;
    dir_ = fs::temp_directory_path() / ("loom_peft_export_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The arch's tiny preset at dir_/name (sharded every shard_bytes) and a
  // rank-4 adapter of it with random B in every group, saved as PEFT files
  // at dir_/name-adapter and read back as loom export reads it.
  struct Made {
    std::string base_dir, adapter_dir;
    std::unique_ptr<Transformer> base;
    std::unique_ptr<SlotBank> bank;  // slot 0: the adapter
    PeftAdapter adapter;
  };
  Made Make(const std::string& arch, const std::string& name, uint64_t shard_bytes = 2000000000) {
    Made m;
    m.base_dir = (dir_ / name).string();
    m.adapter_dir = (dir_ / (name + "-adapter")).string();
    testmodel::MakeModelOptions opt;
    opt.arch = arch;
    opt.seed = 5;
    opt.shard_bytes = shard_bytes;
    EXPECT_TRUE(testmodel::MakeModel(opt, m.base_dir).ok());
    auto base = Transformer::Load(m.base_dir, at::kCPU, at::kFloat);
    EXPECT_TRUE(base.ok()) << base.status().message();
    m.base = std::move(*base);
    m.bank = Bank(*m.base, 1, 4);
    BindRandom(*m.bank, 0, 4, /*alpha=*/8.0, /*seed=*/11, /*b_scale=*/0.5);
    EXPECT_TRUE(SavePeft(*m.bank, 0, m.adapter_dir, "loom/test").ok());
    auto read = ReadPeft(*m.bank, m.adapter_dir);
    EXPECT_TRUE(read.ok()) << read.status().message();
    m.adapter = std::move(*read);
    return m;
  }

  static at::Tensor Logprobs(const Transformer& t, const SlotBank& bank, int slot) {
    c10::NoGradGuard no_grad;
    const std::vector<std::vector<int32_t>> seqs = {Seq(12, 1), Seq(9, 2)};
    const PackedBatch batch = PackedBatch::Make(seqs, {slot, slot}, at::kCPU);
    return t.TargetLogprobs(t.Hidden(batch, bank), NextTokens(seqs), batch, bank);
  }

  fs::path dir_;
};

class PeftMergeTest : public PeftExportTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(PeftMergeTest, MergedModelGivesTheAdaptersLogprobs) {
  const std::string arch = GetParam();
  // The dense preset in shards of ~100 kB: the index path, and the tied head
  // written as a tensor of its own.
  Made m = Make(arch, "base", arch == "qwen3" ? 100000 : 2000000000);
  const std::string merged_dir = (dir_ / "merged").string();
  const Status s = WriteMergedModel(m.base_dir, m.adapter, merged_dir);
  ASSERT_TRUE(s.ok()) << s.message();
  auto merged = Transformer::Load(merged_dir, at::kCPU, at::kFloat);
  ASSERT_TRUE(merged.ok()) << merged.status().message();
  SlotBank none(1, 4, at::kCPU, (*merged)->LoraTargets());

  const at::Tensor want = Logprobs(*m.base, *m.bank, 0);
  EXPECT_GT(MaxDiff(want, Logprobs(*m.base, *m.bank, -1)), 1e-2) << "the adapter must change the logprobs";
  EXPECT_LT(MaxDiff(Logprobs(**merged, none, -1), want), 1e-4);

  for (const auto& e : fs::directory_iterator(m.base_dir))  // config, tokenizer, index: all there
    EXPECT_TRUE(fs::exists(fs::path(merged_dir) / e.path().filename())) << e.path().filename();
  if (arch == "qwen3") {
    std::ifstream config(fs::path(merged_dir) / "config.json");
    EXPECT_FALSE(nlohmann::json::parse(config).value("tie_word_embeddings", true));
    std::ifstream index(fs::path(merged_dir) / "model.safetensors.index.json");
    EXPECT_TRUE(nlohmann::json::parse(index)["weight_map"].contains("lm_head.weight"));
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, PeftMergeTest, ::testing::Values("qwen3", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe", "mimo_v2_flash",
                                           "glm_moe_dsa", "qwen3_5_moe_text"));

TEST_F(PeftExportTest, MergeRefusesAnAdapterOfAnotherModelAndWritesNothing) {
  Made dense = Make("qwen3", "dense");
  Made moe = Make("qwen3_moe", "moe");
  const std::string out = (dir_ / "merged").string();
  const Status s = WriteMergedModel(moe.base_dir, dense.adapter, out);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("model.layers.0.mlp.gate_proj"), std::string::npos) << s.message();
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(PeftExportTest, VllmLayoutSplitsExpertsAndRefusesTheHeadUnlessDropped) {
  Made m = Make("qwen3_moe", "moe");
  auto refused = VllmLayout(m.adapter, /*drop_lm_head=*/false);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("lm_head"), std::string::npos) << refused.status().message();

  auto vllm = VllmLayout(m.adapter, /*drop_lm_head=*/true);
  ASSERT_TRUE(vllm.ok()) << vllm.status().message();
  EXPECT_FALSE(vllm->config.train_unembed);
  std::map<std::string, at::Tensor> delta;  // module -> B A
  for (const auto& f : vllm->factors) {
    ASSERT_EQ(f.A.dim(), 2) << f.module;
    ASSERT_EQ(f.B.dim(), 2) << f.module;
    delta[f.module] = f.B.matmul(f.A);
  }
  EXPECT_EQ(delta.count("lm_head"), 0u);
  const int64_t experts = 8, I = 32;  // the tiny preset's
  for (const auto& f : m.adapter.factors) {
    if (f.module == "lm_head") continue;
    if (f.A.dim() == 2 && f.B.dim() == 2) {
      EXPECT_TRUE(at::equal(delta.at(f.module), f.B.matmul(f.A))) << f.module;
      continue;
    }
    const std::string prefix = f.module.substr(0, f.module.rfind('.')) + ".";
    for (int64_t e = 0; e < experts; ++e) {
      const std::string expert = prefix + std::to_string(e) + ".";
      if (f.B.dim() == 3) {  // gate_up: rows gate then up
        const at::Tensor d = f.B[e].matmul(f.A);
        EXPECT_LT(MaxDiff(delta.at(expert + "gate_proj"), d.narrow(0, 0, I)), 1e-6) << expert;
        EXPECT_LT(MaxDiff(delta.at(expert + "up_proj"), d.narrow(0, I, I)), 1e-6) << expert;
      } else {
        EXPECT_LT(MaxDiff(delta.at(expert + "down_proj"), f.B.matmul(f.A[e])), 1e-6) << expert;
      }
    }
  }
  // Written as PEFT files: plain modules only, no target_parameters.
  const std::string out = (dir_ / "vllm").string();
  ASSERT_TRUE(WritePeft(*vllm, out, "loom/test").ok());
  std::ifstream in(fs::path(out) / "adapter_config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  EXPECT_TRUE(config["target_parameters"].is_null());
  const auto modules = config["target_modules"].get<std::vector<std::string>>();
  EXPECT_EQ(std::set<std::string>(modules.begin(), modules.end()),
            (std::set<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
  auto file = SafetensorsFile::Open((fs::path(out) / "adapter_model.safetensors").string());
  ASSERT_TRUE(file.ok());
  EXPECT_NE((*file)->find("base_model.model.model.layers.1.mlp.experts.7.up_proj.lora_B.weight"), nullptr);
}

}  // namespace
}  // namespace loom::engine
