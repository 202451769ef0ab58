// PEFT adapter directories: save -> load round trip, the in-memory copy and
// install, the file layout HF PEFT expects, and errors on bad directories.
#include "engine/io/peft.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/io/safetensors.h"

namespace loom::engine {
namespace {

namespace fs = std::filesystem;

std::vector<LoraTargetSpec> Targets() {
  std::vector<LoraTargetSpec> t;
  for (int i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    t.push_back({p + "self_attn.q_proj", TargetGroup::kAttn, 16, 16});
    t.push_back({p + "self_attn.k_proj", TargetGroup::kAttn, 16, 8});
    t.push_back({p + "self_attn.v_proj", TargetGroup::kAttn, 16, 8});
    t.push_back({p + "self_attn.o_proj", TargetGroup::kAttn, 16, 16});
    t.push_back({p + "mlp.gate_proj", TargetGroup::kMlp, 16, 24});
    t.push_back({p + "mlp.up_proj", TargetGroup::kMlp, 16, 24});
    t.push_back({p + "mlp.down_proj", TargetGroup::kMlp, 24, 16});
  }
  t.push_back({"lm_head", TargetGroup::kUnembed, 16, 40});
  return t;
}

class PeftTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("loom_peft_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Binds slot s and fills its used rows of A and B with random values.
  static void BindTrained(SlotBank& bank, int s, const LoraConfig& c) {
    ASSERT_TRUE(bank.Bind(s, c).ok());
    c10::NoGradGuard no_grad;
    for (auto& t : bank.targets()) {
      if (!bank.trains(s, t.group)) continue;
      t.B.select(0, s).narrow(1, 0, c.rank).copy_(at::randn({t.d_out, c.rank}));
    }
  }

  fs::path dir_;
};

TEST_F(PeftTest, RoundTripIsExactAndKeepsRowsBeyondRankZero) {
  at::manual_seed(3);
  SlotBank bank(3, 8, at::kCPU, Targets());
  LoraConfig c;
  c.rank = 5;
  c.alpha = 10;
  c.seed = 77;
  BindTrained(bank, 1, c);
  ASSERT_TRUE(SavePeft(bank, 1, dir_.string(), "Qwen/Qwen3-0.6B").ok());

  SlotBank other(4, 8, at::kCPU, Targets());
  LoraConfig junk;
  junk.rank = 8;
  BindTrained(other, 2, junk);  // a previous tenant's weights must not survive the load
  const Status s = LoadPeft(other, 2, dir_.string());
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(other.slot(2).config.rank, 5);
  EXPECT_DOUBLE_EQ(other.slot(2).config.alpha, 10.0);
  EXPECT_FLOAT_EQ(other.scales()[2].item<float>(), 2.0f);
  for (size_t i = 0; i < bank.targets().size(); ++i) {
    const LoraTarget& a = bank.targets()[i];
    const LoraTarget& b = other.targets()[i];
    EXPECT_TRUE(at::equal(a.A[1], b.A[2])) << a.module;
    EXPECT_TRUE(at::equal(a.B[1], b.B[2])) << a.module;
    EXPECT_EQ(b.A[2].narrow(0, 5, 3).abs().max().item<double>(), 0.0) << a.module << ": rows >= r";
    EXPECT_EQ(b.B[2].narrow(1, 5, 3).abs().max().item<double>(), 0.0) << a.module << ": cols >= r";
    EXPECT_GT(b.B[2].abs().max().item<double>(), 0.0) << a.module;
  }
}

// The in-memory way (CopyPeft -> InstallPeft) gives the slot the files'
// way (SavePeft -> LoadPeft) gives, bit for bit, and the copy does not
// follow later changes of its slot.
TEST_F(PeftTest, CopyAndInstallEqualSaveAndLoad) {
  at::manual_seed(5);
  SlotBank bank(2, 8, at::kCPU, Targets());
  LoraConfig c;
  c.rank = 5;
  c.alpha = 10;
  c.train_unembed = false;
  BindTrained(bank, 1, c);
  Result<PeftAdapter> copy = CopyPeft(bank, 1);
  ASSERT_TRUE(copy.ok()) << copy.status().message();
  EXPECT_EQ(copy->factors.size(), 14u);  // 2 layers x 7 modules; lm_head is not trained
  ASSERT_TRUE(SavePeft(bank, 1, dir_.string(), "m").ok());
  BindTrained(bank, 1, c);  // the slot moves on
  SlotBank from_files(3, 8, at::kCPU, Targets()), from_memory(3, 8, at::kCPU, Targets());
  ASSERT_TRUE(LoadPeft(from_files, 2, dir_.string()).ok());
  const Status s = InstallPeft(from_memory, 2, *copy);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(from_memory.slot(2).config.rank, 5);
  EXPECT_FALSE(from_memory.trains(2, TargetGroup::kUnembed));
  EXPECT_TRUE(from_memory.trains(2, TargetGroup::kMlp));
  EXPECT_FLOAT_EQ(from_memory.scales()[2].item<float>(), 2.0f);
  for (size_t i = 0; i < from_files.targets().size(); ++i) {
    const LoraTarget& f = from_files.targets()[i];
    const LoraTarget& m = from_memory.targets()[i];
    EXPECT_TRUE(at::equal(f.A[2], m.A[2])) << f.module;
    EXPECT_TRUE(at::equal(f.B[2], m.B[2])) << f.module;
  }
  EXPECT_FALSE(at::equal(bank.targets()[0].B[1], from_memory.targets()[0].B[2]));
  // Into a bank of another max rank (another row layout): factor by factor, the same values.
  SlotBank wider(1, 16, at::kCPU, Targets());
  ASSERT_TRUE(InstallPeft(wider, 0, *copy).ok());
  for (size_t i = 0; i < wider.targets().size(); ++i) {
    const LoraTarget& f = from_files.targets()[i];
    const LoraTarget& w = wider.targets()[i];
    EXPECT_TRUE(at::equal(f.A[2], w.A[0].narrow(0, 0, 8))) << f.module;
    EXPECT_TRUE(at::equal(f.B[2], w.B[0].narrow(1, 0, 8))) << f.module;
    EXPECT_EQ(w.A[0].narrow(0, 8, 8).abs().max().item<double>(), 0.0) << f.module;
  }
  // The host copy is the same adapter.
  const PeftAdapter host = copy->To(at::kCPU);
  for (size_t i = 0; i < host.factors.size(); ++i) EXPECT_TRUE(at::equal(host.factors[i].B, copy->factors[i].B));
}

TEST_F(PeftTest, InstallRefusesWhatTheBankCannotHoldAndLeavesTheSlot) {
  at::manual_seed(6);
  SlotBank bank(1, 8, at::kCPU, Targets());
  LoraConfig c;
  c.rank = 8;
  BindTrained(bank, 0, c);
  Result<PeftAdapter> copy = CopyPeft(bank, 0);
  ASSERT_TRUE(copy.ok());
  SlotBank small(1, 4, at::kCPU, Targets());
  Status s = InstallPeft(small, 0, *copy);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("rank 8"), std::string::npos) << s.message();
  EXPECT_FALSE(small.slot(0).bound);
  PeftAdapter wrong = *copy;
  wrong.factors[0].module = "model.layers.9.self_attn.q_proj";
  s = InstallPeft(bank, 0, wrong);
  EXPECT_NE(s.message().find("not a LoRA target"), std::string::npos) << s.message();
  wrong = *copy;
  wrong.factors[1].B = wrong.factors[1].B.narrow(1, 0, 4);
  s = InstallPeft(bank, 0, wrong);
  EXPECT_NE(s.message().find("expected"), std::string::npos) << s.message();
  EXPECT_TRUE(at::equal(bank.targets()[1].B[0].narrow(1, 0, 8), copy->factors[1].B));  // the slot kept its values
  EXPECT_EQ(CopyPeft(small, 0).status().code(), Code::kFailedPrecondition);
}

TEST_F(PeftTest, FilesHaveThePeftLayout) {
  at::manual_seed(4);
  SlotBank bank(2, 8, at::kCPU, Targets());
  LoraConfig c;
  c.rank = 4;
  c.alpha = 8;
  c.train_mlp = false;  // only attn + unembed modules are written
  BindTrained(bank, 0, c);
  ASSERT_TRUE(SavePeft(bank, 0, dir_.string(), "base-name").ok());

  std::ifstream in(dir_ / "adapter_config.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["task_type"], "CAUSAL_LM");
  EXPECT_EQ(j["r"], 4);
  EXPECT_EQ(j["lora_alpha"], 8);
  EXPECT_TRUE(j["lora_alpha"].is_number_integer());
  EXPECT_EQ(j["bias"], "none");
  EXPECT_EQ(j["base_model_name_or_path"], "base-name");
  EXPECT_EQ(j["target_modules"], nlohmann::json({"q_proj", "k_proj", "v_proj", "o_proj", "lm_head"}));

  auto file = SafetensorsFile::Open((dir_ / "adapter_model.safetensors").string());
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_EQ((*file)->tensors().size(), 2u * (2 * 4 + 1));
  const TensorView* a = (*file)->find("base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight");
  const TensorView* b = (*file)->find("base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight");
  const TensorView* ha = (*file)->find("base_model.model.lm_head.lora_A.weight");
  const TensorView* hb = (*file)->find("base_model.model.lm_head.lora_B.weight");
  ASSERT_TRUE(a && b && ha && hb);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(b->shape, (std::vector<int64_t>{8, 4}));
  EXPECT_EQ(hb->shape, (std::vector<int64_t>{40, 4}));
  EXPECT_EQ(a->dtype, "F32");
  EXPECT_EQ((*file)->find("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"), nullptr);

  // Loading it back trains exactly the saved groups.
  SlotBank other(2, 8, at::kCPU, Targets());
  ASSERT_TRUE(LoadPeft(other, 1, dir_.string()).ok());
  EXPECT_TRUE(other.trains(1, TargetGroup::kAttn));
  EXPECT_FALSE(other.trains(1, TargetGroup::kMlp));
  EXPECT_TRUE(other.trains(1, TargetGroup::kUnembed));

  // A config that names a module whose tensors the file lacks.
  nlohmann::json j2 = j;
  j2["target_modules"].push_back("up_proj");
  std::ofstream(dir_ / "adapter_config.json") << j2.dump();
  const Status s = LoadPeft(other, 0, dir_.string());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("mlp.up_proj.lora_A.weight' is missing"), std::string::npos) << s.message();
}

TEST_F(PeftTest, LoadRejectsBadDirectoriesNamingTheProblem) {
  at::manual_seed(5);
  SlotBank bank(2, 8, at::kCPU, Targets());
  LoraConfig c;
  c.rank = 6;
  c.alpha = 12;
  BindTrained(bank, 0, c);
  ASSERT_TRUE(SavePeft(bank, 0, dir_.string(), "m").ok());

  SlotBank small(2, 4, at::kCPU, Targets());  // max rank 4 < r 6
  Status s = LoadPeft(small, 0, dir_.string());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("r 6"), std::string::npos) << s.message();
  EXPECT_FALSE(small.slot(0).bound);

  // A config naming a module the file lacks.
  std::ifstream in(dir_ / "adapter_config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  in.close();
  j["target_modules"] = {"q_proj", "gate_proj"};  // file has all; gate/up/down... and extra k_proj etc.
  std::ofstream(dir_ / "adapter_config.json") << j.dump();
  s = LoadPeft(bank, 1, dir_.string());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("is not expected"), std::string::npos) << s.message();

  j["target_modules"] = {"q_proj", "embed_tokens"};
  std::ofstream(dir_ / "adapter_config.json") << j.dump();
  s = LoadPeft(bank, 1, dir_.string());
  EXPECT_NE(s.message().find("embed_tokens"), std::string::npos) << s.message();

  EXPECT_EQ(LoadPeft(bank, 1, (dir_ / "nope").string()).code(), Code::kNotFound);
  EXPECT_FALSE(bank.slot(1).bound);
  EXPECT_EQ(SavePeft(bank, 1, (dir_ / "x").string(), "m").code(), Code::kFailedPrecondition);
}

// Found by tests/fuzz/adapter_config_fuzz: a key of the wrong JSON type made
// nlohmann's value() throw out of LoadPeft (std::terminate on the engine
// thread) instead of answering Invalid.
TEST_F(PeftTest, LoadRefusesWrongTypedConfigFieldsWithoutThrowing) {
  at::manual_seed(6);
  SlotBank bank(2, 8, at::kCPU, Targets());
  LoraConfig c;
  c.rank = 4;
  BindTrained(bank, 0, c);
  ASSERT_TRUE(SavePeft(bank, 0, dir_.string(), "m").ok());
  std::ifstream in(dir_ / "adapter_config.json");
  const nlohmann::json saved = nlohmann::json::parse(in);
  in.close();
  for (const char* field : {"peft_type", "use_rslora", "use_dora"}) {
    for (const nlohmann::json& wrong : {nlohmann::json(16), nlohmann::json("yes"), nlohmann::json::array()}) {
      nlohmann::json j = saved;
      j[field] = wrong;
      std::ofstream(dir_ / "adapter_config.json") << j.dump();
      Status s;
      EXPECT_NO_THROW(s = LoadPeft(bank, 1, dir_.string())) << field << " = " << wrong.dump();
      EXPECT_EQ(s.code(), Code::kInvalidArgument) << field << " = " << wrong.dump();
      EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
      EXPECT_FALSE(bank.slot(1).bound);
    }
  }
}

}  // namespace
}  // namespace loom::engine
