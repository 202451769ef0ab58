// make-model: deterministic bytes, HF-initialisation statistics, sharding,
// presets with the real shapes, and the byte-level tokenizer.
#include "testmodel/make_model.h"
#include "../common/temp_dir.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "engine/io/safetensors.h"

namespace loom::testmodel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using TempDir = loom::test::TempDir;
using engine::ModelConfig;
using engine::ModelWeights;
using engine::TensorView;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

uint64_t Fnv(const std::string& s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

MakeModelOptions Tiny(const std::string& arch, uint64_t seed, const std::string& dtype = "") {
  MakeModelOptions o;
  o.arch = arch;
  o.preset = "tiny";
  o.seed = seed;
  o.dtype = dtype;
  return o;
}

float F32At(const TensorView& v, int64_t i) {
  float x;
  std::memcpy(&x, v.data + 4 * i, 4);
  return x;
}

TEST(MakeModel, SameSeedSameBytesDifferentSeedDifferentWeights) {
  TempDir a, b, c;
  ASSERT_TRUE(MakeModel(Tiny("qwen3", 7), a.path()).ok());
  ASSERT_TRUE(MakeModel(Tiny("qwen3", 7), b.path()).ok());
  ASSERT_TRUE(MakeModel(Tiny("qwen3", 8), c.path()).ok());
  for (const char* f : {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json",
                        "tokenizer_config.json"}) {
    ASSERT_TRUE(fs::exists(a / f)) << f;
    EXPECT_EQ(ReadAll(a / f), ReadAll(b / f)) << f;
  }
  EXPECT_EQ(ReadAll(a / "config.json"), ReadAll(c / "config.json"));
  // Different seed: every random tensor differs (metadata differs too).
  auto wa = ModelWeights::Open(a.path());
  auto wc = ModelWeights::Open(c.path());
  ASSERT_TRUE(wa.ok() && wc.ok());
  for (const auto& [name, va] : wa->tensors()) {
    const TensorView* vc = wc->find(name);
    ASSERT_NE(vc, nullptr) << name;
    ASSERT_EQ(va.nbytes, vc->nbytes);
    const bool same = std::memcmp(va.data, vc->data, va.nbytes) == 0;
    EXPECT_EQ(same, name.find("norm.weight") != std::string::npos) << name;
  }
}

// The bytes must not depend on the machine, compiler or libtorch version:
// these fingerprints were recorded on the development machine and must hold
// everywhere (a change here means every generated model changed).
TEST(MakeModel, FingerprintIsStableAcrossMachines) {
  TempDir d2, d3;
  ASSERT_TRUE(MakeModel(Tiny("qwen2", 1), d2.path()).ok());
  ASSERT_TRUE(MakeModel(Tiny("qwen3", 1), d3.path()).ok());
  const uint64_t h2 = Fnv(ReadAll(d2 / "model.safetensors"));
  const uint64_t h3 = Fnv(ReadAll(d3 / "model.safetensors"));
  EXPECT_EQ(h2, 0x8bcf3d0921adebd9ull) << std::hex << "qwen2 tiny seed 1: 0x" << h2;
  EXPECT_EQ(h3, 0xf4315157315d0bacull) << std::hex << "qwen3 tiny seed 1: 0x" << h3;
}

TEST(MakeModel, TinyIsSmallAndInitialisedLikeHF) {
  TempDir d;
  ASSERT_TRUE(MakeModel(Tiny("qwen2", 3), d.path()).ok());
  EXPECT_LT(fs::file_size(d / "model.safetensors"), 4u << 20);
  auto cfg = ModelConfig::Load(d.path());
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  EXPECT_EQ(cfg->model_type, "qwen2");
  EXPECT_EQ(cfg->torch_dtype, "float32");
  EXPECT_EQ(cfg->eos_token_id, cfg->vocab_size - 1);
  auto w = ModelWeights::Open(d.path());
  ASSERT_TRUE(w.ok());
  const auto specs = BaseWeightSpecs(cfg.value());
  EXPECT_EQ(w->tensors().size(), specs.size());
  double sum = 0, sq = 0;
  int64_t n = 0;
  for (const WeightSpec& s : specs) {
    const TensorView* v = w->find(s.name);
    ASSERT_NE(v, nullptr) << s.name;
    EXPECT_EQ(v->dtype, "F32");
    EXPECT_EQ(v->shape, s.shape) << s.name;
    if (s.name.find("norm.weight") != std::string::npos) {
      for (int64_t i = 0; i < v->numel(); ++i) ASSERT_EQ(F32At(*v, i), 1.0f) << s.name;
      continue;
    }
    for (int64_t i = 0; i < v->numel(); ++i) {
      const double x = F32At(*v, i);
      ASSERT_TRUE(std::isfinite(x));
      sum += x;
      sq += x * x;
      ++n;
    }
  }
  ASSERT_GT(n, 50000);
  const double mean = sum / n, std_dev = std::sqrt(sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.0005);
  EXPECT_NEAR(std_dev, 0.02, 0.0005);
  // qwen2: q/k/v carry biases, o does not; no qk-norm; tied embeddings.
  EXPECT_NE(w->find("model.layers.0.self_attn.q_proj.bias"), nullptr);
  EXPECT_EQ(w->find("model.layers.0.self_attn.o_proj.bias"), nullptr);
  EXPECT_EQ(w->find("model.layers.0.self_attn.q_norm.weight"), nullptr);
  EXPECT_EQ(w->find("lm_head.weight"), nullptr);
}

TEST(MakeModel, Bf16IsTheFp32ValuesRoundedToNearestEven) {
  TempDir f, b;
  ASSERT_TRUE(MakeModel(Tiny("qwen3", 5, "fp32"), f.path()).ok());
  ASSERT_TRUE(MakeModel(Tiny("qwen3", 5, "bf16"), b.path()).ok());
  auto wf = ModelWeights::Open(f.path());
  auto wb = ModelWeights::Open(b.path());
  ASSERT_TRUE(wf.ok() && wb.ok());
  const TensorView* vf = wf->find("model.layers.1.mlp.down_proj.weight");
  const TensorView* vb = wb->find("model.layers.1.mlp.down_proj.weight");
  ASSERT_TRUE(vf && vb);
  EXPECT_EQ(vb->dtype, "BF16");
  ASSERT_EQ(vf->numel(), vb->numel());
  for (int64_t i = 0; i < vf->numel(); ++i) {
    const float x = F32At(*vf, i);
    uint16_t h;
    std::memcpy(&h, vb->data + 2 * i, 2);
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float y;
    std::memcpy(&y, &bits, 4);
    // Nearest bf16: the error is at most half a bf16 ulp (2^-8 relative).
    ASSERT_LE(std::fabs(x - y), std::ldexp(std::fabs(x), -8) + 1e-30) << i;
  }
  auto cfg = ModelConfig::Load(b.path());
  ASSERT_TRUE(cfg.ok());
  EXPECT_EQ(cfg->torch_dtype, "bfloat16");
}

TEST(MakeModel, ShardsGiveTheSameTensorsAsOneFile) {
  TempDir one, many;
  MakeModelOptions o;
  o.arch = "qwen3";
  o.preset = "small";
  o.seed = 11;
  ASSERT_TRUE(MakeModel(o, one.path()).ok());
  o.shard_bytes = 6u << 20;
  ASSERT_TRUE(MakeModel(o, many.path()).ok());
  EXPECT_TRUE(fs::exists(many / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(many / "model.safetensors"));
  EXPECT_FALSE(fs::exists(one / "model.safetensors.index.json"));
  auto a = ModelWeights::Open(one.path());
  auto b = ModelWeights::Open(many.path());
  ASSERT_TRUE(a.ok() && b.ok()) << b.status().message();
  EXPECT_EQ(a->num_files(), 1u);
  EXPECT_GE(b->num_files(), 3u);
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  uint64_t total = 0;
  for (const auto& [name, va] : a->tensors()) {
    const TensorView* vb = b->find(name);
    ASSERT_NE(vb, nullptr) << name;
    ASSERT_EQ(va.nbytes, vb->nbytes);
    EXPECT_EQ(std::memcmp(va.data, vb->data, va.nbytes), 0) << name;
    total += va.nbytes;
  }
  // small: tens of MB, untied lm_head.
  EXPECT_GT(total, 10u << 20);
  EXPECT_LT(total, 100u << 20);
  EXPECT_NE(a->find("lm_head.weight"), nullptr);
  const json idx = json::parse(ReadAll(many / "model.safetensors.index.json"));
  EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_EQ(idx["weight_map"].size(), a->tensors().size());
}

int64_t ParamCount(const ModelConfig& c) {
  int64_t n = 0;
  for (const WeightSpec& s : BaseWeightSpecs(c)) {
    int64_t k = 1;
    for (int64_t d : s.shape) k *= d;
    n += k;
  }
  return n;
}

TEST(MakeModel, NamedPresetsHaveTheRealShapes) {
  auto q25 = PresetConfig("qwen2", "qwen2.5-0.5b");
  ASSERT_TRUE(q25.ok());
  EXPECT_EQ(q25->torch_dtype, "bfloat16");
  EXPECT_EQ(ParamCount(q25.value()), 494032768);  // Qwen2.5-0.5B's published count
  auto q3 = PresetConfig("qwen3", "qwen3-4b");
  ASSERT_TRUE(q3.ok());
  EXPECT_EQ(q3->head_dim, 128);
  EXPECT_EQ(ParamCount(q3.value()), 4022468096);  // Qwen3-4B's published count
  auto tiny = PresetConfig("qwen3", "tiny");
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(tiny->torch_dtype, "float32");
  EXPECT_EQ(PresetConfig("qwen3", "qwen3-4b", "fp32")->torch_dtype, "float32");
}

// --layers keeps each real preset's per-layer pattern from its first layer
// on, and the config it writes parses back (a list of the preset's length
// would be refused against the new layer count).
TEST(MakeModel, FewerLayersKeepThePresetsLayerPattern) {
  for (const auto& [arch, preset] : std::vector<std::pair<std::string, std::string>>{
           {"gpt_oss", "gpt-oss-20b"}, {"mimo_v2_flash", "mimo-v2-flash"}, {"glm_moe_dsa", "glm-5.2"},
           {"qwen3_5_moe_text", "qwen3.5-35b-a3b"}, {"deepseek_v2", "deepseek-v2-lite"}}) {
    auto full = PresetConfig(arch, preset);
    ASSERT_TRUE(full.ok()) << preset;
    for (int64_t layers : {4, 8}) {
      MakeModelOptions o;
      o.arch = arch;
      o.preset = preset;
      o.layers = layers;
      auto c = MakeModelConfig(o);
      ASSERT_TRUE(c.ok()) << preset << ": " << c.status().message();
      EXPECT_EQ(c->num_hidden_layers, layers) << preset;
      for (const auto& [mine, theirs] : {std::pair{&c->layer_types, &full->layer_types},
                                          std::pair{&c->indexer_types, &full->indexer_types}}) {
        ASSERT_EQ(mine->size(), theirs->empty() ? 0u : static_cast<size_t>(layers)) << preset;
        EXPECT_TRUE(std::equal(mine->begin(), mine->end(), theirs->begin())) << preset;
      }
      auto back = engine::ModelConfig::Parse(c->ToJson());
      ASSERT_TRUE(back.ok()) << preset << " at " << layers << " layers: " << back.status().message();
      EXPECT_EQ(back->layer_types, c->layer_types) << preset;
      EXPECT_EQ(back->indexer_types, c->indexer_types) << preset;
    }
  }
}

// --zero-experts: the routed experts are zero (holes in the file), and
// every other tensor is the bytes the same seed writes without it
// (tests/engine/moe_test.cpp loads and runs such a model).
TEST(MakeModel, ZeroExpertsAreZeroAndTheRestUnchanged) {
  TempDir plain, zero;
  MakeModelOptions o = Tiny("qwen3_moe", 5);
  ASSERT_TRUE(MakeModel(o, plain.path()).ok());
  o.zero_experts = true;
  ASSERT_TRUE(MakeModel(o, zero.path()).ok());
  auto a = ModelWeights::Open(plain.path());
  auto b = ModelWeights::Open(zero.path());
  ASSERT_TRUE(a.ok() && b.ok()) << b.status().message();
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  int experts = 0;
  for (const auto& [name, va] : a->tensors()) {
    const TensorView* vb = b->find(name);
    ASSERT_NE(vb, nullptr) << name;
    ASSERT_EQ(va.nbytes, vb->nbytes) << name;
    if (name.find(".experts.") != std::string::npos) {
      ++experts;
      EXPECT_TRUE(std::all_of(vb->data, vb->data + vb->nbytes, [](uint8_t x) { return x == 0; })) << name;
      EXPECT_FALSE(std::all_of(va.data, va.data + va.nbytes, [](uint8_t x) { return x == 0; })) << name;
    } else {
      EXPECT_EQ(std::memcmp(va.data, vb->data, va.nbytes), 0) << name;
    }
  }
  EXPECT_GT(experts, 0);
}

TEST(MakeModel, BadFlagsNameTheFlag) {
  TempDir d;
  auto expect_invalid = [&](MakeModelOptions o, const std::string& flag) {
    Status s = MakeModel(o, d.path());
    ASSERT_FALSE(s.ok()) << flag;
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find(flag), std::string::npos) << s.message();
  };
  MakeModelOptions o = Tiny("qwen3", 1);
  o.arch = "llama";
  expect_invalid(o, "arch");
  o = Tiny("qwen3", 1);
  o.preset = "huge";
  expect_invalid(o, "preset");
  o = Tiny("qwen3", 1);
  o.dtype = "fp8";
  expect_invalid(o, "dtype");
  EXPECT_FALSE(fs::exists(d / "model.safetensors"));
}

TEST(MakeModel, TokenizerIsByteLevelBpeCoveringEveryId) {
  for (int64_t vocab : {int64_t{512}, int64_t{2000}}) {
    const json t = json::parse(MakeTokenizerJson(vocab));
    EXPECT_EQ(t["model"]["type"], "BPE");
    const json& v = t["model"]["vocab"];
    ASSERT_EQ(static_cast<int64_t>(v.size()), vocab);
    std::set<int64_t> ids;
    for (auto it = v.begin(); it != v.end(); ++it) ids.insert(it.value().get<int64_t>());
    EXPECT_EQ(static_cast<int64_t>(ids.size()), vocab);
    EXPECT_EQ(*ids.begin(), 0);
    EXPECT_EQ(*ids.rbegin(), vocab - 1);
    // GPT-2 byte symbols: 'A' is itself, space is U+0120 'Ġ', newline U+010A 'Ċ', 0xFF is 'ÿ'.
    EXPECT_EQ(v["A"], 65);
    EXPECT_EQ(v["\xC4\xA0"], 32);
    EXPECT_EQ(v["\xC4\x8A"], 10);
    EXPECT_EQ(v["\xC3\xBF"], 255);
    EXPECT_EQ(v["<|endoftext|>"], vocab - 1);
    EXPECT_EQ(t["added_tokens"][0]["id"], vocab - 1);
    EXPECT_TRUE(t["added_tokens"][0]["special"].get<bool>());
    // Every merge joins two vocabulary entries into a third.
    const json& merges = t["model"]["merges"];
    EXPECT_EQ(static_cast<int64_t>(merges.size()), vocab - 257);
    for (const json& m : merges) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      ASSERT_NE(sp, std::string::npos);
      ASSERT_TRUE(v.contains(s.substr(0, sp))) << s;
      ASSERT_TRUE(v.contains(s.substr(sp + 1))) << s;
      ASSERT_TRUE(v.contains(s.substr(0, sp) + s.substr(sp + 1))) << s;
    }
  }
}

}  // namespace
}  // namespace loom::testmodel
