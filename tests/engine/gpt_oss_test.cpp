// gpt_oss: config parsing, YaRN, MXFP4 dequantization by hand, the packed
// forward and its LoRA gradients against the specification's reference
// (gpt_oss_reference.h), the sampler's cached forward across the sliding
// window, and the loader on make-model's checkpoints (bf16 names and MXFP4).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "engine/io/peft.h"
#include "engine/io/peft_snapshot.h"
#include "engine/io/safetensors.h"
#include "engine/io/tensor_io.h"
#include "engine/model/cached_batch.h"
#include "engine/model/config.h"
#include "engine/model/families/gpt_oss.h"
#include "engine/model/rope.h"
#include "gpt_oss_reference.h"
#include "mxfp4_twin.h"
#include "testmodel/make_model.h"
#include "tiny_model.h"

namespace loom::engine {
namespace {

const auto kLongs = at::TensorOptions().dtype(at::kLong);

// gpt-oss-20b's config.json as the hub ships it (less quantization_config).
nlohmann::json Config20b() {
  return nlohmann::json::parse(R"({
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": true,
    "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false,
    "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": false},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 201088})");
}

TEST(GptOssConfig, ParsesTheHubConfigAndRoundTrips) {
  auto c = ModelConfig::Parse(Config20b().dump());
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->num_experts, 32);
  EXPECT_EQ(c->moe_intermediate_size, 2880);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->sliding_window, 128);
  EXPECT_TRUE(c->IsSlidingLayer(0));
  EXPECT_FALSE(c->IsSlidingLayer(1));
  EXPECT_TRUE(c->IsMoeLayer(0) && c->IsMoeLayer(1));
  EXPECT_EQ(c->rope_type, "yarn");
  EXPECT_EQ(c->rope_factor, 32.0);
  EXPECT_FALSE(c->yarn_truncate);
  EXPECT_EQ(c->rope_original_max_position, 4096);
  auto again = ModelConfig::Parse(c->ToJson());
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(again->ToJson(), c->ToJson());
  EXPECT_EQ(again->layer_types, c->layer_types);

  // HF's defaults when fields are absent: alternating layers, YaRN of the class.
  nlohmann::json j = Config20b();
  for (const char* f : {"layer_types", "rope_scaling", "rope_theta", "sliding_window"}) j.erase(f);
  auto d = ModelConfig::Parse(j.dump());
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->layer_types, (std::vector<std::string>{"sliding_attention", "full_attention"}));
  EXPECT_EQ(d->rope_theta, 150000.0);
  EXPECT_EQ(d->rope_original_max_position, 4096);
  EXPECT_EQ(d->sliding_window, 128);
  // truncate defaults to true when a yarn dict leaves it out.
  j = Config20b();
  j["rope_scaling"].erase("truncate");
  EXPECT_TRUE(ModelConfig::Parse(j.dump())->yarn_truncate);
}

TEST(GptOssConfig, RejectsWhatIsNotImplementedNamingTheField) {
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> cases = {
      {[](nlohmann::json& j) { j["swiglu_limit"] = 8.0; }, "swiglu_limit"},
      {[](nlohmann::json& j) { j["rope_scaling"]["attention_factor"] = 1.0; }, "rope_scaling.attention_factor"},
      {[](nlohmann::json& j) { j["rope_scaling"]["rope_type"] = "linear"; }, "rope_scaling.rope_type"},
      {[](nlohmann::json& j) { j["layer_types"] = {"sliding_attention"}; }, "layer_types"},
      {[](nlohmann::json& j) { j["layer_types"][1] = "chunked_attention"; }, "layer_types"},
      {[](nlohmann::json& j) { j["num_experts_per_tok"] = 33; }, "num_experts_per_tok"},
  };
  for (const auto& [edit, field] : cases) {
    nlohmann::json j = Config20b();
    edit(j);
    auto c = ModelConfig::Parse(j.dump());
    ASSERT_FALSE(c.ok()) << field;
    EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status().message();
  }
  // Families that do not take YaRN still refuse it, naming the field.
  nlohmann::json q = {{"model_type", "glm4_moe"}, {"vocab_size", 10}, {"hidden_size", 8}, {"intermediate_size", 8},
                      {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"rope_scaling", Config20b()["rope_scaling"]}};
  auto refused = ModelConfig::Parse(q.dump());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("rope_scaling"), std::string::npos) << refused.status().message();
}

// gpt-oss-20b's YaRN (head_dim 64, theta 150000, factor 32, original 4096,
// betas 32/1, no truncation): low 8.0928, high 17.3980, so frequencies 0..8
// are the plain ones, 18..31 are divided by 32, and cos/sin carry 1.346574.
TEST(GptOssRope, YarnMatchesTheFormula) {
  const ModelConfig c = *ModelConfig::Parse(Config20b().dump());
  const RopeFrequencies r = MakeRopeFrequencies(c, 64);
  EXPECT_NEAR(r.scale, 0.1 * std::log(32.0) + 1, 1e-12);
  EXPECT_NEAR(r.scale, 1.346574, 1e-6);
  const auto [want, factor] = ReferenceYarn(c);
  for (int64_t i = 0; i < 32; ++i) {
    const double plain = 1.0 / std::pow(150000.0, 2.0 * i / 64);
    EXPECT_NEAR(r.inv_freq[i].item<double>(), want[i], 1e-6 * plain) << i;
    if (i <= 8) EXPECT_NEAR(want[i], plain, 1e-12 * plain) << i;
    if (i >= 18) EXPECT_NEAR(want[i], plain / 32, 1e-12 * plain) << i;
  }
  EXPECT_GT(want[12], 1.0 / std::pow(150000.0, 24.0 / 64) / 32);  // the ramp blends
  EXPECT_LT(want[12], 1.0 / std::pow(150000.0, 24.0 / 64));
}

// MXFP4 by hand: one row of one group (32 elements) and a second group.
TEST(GptOssMxfp4, DequantizesByHand) {
  at::Tensor blocks = at::zeros({1, 1, 2, 16}, at::TensorOptions().dtype(at::kByte));
  at::Tensor scales = at::zeros({1, 1, 2}, at::TensorOptions().dtype(at::kByte));
  blocks[0][0][0][0] = 0x21;  // elements 0, 1: codes 1 (0.5) and 2 (1.0)
  blocks[0][0][0][1] = 0xF8;  // elements 2, 3: codes 8 (-0) and 15 (-6)
  blocks[0][0][0][15] = 0x7C;  // elements 30, 31: codes 12 (-2) and 7 (6)
  blocks[0][0][1][3] = 0x5B;  // group 1, elements 38, 39: codes 11 (-1.5) and 5 (3)
  scales[0][0][0] = 128;      // x 2
  scales[0][0][1] = 125;      // x 1/4
  const at::Tensor got = DequantizeMxfp4(blocks, scales, at::kBFloat16);
  ASSERT_EQ(got.sizes(), at::IntArrayRef({1, 1, 64}));
  at::Tensor want = at::zeros({64});
  want[0] = 1.0, want[1] = 2.0, want[2] = -0.0, want[3] = -12.0, want[30] = -4.0, want[31] = 12.0;
  want[38] = -0.375, want[39] = 0.75;
  EXPECT_TRUE(at::equal(got.to(at::kFloat).view({64}), want));
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  // Scale 0 is 2^-127 and 255 overflows, as HF's ldexp.
  scales[0][0][0] = 0;
  scales[0][0][1] = 255;
  const at::Tensor edge = DequantizeMxfp4(blocks, scales, at::kFloat).view({64});
  EXPECT_EQ(edge[1].item<float>(), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isinf(edge[39].item<float>()));
}

TEST(GptOssLayout, InterleavingRoundTrips) {
  const at::Tensor hf = at::randn({3, 5, 8});  // [E, H, 2I], columns g0 u0 g1 u1 ...
  const at::Tensor loom = GateUpFromInterleaved(hf);  // [E, 2I, H]
  EXPECT_TRUE(at::equal(loom[1][0], hf[1].select(1, 0)));  // gate 0
  EXPECT_TRUE(at::equal(loom[1][4], hf[1].select(1, 1)));  // up 0
  EXPECT_TRUE(at::equal(loom[2][3], hf[2].select(1, 6)));  // gate 3
  EXPECT_TRUE(at::equal(InterleaveGateUp(loom, 1).transpose(1, 2), hf));
  const at::Tensor b = at::randn({3, 8});
  EXPECT_TRUE(at::equal(InterleaveGateUp(GateUpBiasFromInterleaved(b), 1), b));
}

std::vector<at::Tensor> Factors(const SlotBank& bank) {
  std::vector<at::Tensor> f;
  for (const auto& t : bank.targets()) f.push_back(t.A), f.push_back(t.B);
  return f;
}

// The packed forward (two sequences longer than the window, packed with a
// base sequence) and the LoRA gradients of every target, experts included,
// against the reference run per sequence.
TEST(GptOssModel, ForwardAndGradientsMatchTheReference) {
  const ModelConfig c = TinyConfig("gpt_oss");
  const auto weights = RandomWeights(c, 7);
  auto model = Transformer::FromTensors(c, weights, at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok()) << model.status().message();
  auto bank = Bank(**model, 3, 4);
  BindRandom(*bank, 0, 4, 8.0, 41);
  BindRandom(*bank, 2, 3, 6.0, 42);
  const std::vector<std::vector<int32_t>> seqs = {Seq(9, 1), Seq(5, 2), Seq(7, 3)};
  const std::vector<int> slots = {0, -1, 2};
  const PackedBatch batch = PackedBatch::Make(seqs, slots, at::kCPU);
  const at::Tensor targets = NextTokens(seqs);
  const at::Tensor got = (*model)->TargetLogprobs((*model)->Hidden(batch, *bank), targets, batch, *bank, 1024);
  got.sum().backward();
  std::vector<at::Tensor> got_grads;
  for (const at::Tensor& f : Factors(*bank)) got_grads.push_back(f.grad().clone()), f.grad().zero_();

  int64_t offset = 0;
  at::Tensor total = at::zeros({}, at::TensorOptions().dtype(at::kDouble));
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t n = seqs[i].size();
    const at::Tensor lp = GptOssReferenceLogprobs(c, weights, seqs[i], bank.get(), slots[i]);
    const at::Tensor want = lp.gather(1, targets.narrow(0, offset, n).unsqueeze(1)).squeeze(1);
    EXPECT_LT(MaxDiff(got.narrow(0, offset, n).to(at::kDouble), want.detach()), 2e-5) << "sequence " << i;
    total = total + want.sum();
    offset += n;
  }
  total.backward();
  const std::vector<at::Tensor> factors = Factors(*bank);
  size_t k = 0;
  for (const auto& t : bank->targets()) {
    for (int ab = 0; ab < 2; ++ab, ++k) {
      const at::Tensor want = factors[k].grad();
      EXPECT_LT(RelDiff(got_grads[k], want), 1e-4) << t.module << (ab ? " B" : " A");
      EXPECT_GT(want[0].abs().max().item<double>(), 0.0) << t.module;
      EXPECT_EQ(got_grads[k][1].abs().max().item<double>(), 0.0) << t.module;  // unused slot
    }
  }
}

// The reference is sensitive to what it checks: the window, the sinks and
// YaRN each move the logprobs of a sequence longer than the window.
TEST(GptOssModel, ReferenceSeesTheWindowTheSinksAndYarn) {
  const ModelConfig c = TinyConfig("gpt_oss");
  auto weights = RandomWeights(c, 3);
  const std::vector<int32_t> seq = Seq(8, 5);
  c10::NoGradGuard no_grad;
  const at::Tensor base = GptOssReferenceLogprobs(c, weights, seq);
  ModelConfig full = c;
  full.sliding_window = 0;
  EXPECT_GT(MaxDiff(base, GptOssReferenceLogprobs(full, weights, seq)), 1e-3);
  ModelConfig plain_rope = c;
  plain_rope.rope_factor = 1.0;
  EXPECT_GT(MaxDiff(base, GptOssReferenceLogprobs(plain_rope, weights, seq)), 1e-3);
  auto no_sinks = weights;
  for (auto& [name, t] : no_sinks)
    if (name.find("sinks") != std::string::npos) t = at::full_like(t, -1e4);
  EXPECT_GT(MaxDiff(base, GptOssReferenceLogprobs(c, no_sinks, seq)), 1e-3);
  // And the packed model agrees with it at the first positions, which the
  // window does not reach, as at the last ones.
  auto model = Transformer::FromTensors(c, weights, at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok());
  auto bank = Bank(**model);
  const PackedBatch b = PackedBatch::Make({seq}, {-1}, at::kCPU);
  EXPECT_LT(MaxDiff(at::log_softmax((*model)->Logits((*model)->Hidden(b, *bank), b, *bank), -1).to(at::kDouble), base),
            2e-5);
}

// The sampler's cached forward: a prefill shorter than the window, then
// decode steps one token at a time well past it, and a prefill over a
// cached prefix, each row equal to the trainer's hidden state.
TEST(GptOssModel, CachedForwardMatchesTheTrainerAcrossTheWindow) {
  auto model = Tiny("gpt_oss");
  auto bank = Bank(*model, 2, 4);
  BindRandom(*bank, 1, 4, 8.0, 21);
  const std::vector<int32_t> seq = Seq(10, 4);
  c10::NoGradGuard no_grad;
  const PackedBatch full = PackedBatch::Make({seq}, {1}, at::kCPU);
  const at::Tensor want = model->Hidden(full, *bank);

  const ModelConfig& c = model->config();
  KvCache cache = KvCache::Allocate(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim, at::kCPU, at::kFloat);
  const auto longs = [](std::vector<int64_t> v) { return at::tensor(v, kLongs); };
  CachedBatch prefill;
  prefill.tokens = longs(std::vector<int64_t>(seq.begin(), seq.begin() + 2));
  prefill.positions = at::arange(2, kLongs);
  prefill.seq_begin = {0, 2};
  prefill.seq_slot = {1};
  prefill.write_rows = at::arange(2, kLongs);
  prefill.prefill = true;
  EXPECT_LT(MaxDiff(model->ForwardCached(prefill, cache, *bank), want.narrow(0, 0, 2)), 1e-5);
  for (int64_t p = 2; p < 7; ++p) {
    CachedBatch decode;
    decode.tokens = longs({seq[p]});
    decode.positions = longs({p});
    decode.seq_begin = {0, 1};
    decode.seq_slot = {1};
    decode.write_rows = longs({p});
    // Padded to 8 columns: the padding is masked, the window hides the old keys.
    decode.context_rows = at::arange(8, kLongs).clamp_max(p).unsqueeze(0);
    decode.context_mask = (at::arange(8, kLongs) <= p).unsqueeze(0);
    EXPECT_LT(MaxDiff(model->ForwardCached(decode, cache, *bank), want.narrow(0, p, 1)), 1e-5) << "position " << p;
  }
  CachedBatch rest;  // positions 7..9 over the cached 0..6
  rest.tokens = longs(std::vector<int64_t>(seq.begin() + 7, seq.end()));
  rest.positions = at::arange(7, 10, kLongs);
  rest.seq_begin = {0, 3};
  rest.seq_slot = {1};
  rest.write_rows = at::arange(7, 10, kLongs);
  rest.prefill = true;
  rest.seq_cached = {7};
  rest.cached_rows = at::arange(7, kLongs);
  EXPECT_LT(MaxDiff(model->ForwardCached(rest, cache, *bank), want.narrow(0, 7, 3)), 1e-5);
}

std::string TempDir(const std::string& tag) {
  const std::string d = "/tmp/loom_gpt_oss_" + tag + "_" + std::to_string(getpid());
  std::filesystem::remove_all(d);
  return d;
}

// make-model's tiny gpt_oss loads under HF's bf16 names, and the same
// checkpoint with its experts as MXFP4 blocks and scales (exactly
// representable values) loads to the same model.
TEST(GptOssLoad, MakeModelCheckpointAndItsMxfp4TwinLoadAlike) {
  const std::string dir = TempDir("bf16"), mx = TempDir("mxfp4");
  testmodel::MakeModelOptions o;
  o.arch = "gpt_oss";
  o.preset = "tiny";
  ASSERT_TRUE(testmodel::MakeModel(o, dir).ok());
  auto cfg = ModelConfig::Load(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  EXPECT_EQ(cfg->sliding_window, 4);
  auto files = ModelWeights::Open(dir);
  ASSERT_TRUE(files.ok());
  // The sinks are O(1) and the gate/up weights large, as the preset promises.
  EXPECT_GT(LoadTensor(*files->find("model.layers.0.self_attn.sinks"), at::kCPU)->abs().max().item<double>(), 0.5);

  // The twin: each expert weight replaced by a FP4 code grid (values
  // +-{0..6} * 2^-3) written as blocks and scales, and as plain weights.
  std::map<std::string, at::Tensor> plain_weights;
  WriteMxfp4Twin(dir, mx, &plain_weights);
  auto from_mx = Transformer::Load(mx, at::kCPU, at::kFloat);
  ASSERT_TRUE(from_mx.ok()) << from_mx.status().message();
  auto from_plain = Transformer::FromTensors(*cfg, plain_weights, at::kCPU, at::kFloat);
  ASSERT_TRUE(from_plain.ok()) << from_plain.status().message();
  const auto a = (*from_mx)->BaseWeights(), b = (*from_plain)->BaseWeights();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << i;
  auto bf16 = Transformer::Load(dir, at::kCPU, at::kBFloat16);
  ASSERT_TRUE(bf16.ok()) << bf16.status().message();
  int fp32 = 0;
  for (const at::Tensor& w : (*bf16)->BaseWeights()) fp32 += w.scalar_type() == at::kFloat;
  EXPECT_EQ(fp32, 2 * cfg->num_hidden_layers + 1);  // the norms stay fp32 (HF's _keep_in_fp32_modules)
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(mx);
}

// PEFT 0.21's ParamWrapper on gpt_oss's transposed gate_up_proj [E, H, 2I]
// has in = H, out = 2I (is_transposed: no swap), and its out index is HF's
// interleaved column: lora_B row 2j is loom's gate row j, 2j + 1 its up row
// j (columns k * E + e as for qwen3_moe). down_proj is not interleaved.
// Reading the file back gives the slot's factors exactly.
TEST(GptOssPeft, GateUpRowsAreInterleavedInPeftsFileAndRoundTrip) {
  auto model = Tiny("gpt_oss");
  auto bank = Bank(*model, 2, 8);
  BindRandom(*bank, 0, 4, 16.0, 31);
  const std::string dir = TempDir("peft");
  ASSERT_TRUE(SavePeft(*bank, 0, dir, "tiny").ok());
  auto file = SafetensorsFile::Open(dir + "/adapter_model.safetensors");
  ASSERT_TRUE(file.ok());
  const int64_t E = 4, I = 12, H = 32, r = 4;
  const std::string p = "base_model.model.model.layers.1.mlp.experts.";
  const at::Tensor gu_b = *LoadTensor(*(*file)->find(p + "base_layer.lora_B.weight"), at::kCPU);  // [2I, r * E]
  const at::Tensor dn_b = *LoadTensor(*(*file)->find(p + "lora_B.weight"), at::kCPU);             // [H, r * E]
  ASSERT_EQ(gu_b.sizes(), at::IntArrayRef({2 * I, r * E}));
  const LoraTarget* gu = bank->find("model.layers.1.mlp.experts.gate_up_proj");
  const LoraTarget* dn = bank->find("model.layers.1.mlp.experts.down_proj");
  ASSERT_TRUE(gu && dn && gu->hf_interleaved && !dn->hf_interleaved);
  for (int64_t e : {0, 3})
    for (int64_t j : {0, 5, 11})
      for (int64_t k : {0, 3}) {
        EXPECT_EQ(gu_b[2 * j][k * E + e].item<float>(), gu->B[0][e][j][k].item<float>());
        EXPECT_EQ(gu_b[2 * j + 1][k * E + e].item<float>(), gu->B[0][e][I + j][k].item<float>());
        EXPECT_EQ(dn_b[j][k * E + e].item<float>(), dn->B[0][j][k].item<float>());
      }
  file->reset();
  auto other = Bank(*model, 2, 8);
  ASSERT_TRUE(LoadPeft(*other, 1, dir).ok());
  EXPECT_TRUE(at::equal(other->flat()[1], bank->flat()[0]));
  // The trainer's published snapshots (PeftSnapshot: copied, then moved to
  // the CPU and written) keep the interleaving too.
  const std::string published = TempDir("published");
  auto snapshot = PeftSnapshot::Take(*bank, 0);
  ASSERT_TRUE(snapshot.ok());
  ASSERT_TRUE((*snapshot)->WritePeft(published, "tiny").ok());
  auto third = Bank(*model, 2, 8);
  ASSERT_TRUE(LoadPeft(*third, 0, published).ok());
  EXPECT_TRUE(at::equal(third->flat()[0], bank->flat()[0]));
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(published);
}

}  // namespace
}  // namespace loom::engine
