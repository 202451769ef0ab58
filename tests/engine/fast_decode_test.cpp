// The CUDA fast decode path (engine/sample/fast_decode.h) against the eager
// KV-cached forward: two ModelRunners over the same model and adapters, one
// with DecodeOptions::cuda_graphs off, fed the same prompts and tokens; their decode
// logits must agree. Skipped where there is no CUDA device or no fast path
// (the CPU build); run on the GPU machine.
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <utility>

#include "engine/io/peft.h"
#include "engine/lora/slot_bank.h"
#include "testmodel/make_model.h"
#include "engine/model/transformer.h"
#include "engine/sample/model_runner.h"
#include "engine/sample_api.h"
#include "../common/temp_dir.h"

namespace loom::engine {
namespace {

using sample::ModelRunner;
using sample::SampleRequest;
using sample::Sequence;

constexpr int64_t kBlock = 16;

struct Rows {
  std::vector<std::unique_ptr<SampleRequest>> requests;
  std::vector<Sequence*> seqs;
};

// One request per (prompt length, slot), each with its own run of blocks.
Rows MakeRows(const std::vector<int64_t>& lens, const std::vector<int>& slots, int64_t vocab, int64_t steps) {
  Rows r;
  int next_block = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    auto req = std::make_unique<SampleRequest>();
    req->id = i;
    req->slot = slots[i];
    for (int64_t p = 0; p < lens[i]; ++p) req->call.prompt.push_back(static_cast<int32_t>((p * 31 + i * 7 + 3) % vocab));
    auto s = std::make_unique<Sequence>();
    s->request = req.get();
    s->tokens = req->call.prompt;
    for (int64_t b = 0; b < (lens[i] + steps + kBlock - 1) / kBlock; ++b) s->block_table.push_back(next_block++);
    r.seqs.push_back(s.get());
    req->sequences.push_back(std::move(s));
    r.requests.push_back(std::move(req));
  }
  return r;
}

DecodeOptions Eager() {
  DecodeOptions o;
  o.cuda_graphs = false;
  return o;
}

// Max |logit difference| of each row at each of `steps` decode steps
// (step-major), fast decode (made with fast_options) vs a reference runner
// made with ref_options (by default the eager path); empty when the fast
// runner has no fast decode path.
std::vector<double> RowDecodeDiffs(std::shared_ptr<const Transformer> model, SlotBank& bank,
                                   const std::vector<int64_t>& lens, const std::vector<int>& slots, int64_t steps,
                                   bool* fast_used, const DecodeOptions& fast_options = {},
                                   const DecodeOptions& ref_options = Eager()) {
  ModelRunner ref(model, &bank, 64, kBlock, ref_options);
  ModelRunner fast(model, &bank, 64, kBlock, fast_options);
  *fast_used = fast.fast_decode();
  if (!*fast_used) return {};
  for (int s = 0; s < bank.num_slots(); ++s) fast.SlotChanged(s);
  const int64_t vocab = model->config().vocab_size;
  Rows a = MakeRows(lens, slots, vocab, steps), b = MakeRows(lens, slots, vocab, steps);
  std::vector<ModelRunner::PrefillChunk> ra, rb;
  for (auto& r : a.requests) ra.push_back({r.get(), r->cached_prefix, r->prompt_len()});
  for (auto& r : b.requests) rb.push_back({r.get(), r->cached_prefix, r->prompt_len()});
  ref.Prefill(ra);
  fast.Prefill(rb);
  std::vector<double> diffs;
  for (int64_t step = 0; step < steps; ++step) {
    for (size_t i = 0; i < a.seqs.size(); ++i) {
      const int32_t token = static_cast<int32_t>((step * 13 + i * 5 + 1) % vocab);
      // Decode consumes tokens.back() at position `cached` (all before it are cached).
      for (Sequence* s : {a.seqs[i], b.seqs[i]}) {
        s->tokens.push_back(token);
        s->cached = static_cast<int64_t>(s->tokens.size()) - 1;
      }
    }
    const at::Tensor le = ref.Decode(a.seqs).to(at::kCPU);
    const at::Tensor lf = fast.Decode(b.seqs).to(at::kCPU);
    EXPECT_EQ(le.sizes(), lf.sizes());
    const at::Tensor rows = (le - lf).abs().amax(-1).to(at::kDouble).contiguous();
    diffs.insert(diffs.end(), rows.data_ptr<double>(), rows.data_ptr<double>() + rows.numel());
  }
  return diffs;
}

// The largest of RowDecodeDiffs (0 without a fast path).
double MaxDecodeDiff(std::shared_ptr<const Transformer> model, SlotBank& bank, const std::vector<int64_t>& lens,
                     const std::vector<int>& slots, int64_t steps, bool* fast_used,
                     const DecodeOptions& fast_options = {}, const DecodeOptions& ref_options = Eager()) {
  const std::vector<double> d = RowDecodeDiffs(model, bank, lens, slots, steps, fast_used, fast_options, ref_options);
  return d.empty() ? 0.0 : *std::max_element(d.begin(), d.end());
}

// A generated model of (arch, preset, seed), written into dir.
bool Generate(const std::string& dir, const char* arch, const char* preset, uint64_t seed) {
  testmodel::MakeModelOptions o;
  o.arch = arch;
  o.preset = preset;
  o.seed = seed;
  const Status s = testmodel::MakeModel(o, dir);
  EXPECT_TRUE(s.ok()) << s.message();
  return s.ok();
}

// The model in dir on the GPU in dtype; null (a failure reported) when it does not load.
std::shared_ptr<const Transformer> LoadOnGpu(const std::string& dir, at::ScalarType dtype) {
  auto loaded = Transformer::Load(dir, at::kCUDA, dtype);
  EXPECT_TRUE(loaded.ok()) << loaded.status().message();
  if (!loaded.ok()) return nullptr;
  return std::shared_ptr<const Transformer>(std::move(loaded.value()));
}

void Randomize(SlotBank& bank, int slot, const LoraConfig& c) {
  ASSERT_TRUE(bank.Bind(slot, c).ok());
  at::manual_seed(static_cast<uint64_t>(100 + slot));
  c10::NoGradGuard no_grad;
  for (auto& t : bank.targets())
    if (bank.trains(slot, t.group)) {
      at::Tensor b = t.B.select(0, slot).narrow(-1, 0, c.rank);  // [d_out, r], or an expert target's [E, d_out, r]
      b.copy_(0.3 * at::randn(b.sizes()));
    }
}

// Three adapters that reach different targets: slot 0 every target at
// max_rank, slot 1 attention only (rank 4), slot 2 all but lm_head (rank 6).
void BindMixed(SlotBank& bank, int64_t max_rank) {
  LoraConfig all;
  all.rank = max_rank, all.alpha = 16, all.seed = 1;
  LoraConfig attn_only;
  attn_only.rank = 4, attn_only.alpha = 8, attn_only.seed = 2, attn_only.train_mlp = false;
  LoraConfig no_unembed;
  no_unembed.rank = 6, no_unembed.alpha = 6, no_unembed.seed = 3, no_unembed.train_unembed = false;
  Randomize(bank, 0, all);
  Randomize(bank, 1, attn_only);
  Randomize(bank, 2, no_unembed);
}

TEST(FastDecode, EqualsEagerDecodeWithMixedAdapters) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  test::TempDir dir("loom-fast-decode");
  for (const char* arch : {"qwen3", "qwen2"}) {
    const std::string model_dir = dir.path() + "/" + arch;
    ASSERT_TRUE(Generate(model_dir, arch, "small", 3));  // head_dim 32, 4 layers, vocab 8192
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      std::shared_ptr<const Transformer> model = LoadOnGpu(model_dir, dtype);
      ASSERT_TRUE(model);
      // Max rank 16 runs the bf16 expand on tensor cores; 8 reads LoRA
      // factors with 16-byte loads on CUDA cores; 6 takes the scalar path.
      // The eager path's LoRA as the sampler runs it (sampler.cpp), in fp32
      // (the default) and in the model's dtype (--sampler-lora-math model;
      // the same on an fp32 model).
      for (const bool lora_fp32 : {true, false}) {
        if (!lora_fp32 && dtype == at::kFloat) continue;
        for (int64_t max_rank : {16, 8, 6}) {
          SlotBank bank(3, max_rank, at::kCUDA, model->LoraTargets());
          bank.set_lora_fp32(lora_fp32);
          BindMixed(bank, max_rank);
          // bf16: the two paths round at different points, and logits of
          // magnitude 8-16 have a bf16 step of 0.0625; the scattered 12-row
          // case at max rank 6 measured 0.253 (qwen3) and 0.188 (qwen2) on the
          // H200 in one run, where earlier runs stayed within 0.25: 5 steps.
          const double tol = dtype == at::kFloat ? 1e-4 : 0.3;
          bool used = false;
          // Mixed adapters and the base in one step (batch bucket 8), then one
          // row alone (bucket 1), then base rows only (the graph without LoRA).
          const double mixed = MaxDecodeDiff(model, bank, {5, 17, 33, 1, 40}, {-1, 0, 0, 1, 2}, 3, &used);
          if (!used) GTEST_SKIP() << "no fast decode path in this build";
          const double one = MaxDecodeDiff(model, bank, {20}, {2}, 2, &used);
          const double base = MaxDecodeDiff(model, bank, {9, 30}, {-1, -1}, 2, &used);
          // Two row tiles (bucket 16), each slot's rows scattered over both.
          const double tiles = MaxDecodeDiff(model, bank, {3, 8, 12, 20, 7, 2, 30, 9, 16, 5, 11, 25},
                                             {0, 1, 0, 2, -1, 1, 0, 0, 2, 1, -1, 0}, 2, &used);
          std::printf(
              "fast decode %s %s, LoRA math %s, max rank %lld: max |logit diff| mixed %.3g, one row %.3g, "
              "base %.3g, two tiles %.3g\n",
              arch, dtype == at::kFloat ? "fp32" : "bf16", lora_fp32 ? "fp32" : "model",
              static_cast<long long>(max_rank), mixed, one, base, tiles);
          EXPECT_LE(tiles, tol);
          EXPECT_LE(mixed, tol);
          EXPECT_LE(one, tol);
          EXPECT_LE(base, tol);
        }
      }
    }
  }
}

// Qwen's YaRN on the graphs: the decode kernel scales cos and sin by the
// attention factor as the eager tables do (factor 4 over an original
// context of 16, which the rows' positions pass).
TEST(FastDecode, YarnEqualsEagerDecode) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  test::TempDir dir("loom-fast-decode-yarn");
  const std::string model_dir = dir.path() + "/qwen3";
  ASSERT_TRUE(Generate(model_dir, "qwen3", "small", 3));
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path);
  nlohmann::json cfg = nlohmann::json::parse(in);
  in.close();
  cfg["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16}};
  std::ofstream(path) << cfg.dump(1);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    std::shared_ptr<const Transformer> model = LoadOnGpu(model_dir, dtype);
    ASSERT_TRUE(model);
    ASSERT_EQ(model->config().rope_type, "yarn");
    SlotBank bank(3, 16, at::kCUDA, model->LoraTargets());
    bank.set_lora_fp32(true);  // the eager path as the sampler runs it (sampler.cpp)
    BindMixed(bank, 16);
    bool used = false;
    const double diff = MaxDecodeDiff(model, bank, {5, 17, 33, 1, 40}, {-1, 0, 0, 1, 2}, 3, &used);
    if (!used) GTEST_SKIP() << "no fast decode path in this build";
    std::printf("fast decode qwen3 yarn %s: max |logit diff| %.3g\n", dtype == at::kFloat ? "fp32" : "bf16", diff);
    EXPECT_LE(diff, dtype == at::kFloat ? 1e-4 : 0.3);
  }
}

// An MoE model on the graphs (DecodeOptions::moe_graphs, on by default):
// qwen3_moe's small preset (three MoE layers of 32 experts, layer 1 dense)
// in bf16, the experts' block captured as ATen ops with its LoRA in the pair
// form (engine/model/moe.h), against the eager decode, and off with the
// option off. Two routings:
//  - every expert for every token (num_experts_per_tok rewritten to 32):
//    no route to choose, so the two paths differ by rounding alone and are
//    held to the dense test's bf16 bound;
//  - the preset's top-4: the graph's attention and norms round where the
//    fused kernels do, so a router near a tie can send a token to another
//    expert than the eager path does (measured on the H200: one case at
//    0.537 where the others stayed within 0.17). That changes the rows
//    downstream of the token for real, so here three quarters of each case's
//    row-steps must meet the bound, and all of them 2.0; a wrong slot,
//    expert or offset moves every row with an adapter.
struct MoeDecodeCase {
  const char* name;
  std::vector<int64_t> lens;
  std::vector<int> slots;
  int64_t steps;
};
const std::vector<MoeDecodeCase>& MoeDecodeCases() {
  static const std::vector<MoeDecodeCase> cases = {
      {"mixed", {5, 17, 33, 1, 40}, {-1, 0, 0, 1, 2}, 3},  // adapters and the base in one step (bucket 8)
      {"one row", {20}, {2}, 2},
      {"base", {9, 30}, {-1, -1}, 2},
      // Two row tiles (bucket 16), each slot's rows scattered over both.
      {"two tiles", {3, 8, 12, 20, 7, 2, 30, 9, 16, 5, 11, 25}, {0, 1, 0, 2, -1, 1, 0, 0, 2, 1, -1, 0}, 2}};
  return cases;
}

TEST(FastDecode, MoeEqualsEagerDecodeWithMixedAdapters) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  test::TempDir dir("loom-fast-decode-moe");
  for (const bool every_expert : {true, false}) {
    const std::string model_dir = dir.path() + (every_expert ? "/every" : "/top4");
    ASSERT_TRUE(Generate(model_dir, "qwen3_moe", "small", 3));
    if (every_expert) {
      const std::string path = model_dir + "/config.json";
      std::ifstream in(path);
      nlohmann::json cfg = nlohmann::json::parse(in);
      in.close();
      cfg["num_experts_per_tok"] = cfg["num_experts"];
      std::ofstream(path) << cfg.dump(1);
    }
    std::shared_ptr<const Transformer> model = LoadOnGpu(model_dir, at::kBFloat16);
    ASSERT_TRUE(model);
    ASSERT_EQ(model->config().num_experts_per_tok, every_expert ? model->config().num_experts : 4);
    // The experts' LoRA in fp32 (the default) and in the model's dtype (--sampler-lora-math model).
    for (const bool lora_fp32 : {true, false}) {
      SlotBank bank(3, 16, at::kCUDA, model->LoraTargets());
      bank.set_lora_fp32(lora_fp32);  // the eager path as the sampler runs it (sampler.cpp)
      BindMixed(bank, 16);
      DecodeOptions off;
      off.moe_graphs = false;
      EXPECT_FALSE(ModelRunner(model, &bank, 64, kBlock, off).fast_decode()) << "--moe-decode-graphs off decodes eager";
      for (const MoeDecodeCase& c : MoeDecodeCases()) {
        bool used = false;
        const std::vector<double> d = RowDecodeDiffs(model, bank, c.lens, c.slots, c.steps, &used);
        if (!used) GTEST_SKIP() << "no grouped GEMM in this libtorch: MoE decode stays eager";
        const double worst = *std::max_element(d.begin(), d.end());
        const auto within = std::count_if(d.begin(), d.end(), [](double x) { return x <= 0.3; });
        std::printf(
            "fast decode qwen3_moe bf16, %s, LoRA math %s: %s: max |logit diff| %.3g, %lld of %zu row-steps within "
            "0.3\n",
            every_expert ? "every expert" : "top-4", lora_fp32 ? "fp32" : "model", c.name, worst,
            static_cast<long long>(within), d.size());
        if (every_expert) {
          EXPECT_LE(worst, 0.3) << c.name;
        } else {
          EXPECT_GE(4 * within, 3 * static_cast<int64_t>(d.size())) << c.name;
          EXPECT_LE(worst, 2.0) << c.name;
        }
      }
    }
  }
}

// FastPrefill (model_runner.h) against the eager prefill: a step of fresh
// prompt heads, then a step where most rows continue their cached prefix
// (one is fresh), with mixed adapters and more rows than one replay takes.
// Each chunk's last-token logits must agree, and the fast runner must have
// run both steps on the graphs.
TEST(FastDecode, FastPrefillEqualsEagerPrefill) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  test::TempDir dir("loom-fast-prefill");
  ASSERT_TRUE(Generate(dir.path(), "qwen3", "small", 6));
  // The eager LoRA in fp32 and, in bf16, in the model's dtype too (as in EqualsEagerDecodeWithMixedAdapters).
  for (const auto& [dtype, lora_fp32] : {std::pair{at::kFloat, true}, std::pair{at::kBFloat16, true},
                                         std::pair{at::kBFloat16, false}}) {
    std::shared_ptr<const Transformer> model = LoadOnGpu(dir.path(), dtype);
    ASSERT_TRUE(model);
    SlotBank bank(3, 8, at::kCUDA, model->LoraTargets());
    bank.set_lora_fp32(lora_fp32);  // the eager path as the sampler runs it (sampler.cpp)
    for (int slot = 0; slot < 3; ++slot) {
      LoraConfig c;
      c.rank = 8 - 2 * slot, c.alpha = 16, c.seed = static_cast<uint64_t>(slot + 1);
      Randomize(bank, slot, c);
    }
    ModelRunner ref(model, &bank, 160, kBlock, Eager());
    DecodeOptions with_fast_prefill;
    with_fast_prefill.fast_prefill_tokens = 2048;  // the default (sample_api.h), set here for the test
    ModelRunner fast(model, &bank, 160, kBlock, with_fast_prefill);
    if (!fast.fast_decode()) GTEST_SKIP() << "no fast decode path in this build";
    for (int s = 0; s < bank.num_slots(); ++s) fast.SlotChanged(s);
    // Second step: 847 new rows, four replays; the last prompt's 200 rows over 1,000-1,199 tokens
    // of context attend in chunk tiles (bf16; chunk_tiles.h), their contexts split.
    const std::vector<int64_t> lens = {40, 300, 150, 9, 260, 1200};
    const std::vector<int64_t> heads = {32, 0, 64, 0, 16, 1000};  // prefilled by the first step
    const std::vector<int> slots = {0, 0, 1, -1, 2, 1};
    const int64_t vocab = model->config().vocab_size;
    Rows a = MakeRows(lens, slots, vocab, 0), b = MakeRows(lens, slots, vocab, 0);
    double worst = 0.0;
    for (int step = 0; step < 2; ++step) {
      std::vector<ModelRunner::PrefillChunk> ca, cb;
      for (size_t i = 0; i < lens.size(); ++i) {
        const int64_t begin = step == 0 ? 0 : heads[i], end = step == 0 ? heads[i] : lens[i];
        if (end == begin) continue;
        ca.push_back({a.requests[i].get(), begin, end});
        cb.push_back({b.requests[i].get(), begin, end});
      }
      const at::Tensor le = ref.Prefill(ca).to(at::kCPU), lf = fast.Prefill(cb).to(at::kCPU);
      ASSERT_EQ(le.sizes(), lf.sizes());
      worst = std::max(worst, (le - lf).abs().max().item<double>());
    }
    std::printf("fast prefill %s, LoRA math %s: max |logit diff| vs eager %.3g\n",
                dtype == at::kFloat ? "fp32" : "bf16", lora_fp32 ? "fp32" : "model", worst);
    EXPECT_EQ(fast.fast_prefills(), 2);
    EXPECT_EQ(ref.fast_prefills(), 0);
    EXPECT_LE(worst, dtype == at::kFloat ? 1e-3 : 0.25);
  }
}

// ModelRunner::Mixed against the eager runner's Decode then Prefill: decode
// rows of two finished prompts and the chunks of two prompts (one fresh, one
// continuing its cached head) in one forward, over more rows than one replay
// takes; the decode rows' and each chunk's last-token logits must agree.
TEST(FastDecode, MixedStepEqualsEagerDecodeAndPrefill) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  test::TempDir dir("loom-fast-mixed");
  ASSERT_TRUE(Generate(dir.path(), "qwen3", "small", 7));
  for (const auto& [dtype, lora_fp32] : {std::pair{at::kFloat, true}, std::pair{at::kBFloat16, true},
                                         std::pair{at::kBFloat16, false}}) {
    std::shared_ptr<const Transformer> model = LoadOnGpu(dir.path(), dtype);
    ASSERT_TRUE(model);
    SlotBank bank(3, 8, at::kCUDA, model->LoraTargets());
    bank.set_lora_fp32(lora_fp32);
    for (int slot = 0; slot < 3; ++slot) {
      LoraConfig c;
      c.rank = 8 - 2 * slot, c.alpha = 16, c.seed = static_cast<uint64_t>(slot + 11);
      Randomize(bank, slot, c);
    }
    ModelRunner ref(model, &bank, 128, kBlock, Eager());
    ModelRunner fast(model, &bank, 128, kBlock, DecodeOptions{});
    if (!fast.fast_decode()) GTEST_SKIP() << "no fast decode path in this build";
    for (int s = 0; s < bank.num_slots(); ++s) fast.SlotChanged(s);
    const std::vector<int64_t> lens = {20, 33, 300, 40};  // 0, 1 decode; 2, 3 prefill
    const std::vector<int> slots = {0, 1, 2, -1};
    const int64_t vocab = model->config().vocab_size;
    Rows a = MakeRows(lens, slots, vocab, 1), b = MakeRows(lens, slots, vocab, 1);
    // Before the step: prompts 0 and 1 whole, and prompt 2's first 64 tokens.
    for (auto* r : {&a, &b}) {
      ModelRunner& runner = r == &a ? ref : fast;
      std::vector<ModelRunner::PrefillChunk> first = {
          {r->requests[0].get(), 0, 20}, {r->requests[1].get(), 0, 33}, {r->requests[2].get(), 0, 64}};
      runner.Prefill(first);
      for (int i = 0; i < 2; ++i) {
        Sequence* s = r->seqs[i];
        s->tokens.push_back(static_cast<int32_t>((i * 17 + 3) % vocab));
        s->cached = lens[i];
      }
    }
    const auto chunks = [](Rows& r) {
      return std::vector<ModelRunner::PrefillChunk>{{r.requests[2].get(), 64, 300}, {r.requests[3].get(), 0, 40}};
    };
    const std::vector<Sequence*> rows_a = {a.seqs[0], a.seqs[1]}, rows_b = {b.seqs[0], b.seqs[1]};
    const at::Tensor de = ref.Decode(rows_a).to(at::kCPU);
    const at::Tensor pe = ref.Prefill(chunks(a)).to(at::kCPU);
    const at::Tensor mixed = fast.Mixed(rows_b, chunks(b));
    ASSERT_TRUE(mixed.defined()) << "the step did not run on the graphs";
    ASSERT_EQ(mixed.size(0), 4);
    const at::Tensor m = mixed.to(at::kCPU);
    const double dd = (m.narrow(0, 0, 2) - de).abs().max().item<double>();
    const double pd = (m.narrow(0, 2, 2) - pe).abs().max().item<double>();
    std::printf("mixed step %s, LoRA math %s: max |logit diff| vs eager: decode rows %.3g, prefill chunks %.3g\n",
                dtype == at::kFloat ? "fp32" : "bf16", lora_fp32 ? "fp32" : "model", dd, pd);
    EXPECT_EQ(fast.mixed_steps(), 1);
    EXPECT_LE(dd, dtype == at::kFloat ? 1e-3 : 0.25);
    EXPECT_LE(pd, dtype == at::kFloat ? 1e-3 : 0.25);
  }
}

// A bf16 LoRA shrink over a long input is split over blocks, the partial
// sums added by the tile's last block (engine/sample/cuda/lora.h,
// ShrinkScratch). The small preset's inputs are too short for that;
// qwen2.5-0.5b's down projection (d_in 4864) takes 2 parts. Fast decode
// with the split (the default) against fast decode without it
// (DecodeOptions::split_shrink off), and both against eager.
TEST(FastDecode, SplitShrinkEqualsEager) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  test::TempDir dir("loom-fast-decode-split");
  ASSERT_TRUE(Generate(dir.path(), "qwen2", "qwen2.5-0.5b", 5));
  std::shared_ptr<const Transformer> model = LoadOnGpu(dir.path(), at::kBFloat16);
  ASSERT_TRUE(model);
  SlotBank bank(3, 16, at::kCUDA, model->LoraTargets());
  for (int slot = 0; slot < 3; ++slot) {
    LoraConfig c;
    c.rank = 16 - 4 * slot, c.alpha = 16, c.seed = static_cast<uint64_t>(slot + 1);
    Randomize(bank, slot, c);
  }
  const std::vector<int64_t> lens = {3, 8, 12, 20, 7, 2, 30, 9, 16, 5, 11, 25};
  const std::vector<int> slots = {0, 1, 0, 2, -1, 1, 0, 0, 2, 1, -1, 0};
  bool used = false;
  const double split = MaxDecodeDiff(model, bank, lens, slots, 2, &used);
  if (!used) GTEST_SKIP() << "no fast decode path in this build";
  DecodeOptions unsplit;
  unsplit.split_shrink = false;
  DecodeOptions unsplit_eager = Eager();
  unsplit_eager.split_shrink = false;
  const double whole = MaxDecodeDiff(model, bank, lens, slots, 2, &used, unsplit, unsplit_eager);
  const double between = MaxDecodeDiff(model, bank, lens, slots, 2, &used, {}, unsplit);
  std::printf("fast decode qwen2.5-0.5b bf16, 12 rows, 3 adapters: max |logit diff| vs eager: split %.3g, "
              "unsplit %.3g; split vs unsplit %.3g\n",
              split, whole, between);
  // On the H200: 0.324 and 0.324 vs eager (24 layers of bf16 with adapters
  // far larger than trained ones), 0.097 between: the split only reorders
  // fp32 sums, so it may move bf16 roundings but must not add error (a
  // part left out or added twice would change down's delta in every layer).
  EXPECT_LE(split, 1.25 * whole + 0.01);
  EXPECT_LE(between, whole);
}

// --decode-gemm tuned (DecodeOptions::gemm_tuned): the graphs' base
// projections through cuBLASLt with each shape's timed algorithm, against
// eager decode and against the default graphs (at::linear's cuBLAS), at
// row buckets past the matrix-vector kernel's few rows: 12 rows of three
// adapters and the base (bucket 16), 6 base rows (bucket 8).
TEST(FastDecode, TunedGemmEqualsEager) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  test::TempDir dir("loom-fast-decode-gemm");
  ASSERT_TRUE(Generate(dir.path(), "qwen3", "small", 6));
  std::shared_ptr<const Transformer> model = LoadOnGpu(dir.path(), at::kBFloat16);
  ASSERT_TRUE(model);
  SlotBank bank(3, 16, at::kCUDA, model->LoraTargets());
  bank.set_lora_fp32(false);  // the sampler's default LoRA math
  BindMixed(bank, 16);
  const std::vector<int64_t> lens = {3, 8, 12, 20, 7, 2, 30, 9, 16, 5, 11, 25};
  const std::vector<int> slots = {0, 1, 0, 2, -1, 1, 0, 0, 2, 1, -1, 0};
  const std::vector<int64_t> base_lens = {9, 30, 4, 17, 22, 6};
  const std::vector<int> base_slots(base_lens.size(), -1);
  DecodeOptions tuned;
  tuned.gemm_tuned = true;
  bool used = false;
  const double plain = MaxDecodeDiff(model, bank, lens, slots, 2, &used);
  if (!used) GTEST_SKIP() << "no fast decode path in this build";
  const double mixed = MaxDecodeDiff(model, bank, lens, slots, 2, &used, tuned);
  const double base = MaxDecodeDiff(model, bank, base_lens, base_slots, 2, &used, tuned);
  const double between = MaxDecodeDiff(model, bank, lens, slots, 2, &used, tuned, DecodeOptions{});
  std::printf("[ figure ] fast decode qwen3 small bf16, tuned gemm: max |logit diff| vs eager: 12 mixed rows %.3g "
              "(cublas %.3g), 6 base rows %.3g; tuned vs cublas graphs %.3g\n",
              mixed, plain, base, between);
  // The bounds of EqualsEagerDecodeWithMixedAdapters (bf16: 0.3, five bf16
  // steps of logits of magnitude 8-16): another summation order of the
  // projections moves roundings, not more than the graphs already do.
  EXPECT_LE(mixed, 0.3);
  EXPECT_LE(base, 0.3);
  EXPECT_LE(between, 0.3);
}

// The trainer/sampler consistency on the GPU: tokens sampled by the Sampler
// (fast decode where available) against the trainer's forward logprobs of
// the same tokens and adapter, in fp32 (the 1e-4) and in bf16 (the
// gap docs/compatibility.md states; bounded loosely here). Prints both.
TEST(FastDecode, SampledLogprobsNearTrainerOnGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  test::TempDir dir("loom-fast-decode-lp");
  const std::string model_dir = dir.path() + "/model", adapter = dir.path() + "/adapter";
  ASSERT_TRUE(Generate(model_dir, "qwen3", "small", 4));
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    std::shared_ptr<const Transformer> model = LoadOnGpu(model_dir, dtype);
    ASSERT_TRUE(model);
    if (dtype == at::kFloat) {  // one adapter snapshot, B of a trained adapter's size
      SlotBank bank(1, 8, at::kCUDA, model->LoraTargets());
      LoraConfig c;
      c.rank = 8, c.alpha = 16, c.seed = 5;
      Randomize(bank, 0, c);
      c10::NoGradGuard no_grad;
      for (auto& t : bank.targets()) t.B.mul_(0.2);
      ASSERT_TRUE(SavePeft(bank, 0, adapter, "small").ok());
    }
    SamplerOptions so;
    so.max_rank = 8;
    so.sampler_adapters = 2;
    so.kv_budget_tokens = 4096;
    so.context_window = 256;
    auto sampler = Sampler::Open(model, so);
    ASSERT_TRUE(sampler.ok()) << sampler.status().message();
    SlotBank trainer_bank(1, 8, at::kCUDA, model->LoraTargets());
    ASSERT_TRUE(LoadPeft(trainer_bank, 0, adapter).ok());
    std::vector<int32_t> prompt;
    for (int i = 0; i < 20; ++i) prompt.push_back(static_cast<int32_t>((i * 37 + 11) % 8000));
    double worst = 0.0;
    for (const std::string& a : {std::string(), adapter}) {
      SampleCall call;
      call.prompt = prompt;
      call.adapter_dir = a;
      call.num_samples = 4;
      call.params.max_tokens = 24;
      call.params.temperature = 1.0;
      call.params.seed = 77;
      auto p = std::make_shared<std::promise<Result<SampleOutput>>>();
      auto f = p->get_future();
      (*sampler)->Submit(call, [p](Result<SampleOutput> r) { p->set_value(std::move(r)); });
      Result<SampleOutput> out = f.get();
      ASSERT_TRUE(out.ok()) << out.status().message();
      for (const SampledSequence& seq : out->sequences) {
        std::vector<int32_t> full = prompt;
        full.insert(full.end(), seq.tokens.begin(), seq.tokens.end());
        const std::vector<int32_t> input(full.begin(), full.end() - 1);
        const std::vector<int64_t> targets(full.begin() + 1, full.end());
        c10::NoGradGuard no_grad;
        const PackedBatch b = PackedBatch::Make({input}, {a.empty() ? -1 : 0}, at::kCUDA);
        const at::Tensor lp =
            model->TargetLogprobs(model->Hidden(b, trainer_bank),
                                  at::tensor(targets, at::TensorOptions().dtype(at::kLong)).to(at::kCUDA), b,
                                  trainer_bank)
                .to(at::kCPU)
                .contiguous();
        const size_t off = prompt.size() - 1;
        for (size_t i = 0; i < seq.tokens.size(); ++i)
          worst = std::max(worst, std::abs(static_cast<double>(seq.logprobs[i]) - lp.data_ptr<float>()[off + i]));
      }
    }
    std::printf("sampler vs trainer logprobs on the GPU, %s: max |diff| %.3g\n",
                dtype == at::kFloat ? "fp32" : "bf16", worst);
    EXPECT_LE(worst, dtype == at::kFloat ? 1e-4 : 0.25);
  }
}

}  // namespace
}  // namespace loom::engine
