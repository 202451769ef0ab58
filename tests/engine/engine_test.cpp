// The training engine on a tiny generated qwen3 model, fp32 on CPU:
// packing invariance of logprobs and gradients across tenants, accumulation,
// failure isolation, model-level gradient checks of every loss, the slot
// lifecycle, exact resume from saved state, loading into another layout, and
// the PEFT snapshot.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "engine/api.h"
#include "engine/lora/slot_bank.h"
#include "testmodel/make_model.h"
#include "engine/io/safetensors.h"
#include "engine/model/transformer.h"
#include "engine/train/forward_backward.h"

namespace loom::engine {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kVocab = 512;  // the tiny preset

// A scratch directory removed at exit.
struct TempDir {
  std::string path;
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "loom-engine-test-XXXXXX").string();
    path = ::mkdtemp(templ.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

const std::string& ModelDir() {
  static TempDir dir;
  static bool made = [] {
    testmodel::MakeModelOptions o;
    o.arch = "qwen3";
    o.preset = "tiny";
    o.seed = 1;
    Status s = testmodel::MakeModel(o, dir.path + "/model");
    EXPECT_TRUE(s.ok()) << s.message();
    return true;
  }();
  (void)made;
  static std::string model = dir.path + "/model";
  return model;
}

Datum CeDatum(int n, uint32_t seed, bool weighted = true) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(0, kVocab - 1);
  std::uniform_real_distribution<float> w(-0.5f, 1.5f);
  Datum d;
  std::vector<int64_t> targets;
  std::vector<float> weights;
  for (int i = 0; i < n; ++i) {
    d.tokens.push_back(tok(rng));
    targets.push_back(tok(rng));
    weights.push_back(w(rng));
  }
  d.loss_fn_inputs["target_tokens"] = Array::Ints(targets);
  if (weighted) d.loss_fn_inputs["weights"] = Array::Floats(weights);
  return d;
}

ForwardBackwardCall Call(int slot, std::vector<Datum> data, const std::string& loss = "cross_entropy") {
  ForwardBackwardCall c;
  c.slot = slot;
  c.data = std::move(data);
  c.loss_fn = loss;
  return c;
}

LoraConfig Lora(int rank, uint64_t seed, bool attn = true, bool mlp = true, bool unembed = true) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = 2.0 * rank;
  c.seed = seed;
  c.train_attn = attn;
  c.train_mlp = mlp;
  c.train_unembed = unembed;
  return c;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(double(a[i]) - b[i]));
  return m;
}

// ---------------------------------------------------------------------------
// Rig: the engine's parts, so that tests can read gradients in the bank.
struct Rig {
  std::unique_ptr<Transformer> model;
  std::unique_ptr<SlotBank> bank;

  explicit Rig(int slots = 4, int rank = 8) {
    at::set_num_threads(2);
    auto m = Transformer::Load(ModelDir(), at::kCPU, at::kFloat);
    EXPECT_TRUE(m.ok()) << m.status().message();
    model = std::move(m.value());
    bank = std::make_unique<SlotBank>(slots, rank, at::kCPU, model->LoraTargets());
  }
  // Binds s and gives B random values at the slot's rank (B = 0 after Bind
  // would make every A gradient zero).
  void Bind(int s, const LoraConfig& c) {
    ASSERT_TRUE(bank->Bind(s, c).ok());
    c10::NoGradGuard ng;
    at::manual_seed(100 + s);
    for (auto& t : bank->targets()) {
      if (!bank->trains(s, t.group)) continue;
      t.B.select(0, s).narrow(1, 0, c.rank).normal_(0.0, 0.05);
    }
  }
  std::vector<Result<ForwardBackwardOutput>> Run(const std::vector<ForwardBackwardCall>& calls) {
    return train::ForwardBackward(*model, *bank, calls, kVocab, 0);
  }
  // Slot s's gradients over all targets, flattened.
  std::vector<float> Grads(int s) {
    std::vector<float> out;
    for (auto& t : bank->targets()) {
      for (const at::Tensor* p : {&t.A, &t.B}) {
        at::Tensor g = p->grad().defined() ? p->grad().select(0, s) : at::zeros_like(p->select(0, s));
        g = g.contiguous();
        out.insert(out.end(), g.data_ptr<float>(), g.data_ptr<float>() + g.numel());
      }
    }
    return out;
  }
  void ZeroGrads() {
    for (int s = 0; s < bank->num_slots(); ++s) bank->ZeroGrad(s);
  }
};

std::vector<float> Logprobs(const ForwardBackwardOutput& out) {
  std::vector<float> v;
  for (const auto& o : out.outputs) v.insert(v.end(), o.at("logprobs").f32.begin(), o.at("logprobs").f32.end());
  return v;
}

double Scale(const std::vector<float>& g) {
  double m = 0;
  for (float x : g) m = std::max(m, double(std::abs(x)));
  return m;
}

TEST(ForwardBackward, PackingInvarianceOfLogprobsAndGradients) {
  Rig rig;
  rig.Bind(0, Lora(4, 1));
  rig.Bind(1, Lora(8, 2, true, false, false));  // attn only
  rig.Bind(2, Lora(2, 3, false, true, true));
  const std::vector<Datum> d0 = {CeDatum(5, 10), CeDatum(9, 11)};
  const std::vector<Datum> d1 = {CeDatum(7, 12), CeDatum(3, 13)};
  const std::vector<Datum> d2 = {CeDatum(11, 14)};
  std::vector<std::vector<float>> lp_alone, g_alone;
  for (int s = 0; s < 3; ++s) {
    auto r = rig.Run({Call(s, s == 0 ? d0 : s == 1 ? d1 : d2)});
    ASSERT_TRUE(r[0].ok()) << r[0].status().message();
    lp_alone.push_back(Logprobs(*r[0]));
    g_alone.push_back(rig.Grads(s));
    EXPECT_GT(Scale(g_alone.back()), 0.0);
    rig.ZeroGrads();
  }
  // Packed: slot 0's call in the middle, others of other lengths and slots.
  auto r = rig.Run({Call(1, d1), Call(0, d0), Call(2, d2)});
  for (int s = 0; s < 3; ++s) {
    ASSERT_TRUE(r[s].ok());
    const int slot = s == 0 ? 1 : s == 1 ? 0 : 2;
    EXPECT_LE(MaxAbsDiff(Logprobs(*r[s]), lp_alone[slot]), 1e-5) << "slot " << slot;
    const auto g = rig.Grads(slot);
    EXPECT_LE(MaxAbsDiff(g, g_alone[slot]), 1e-5 * std::max(1.0, Scale(g_alone[slot]))) << "slot " << slot;
  }
  // The unbound slot 3 gets nothing.
  EXPECT_EQ(Scale(rig.Grads(3)), 0.0);
}

TEST(ForwardBackward, GradientsAccumulateAcrossCalls) {
  Rig rig;
  rig.Bind(0, Lora(4, 1));
  const Datum a = CeDatum(6, 20), b = CeDatum(4, 21);
  rig.Run({Call(0, {a, b})});
  const auto together = rig.Grads(0);
  rig.ZeroGrads();
  rig.Run({Call(0, {a})});
  rig.Run({Call(0, {b})});
  const auto summed = rig.Grads(0);
  EXPECT_LE(MaxAbsDiff(summed, together), 1e-5 * std::max(1.0, Scale(together)));
  // Two calls of the same slot in one packed pass also add up.
  rig.ZeroGrads();
  rig.Run({Call(0, {a}), Call(0, {b})});
  EXPECT_LE(MaxAbsDiff(rig.Grads(0), together), 1e-5 * std::max(1.0, Scale(together)));
}

TEST(ForwardBackward, ForwardOnlyLeavesNoGradientAndSameLogprobs) {
  Rig rig;
  rig.Bind(0, Lora(4, 1));
  ForwardBackwardCall c = Call(0, {CeDatum(6, 30), CeDatum(2, 31)});
  c.forward_only = true;
  auto fwd = rig.Run({c});
  ASSERT_TRUE(fwd[0].ok());
  EXPECT_EQ(Scale(rig.Grads(0)), 0.0);
  c.forward_only = false;
  auto fb = rig.Run({c});
  ASSERT_TRUE(fb[0].ok());
  EXPECT_LE(MaxAbsDiff(Logprobs(*fwd[0]), Logprobs(*fb[0])), 1e-6);
  EXPECT_NEAR(fwd[0]->metrics.at("loss:sum"), fb[0]->metrics.at("loss:sum"), 1e-5);
  // Outputs: logprobs and elementwise_loss with the datum's shape; loss:sum = Σ −lp·w.
  const auto& o = fb[0]->outputs[1];
  ASSERT_EQ(o.at("logprobs").shape, std::vector<int64_t>({2}));
  ASSERT_EQ(o.at("elementwise_loss").shape, std::vector<int64_t>({2}));
  double sum = 0;
  for (const auto& out : fb[0]->outputs)
    for (float e : out.at("elementwise_loss").f32) sum += e;
  EXPECT_NEAR(sum, fb[0]->metrics.at("loss:sum"), 1e-4);
  const auto& w = c.data[1].loss_fn_inputs.at("weights").f32;
  EXPECT_NEAR(o.at("elementwise_loss").f32[1], -o.at("logprobs").f32[1] * w[1], 1e-6);
  for (float lp : o.at("logprobs").f32) EXPECT_LT(lp, 0.0f);
}

TEST(ForwardBackward, TopKTargetsGiveOneLogprobPerCandidate) {
  Rig rig;
  rig.Bind(0, Lora(4, 1));
  Datum flat = CeDatum(4, 40);
  Datum topk;
  topk.tokens = flat.tokens;
  std::vector<int64_t> t;
  std::vector<float> w;
  const auto& ft = flat.loss_fn_inputs.at("target_tokens").i64;
  for (int i = 0; i < 4; ++i) {
    t.insert(t.end(), {ft[i], (ft[i] + 7) % kVocab, (ft[i] + 99) % kVocab});
    w.insert(w.end(), {0.5f, 0.3f, -0.2f});
  }
  Array ta = Array::Ints(t), wa = Array::Floats(w);
  ta.shape = wa.shape = {4, 3};
  topk.loss_fn_inputs = {{"target_tokens", ta}, {"weights", wa}};
  // Packed together with the 1-D datum of another call (K padded internally).
  auto r = rig.Run({Call(0, {flat}), Call(0, {topk})});
  ASSERT_TRUE(r[0].ok() && r[1].ok());
  const Array& lp = r[1]->outputs[0].at("logprobs");
  ASSERT_EQ(lp.shape, std::vector<int64_t>({4, 3}));
  const Array& lp1 = r[0]->outputs[0].at("logprobs");
  ASSERT_EQ(lp1.shape, std::vector<int64_t>({4}));
  double want = 0;
  for (int i = 0; i < 12; ++i) want += -lp.f32[i] * w[i];
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(lp.f32[i * 3], lp1.f32[i], 1e-6);  // column 0 = the flat targets
  EXPECT_NEAR(r[1]->metrics.at("loss:sum"), want, 1e-4);
}

TEST(ForwardBackward, BadOrNonFiniteCallFailsAloneAndLeavesOthersExact) {
  Rig rig;
  rig.Bind(0, Lora(4, 1));
  rig.Bind(1, Lora(4, 2));
  const std::vector<Datum> good = {CeDatum(6, 50)};
  rig.Run({Call(0, good)});
  const auto alone = rig.Grads(0);
  rig.ZeroGrads();
  // Slot 1: importance sampling with sampler logprobs far below the model's:
  // exp(lp − q) overflows, the loss is −inf.
  Datum rl;
  rl.tokens = {1, 2, 3, 4};
  rl.loss_fn_inputs["target_tokens"] = Array::Ints({2, 3, 4, 5});
  rl.loss_fn_inputs["logprobs"] = Array::Floats({-1e4f, -1e4f, -1e4f, -1e4f});
  rl.loss_fn_inputs["advantages"] = Array::Floats({1, 1, 1, 1});
  Datum bad = CeDatum(3, 51);
  bad.loss_fn_inputs["weights"] = Array::Floats({1, 1});
  auto r = rig.Run({Call(1, {rl}, "importance_sampling"), Call(0, good), Call(1, {bad}), Call(3, good)});
  ASSERT_FALSE(r[0].ok());
  EXPECT_NE(r[0].status().message().find("not finite"), std::string::npos);
  ASSERT_TRUE(r[1].ok());
  ASSERT_FALSE(r[2].ok());
  EXPECT_NE(r[2].status().message().find("data[0].loss_fn_inputs.weights"), std::string::npos) << r[2].status().message();
  ASSERT_FALSE(r[3].ok());  // unbound slot
  EXPECT_LE(MaxAbsDiff(rig.Grads(0), alone), 1e-5 * std::max(1.0, Scale(alone)));
  EXPECT_EQ(Scale(rig.Grads(1)), 0.0);
  for (float g : rig.Grads(1)) ASSERT_TRUE(std::isfinite(g));
}

// d(loss)/d(θ) of each loss through the whole model: the autograd gradient
// against a central difference along a random direction D of slot 0's
// weights, <∇L, D> ≈ (L(θ+hD) − L(θ−hD)) / 2h.
TEST(ForwardBackward, ModelGradientsMatchFiniteDifferencesForEveryLoss) {
  Rig rig;
  rig.Bind(0, Lora(4, 1));
  const std::vector<Datum> ce = {CeDatum(7, 60), CeDatum(4, 61)};
  // RL datums: targets and inputs from the model's own logprobs, shifted so
  // the ratio is inside PPO's clip range and above CISPO's upper bound
  // (where the stop-gradient factor is constant, so the difference quotient
  // and the surrogate gradient agree).
  ForwardBackwardCall probe = Call(0, ce);
  probe.forward_only = true;
  const auto lp = Logprobs(*rig.Run({probe})[0]);
  auto rl_data = [&](double shift) {
    std::vector<Datum> out;
    size_t k = 0;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> adv(-1.0f, 1.0f);
    for (const Datum& d : ce) {
      Datum r;
      r.tokens = d.tokens;
      r.loss_fn_inputs["target_tokens"] = d.loss_fn_inputs.at("target_tokens");
      std::vector<float> q, a;
      for (size_t i = 0; i < d.tokens.size(); ++i, ++k) {
        q.push_back(lp[k] - shift);
        a.push_back(adv(rng));
      }
      r.loss_fn_inputs["logprobs"] = Array::Floats(q);
      r.loss_fn_inputs["advantages"] = Array::Floats(a);
      out.push_back(r);
    }
    return out;
  };
  struct Case {
    std::string loss;
    std::vector<Datum> data;
  };
  const std::vector<Case> cases = {{"cross_entropy", ce},
                                   {"importance_sampling", rl_data(0.05)},
                                   {"ppo", rl_data(0.05)},
                                   {"cispo", rl_data(2.0)},
                                   {"dro", rl_data(0.3)}};
  at::manual_seed(9);
  std::vector<at::Tensor> dirs;
  for (auto& t : rig.bank->targets()) {
    for (const at::Tensor* p : {&t.A, &t.B}) {
      at::Tensor d = at::zeros_like(p->detach());
      if (rig.bank->trains(0, t.group)) {
        at::Tensor row = p->dim() == 3 && p == &t.A ? d.select(0, 0).narrow(0, 0, 4) : d.select(0, 0).narrow(1, 0, 4);
        row.normal_();
      }
      dirs.push_back(d);
    }
  }
  auto shift = [&](double h) {
    c10::NoGradGuard ng;
    size_t i = 0;
    for (auto& t : rig.bank->targets()) {
      t.A.detach().add_(dirs[i++], h);
      t.B.detach().add_(dirs[i++], h);
    }
  };
  const double h = 1e-3;  // 1e-2 is already outside the linear regime here
  for (const Case& c : cases) {
    rig.ZeroGrads();
    auto r = rig.Run({Call(0, c.data, c.loss)});
    ASSERT_TRUE(r[0].ok()) << c.loss << ": " << r[0].status().message();
    double dot = 0;
    size_t i = 0;
    for (auto& t : rig.bank->targets()) {
      dot += (t.A.grad() * dirs[i++]).sum().item<double>();
      dot += (t.B.grad() * dirs[i++]).sum().item<double>();
    }
    ForwardBackwardCall f = Call(0, c.data, c.loss);
    f.forward_only = true;
    shift(h);
    const double up = rig.Run({f})[0]->metrics.at("loss:sum");
    shift(-2 * h);
    const double down = rig.Run({f})[0]->metrics.at("loss:sum");
    shift(h);
    const double fd = (up - down) / (2 * h);
    EXPECT_NEAR(dot, fd, 2e-2 * std::max(1.0, std::abs(fd))) << c.loss;
    EXPECT_GT(std::abs(dot), 1e-3) << c.loss << ": a vanishing gradient tests nothing";
  }
}

// ---------------------------------------------------------------------------
// Through the Engine interface.

EngineOptions Options(int slots = 4, int rank = 8, int64_t context = 0) {
  EngineOptions o;
  o.model_dir = ModelDir();
  o.device = "cpu";
  o.dtype = "auto";
  o.max_slots = slots;
  o.max_rank = rank;
  o.context_window = context;
  o.threads = 2;
  return o;
}

std::unique_ptr<Engine> Open(int slots = 4, int rank = 8, int64_t context = 0) {
  auto e = Engine::Open(Options(slots, rank, context));
  EXPECT_TRUE(e.ok()) << e.status().message();
  return std::move(e.value());
}

// One training step on slot s; returns loss:sum.
double TrainStep(Engine& e, int s, const std::vector<Datum>& data, const std::string& loss = "cross_entropy") {
  auto r = e.ForwardBackward({Call(s, data, loss)});
  EXPECT_TRUE(r[0].ok()) << r[0].status().message();
  OptimStepCall o;
  o.slot = s;
  o.params.learning_rate = 1e-2;
  o.params.weight_decay = 0.01;
  o.params.grad_clip_norm = 1.0;
  auto st = e.OptimStep({o});
  EXPECT_TRUE(st[0].ok()) << st[0].status().message();
  return r[0].ok() ? r[0]->metrics.at("loss:sum") : NAN;
}

std::vector<Datum> Batch(uint32_t seed) { return {CeDatum(8, seed), CeDatum(5, seed + 1, false)}; }

TEST(Engine, OpenReportsTheModelAndLayout) {
  auto e = Open(3, 16, 64);
  const ModelInfo& i = e->info();
  EXPECT_EQ(i.model_type, "qwen3");
  EXPECT_EQ(i.device, "cpu");
  EXPECT_EQ(i.dtype, "float32");
  EXPECT_EQ(i.vocab_size, kVocab);
  EXPECT_EQ(i.context_window, 64);
  EXPECT_EQ(i.max_slots, 3);
  EXPECT_EQ(i.max_rank, 16);
  // The frozen weights' element count (MFU's N) is what the checkpoint holds.
  auto weights = ModelWeights::Open(ModelDir());
  ASSERT_TRUE(weights.ok()) << weights.status().message();
  int64_t stored = 0;
  for (const auto& [name, view] : weights->tensors()) stored += view.numel();
  EXPECT_EQ(i.base_parameters, stored);
  EXPECT_EQ(e->Memory().peak_allocated, 0);  // no device allocator on the CPU
  EngineOptions bad;
  bad.model_dir = ModelDir();
  bad.dtype = "fp8";
  EXPECT_FALSE(Engine::Open(bad).ok());
  bad.dtype = "auto";
  bad.model_dir = ModelDir() + "/nonexistent";
  EXPECT_FALSE(Engine::Open(bad).ok());
}

// The adapter slots are checked against memory before any exists: more slots
// than RAM holds is a 400-class error naming the flag and the per-slot bytes,
// never an allocation failure.
TEST(Engine, SlotsThatDoNotFitAreRefusedUpFront) {
  auto e = Open(2, 8);
  const int64_t slot = e->info().slot_bytes;
  int64_t elems = 0;
  auto model = Transformer::Load(ModelDir(), at::kCPU, at::kFloat);
  ASSERT_TRUE(model.ok());
  for (const LoraTargetSpec& t : (*model)->LoraTargets()) elems += t.AElems(8) + t.BElems(8);
  EXPECT_EQ(slot, 16 * elems);  // fp32 weights, gradient and two moments
  EngineOptions o;
  o.model_dir = ModelDir();
  o.max_rank = 8;
  o.max_slots = 1 << 30;  // about 2^30 * slot bytes: far beyond any machine's RAM
  auto refused = Engine::Open(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("--max-adapters"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("MiB each"), std::string::npos) << refused.status().message();
}

// Moments on the host (EngineOptions::moments): half the slot's bytes on the
// device, the same training numbers as resident moments (up to the float
// rounding of the multi-tensor path the CPU reference does not use), and a
// checkpoint saved from one placement resumes in the other.
TEST(Engine, MomentsOnTheHostTrainAndResumeLikeResidentOnes) {
  TempDir tmp;
  const auto open = [](const std::string& moments) {
    EngineOptions o = Options(2, 8);
    o.moments = moments;
    return Engine::Open(o);
  };
  auto host = open("host");
  ASSERT_TRUE(host.ok()) << host.status().message();
  auto resident = open("auto");
  ASSERT_TRUE(resident.ok());
  const ModelInfo& h = (*host)->info();
  EXPECT_TRUE(h.moments_on_host);
  EXPECT_FALSE((*resident)->info().moments_on_host);  // auto keeps them on the device when they fit
  EXPECT_EQ(2 * h.slot_bytes, (*resident)->info().slot_bytes);
  EXPECT_EQ(h.slot_host_bytes, h.slot_bytes);
  auto bad = open("gpu");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("moments"), std::string::npos) << bad.status().message();

  Engine& a = **host;
  Engine& b = **resident;
  ASSERT_TRUE(a.BindSlot(1, Lora(4, 3)).ok());
  ASSERT_TRUE(b.BindSlot(1, Lora(4, 3)).ok());
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(TrainStep(a, 1, Batch(300 + i)), TrainStep(b, 1, Batch(300 + i)), 1e-4);
  ASSERT_TRUE(a.SaveState(1, tmp.path + "/from_host").ok());
  auto c = open("device");
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->BindSlot(0, Lora(4, 3)).ok());
  const Status loaded = (*c)->LoadState(0, tmp.path + "/from_host", /*with_optimizer=*/true);
  ASSERT_TRUE(loaded.ok()) << loaded.message();
  for (int i = 3; i < 5; ++i) {
    const double want = TrainStep(b, 1, Batch(300 + i));
    EXPECT_NEAR(TrainStep(**c, 0, Batch(300 + i)), want, 1e-4);
    EXPECT_NEAR(TrainStep(a, 1, Batch(300 + i)), want, 1e-4);
  }
}

TEST(Engine, BindChecksRankSlotAndGroups) {
  auto e = Open(2, 8);
  Status s = e->BindSlot(0, Lora(9, 1));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("rank"), std::string::npos);
  EXPECT_NE(s.message().find("8"), std::string::npos);
  EXPECT_FALSE(e->BindSlot(0, Lora(0, 1)).ok());
  EXPECT_FALSE(e->BindSlot(2, Lora(4, 1)).ok());
  EXPECT_FALSE(e->BindSlot(0, Lora(4, 1, false, false, false)).ok());
  ASSERT_TRUE(e->BindSlot(0, Lora(8, 1)).ok());
  EXPECT_FALSE(e->BindSlot(0, Lora(8, 1)).ok());  // already bound
}

TEST(Engine, ContextWindowAndValidationNameTheDatum) {
  auto e = Open(2, 8, 16);
  ForwardBackwardCall c = Call(0, {CeDatum(4, 1), CeDatum(17, 2)});
  Status s = e->ValidateForwardBackward(c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("data[1]"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("16"), std::string::npos) << s.message();
  c = Call(0, {CeDatum(4, 1)});
  c.data[0].loss_fn_inputs["target_tokens"].i64[2] = kVocab;
  s = e->ValidateForwardBackward(c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("data[0].loss_fn_inputs.target_tokens"), std::string::npos) << s.message();
  ASSERT_TRUE(e->BindSlot(0, Lora(4, 1)).ok());
  auto r = e->ForwardBackward({c});
  ASSERT_FALSE(r[0].ok());
  EXPECT_EQ(r[0].status().code(), Code::kInvalidArgument);
}

TEST(Engine, ReleaseWipesWeightsGradientsAndMoments) {
  auto e = Open(2, 8);
  auto fresh = Open(2, 8);
  ASSERT_TRUE(e->BindSlot(1, Lora(4, 5)).ok());
  ASSERT_TRUE(fresh->BindSlot(1, Lora(4, 5)).ok());
  for (int i = 0; i < 2; ++i) TrainStep(*e, 1, Batch(70 + i));
  e->ForwardBackward({Call(1, Batch(80))});  // leave gradients behind
  e->ReleaseSlot(1);
  ASSERT_TRUE(e->BindSlot(1, Lora(4, 5)).ok());
  // Same as a never-used slot: two more steps give identical losses.
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(TrainStep(*e, 1, Batch(90 + i)), TrainStep(*fresh, 1, Batch(90 + i)), 1e-6);
}

TEST(Engine, SeveralSlotsStepInOneCall) {
  auto e = Open(3, 8);
  ASSERT_TRUE(e->BindSlot(0, Lora(4, 1)).ok());
  ASSERT_TRUE(e->BindSlot(2, Lora(8, 2)).ok());
  auto r = e->ForwardBackward({Call(0, Batch(1)), Call(2, Batch(2))});
  ASSERT_TRUE(r[0].ok() && r[1].ok());
  OptimStepCall a{0, {}}, b{2, {}};
  b.params.learning_rate = 1e-3;
  auto st = e->OptimStep({a, b});
  ASSERT_TRUE(st[0].ok() && st[1].ok());
  EXPECT_EQ(st[0]->metrics.at("step"), 1);
  EXPECT_EQ(st[1]->metrics.at("learning_rate"), 1e-3);
  EXPECT_GT(st[0]->metrics.at("grad_norm"), 0);
  EXPECT_NE(st[0]->metrics.at("grad_norm"), st[1]->metrics.at("grad_norm"));
}

TEST(Engine, ResumeFromSavedStateIsExact) {
  TempDir tmp;
  auto a = Open(4, 8);
  ASSERT_TRUE(a->BindSlot(1, Lora(4, 3)).ok());
  for (int i = 0; i < 3; ++i) TrainStep(*a, 1, Batch(100 + i));
  ASSERT_TRUE(a->SaveState(1, tmp.path + "/ckpt").ok());
  std::vector<double> uninterrupted;
  for (int i = 3; i < 6; ++i) uninterrupted.push_back(TrainStep(*a, 1, Batch(100 + i)));

  // A fresh engine, another slot index.
  auto b = Open(4, 8);
  auto info = Engine::ReadStateInfo(tmp.path + "/ckpt");
  ASSERT_TRUE(info.ok()) << info.status().message();
  EXPECT_EQ(info->step, 3);
  EXPECT_EQ(info->lora.rank, 4);
  EXPECT_EQ(info->lora.seed, 3u);
  EXPECT_TRUE(info->has_optimizer);
  ASSERT_TRUE(b->BindSlot(2, info->lora).ok());
  Status s = b->LoadState(2, tmp.path + "/ckpt", true);
  ASSERT_TRUE(s.ok()) << s.message();
  for (int i = 3; i < 6; ++i) EXPECT_NEAR(TrainStep(*b, 2, Batch(100 + i)), uninterrupted[i - 3], 1e-6) << "step " << i;

  // Another layout: larger max_rank, fewer slots (different matmul shapes: float tolerance).
  auto c = Open(2, 16);
  ASSERT_TRUE(c->BindSlot(0, info->lora).ok());
  ASSERT_TRUE(c->LoadState(0, tmp.path + "/ckpt", true).ok());
  for (int i = 3; i < 6; ++i)
    EXPECT_NEAR(TrainStep(*c, 0, Batch(100 + i)), uninterrupted[i - 3], 1e-4) << "step " << i;

  // Without the optimizer: same weights (same first loss), step restarts.
  auto d = Open(2, 8);
  ASSERT_TRUE(d->BindSlot(0, info->lora).ok());
  ASSERT_TRUE(d->LoadState(0, tmp.path + "/ckpt", false).ok());
  auto r = d->ForwardBackward({Call(0, Batch(103))});
  ASSERT_TRUE(r[0].ok());
  EXPECT_NEAR(r[0]->metrics.at("loss:sum"), uninterrupted[0], 1e-6);
  auto st = d->OptimStep({{0, {}}});
  ASSERT_TRUE(st[0].ok());
  EXPECT_EQ(st[0]->metrics.at("step"), 1);
}

TEST(Engine, StateChecksAndAtomicity) {
  TempDir tmp;
  auto e = Open(2, 8);
  ASSERT_TRUE(e->BindSlot(0, Lora(4, 3)).ok());
  EXPECT_FALSE(e->SaveState(1, tmp.path + "/x").ok());  // unbound slot
  TrainStep(*e, 0, Batch(1));
  const std::string dir = tmp.path + "/ckpt";
  ASSERT_TRUE(e->SaveState(0, dir).ok());
  Status again = e->SaveState(0, dir);
  EXPECT_EQ(again.code(), Code::kAlreadyExists);
  for (const auto& entry : fs::directory_iterator(tmp.path))  // no temp dir left behind
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
  // Tensors are stored at rank 4, not max_rank 8.
  auto f = SafetensorsFile::Open(dir + "/adapter_state.safetensors");
  ASSERT_TRUE(f.ok());
  const TensorView* a = (*f)->find("model.layers.0.self_attn.q_proj.lora_A");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape[0], 4);
  ASSERT_NE((*f)->find("model.layers.0.self_attn.q_proj.lora_B.exp_avg_sq"), nullptr);

  auto other = Open(2, 8);
  ASSERT_TRUE(other->BindSlot(0, Lora(8, 3)).ok());
  Status s = other->LoadState(0, dir, true);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("rank"), std::string::npos) << s.message();
  ASSERT_TRUE(other->BindSlot(1, Lora(4, 3, true, false, true)).ok());
  s = other->LoadState(1, dir, true);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("train_mlp"), std::string::npos) << s.message();
  EXPECT_EQ(Engine::ReadStateInfo(tmp.path + "/missing").status().code(), Code::kNotFound);
}

TEST(Engine, SaveForSamplerWritesPeftTrimmedToRank) {
  TempDir tmp;
  auto e = Open(2, 8);
  ASSERT_TRUE(e->BindSlot(1, Lora(4, 3, true, true, false)).ok());
  TrainStep(*e, 1, Batch(1));
  const std::string dir = tmp.path + "/sampler";
  Status s = e->SaveForSampler(1, dir, "Qwen/Qwen3-tiny");
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(fs::exists(dir + "/adapter_config.json"));
  auto f = SafetensorsFile::Open(dir + "/adapter_model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().message();
  int lora_a = 0;
  for (const auto& [name, view] : (*f)->tensors()) {
    EXPECT_EQ(name.find("lm_head"), std::string::npos) << "unembed is not trained: " << name;
    EXPECT_EQ(name.rfind("base_model.model.model.layers.", 0), 0u) << name;
    EXPECT_EQ(name.substr(name.size() - 7), ".weight") << name;
    if (name.find("lora_A") != std::string::npos) {
      ++lora_a;
      EXPECT_EQ(view.shape[0], 4) << name;
    } else {
      EXPECT_EQ(view.shape.back(), 4) << name;
    }
  }
  EXPECT_EQ(lora_a, 2 * 7);  // 2 layers × (q, k, v, o, gate, up, down)
  std::ifstream cfg(dir + "/adapter_config.json");
  std::string text((std::istreambuf_iterator<char>(cfg)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("Qwen/Qwen3-tiny"), std::string::npos);
  EXPECT_NE(text.find("\"r\": 4"), std::string::npos) << text;
  EXPECT_NE(text.find("q_proj"), std::string::npos) << text;
  EXPECT_EQ(e->SaveForSampler(1, dir, "Qwen/Qwen3-tiny").code(), Code::kAlreadyExists);  // immutable
}

// A sampler snapshot is the slot as it was when taken: the training,
// release and rebinding after it do not reach the files written from it
// (on a GPU, through the writer's pinned copy), which are the engine's own
// save of the slot at the snapshot, byte for byte.
void SnapshotIsUnchangedByLaterCalls(const std::string& device) {
  TempDir tmp;
  EngineOptions o = Options(2, 8);
  o.device = device;
  auto opened = Engine::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  Engine* e = opened->get();
  EXPECT_EQ(e->SnapshotForSampler(1).status().code(), Code::kFailedPrecondition);  // not bound
  ASSERT_TRUE(e->BindSlot(1, Lora(4, 3)).ok());
  TrainStep(*e, 1, Batch(1));
  auto snapshot = e->SnapshotForSampler(1);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status().message();
  ASSERT_TRUE(e->SaveForSampler(1, tmp.path + "/then", "tiny").ok());
  TrainStep(*e, 1, Batch(2));
  ASSERT_TRUE(e->SaveForSampler(1, tmp.path + "/trained", "tiny").ok());
  e->ReleaseSlot(1);
  ASSERT_TRUE(e->BindSlot(1, Lora(8, 4)).ok());
  ASSERT_TRUE((*snapshot)->WritePeft(tmp.path + "/later", "tiny").ok());
  const auto bytes = [&](const std::string& dir, const char* file) {
    std::ifstream in(tmp.path + "/" + dir + "/" + file, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  for (const char* file : {"adapter_model.safetensors", "adapter_config.json"})
    EXPECT_EQ(bytes("later", file), bytes("then", file)) << file;
  EXPECT_NE(bytes("trained", "adapter_model.safetensors"), bytes("then", "adapter_model.safetensors"));
  EXPECT_EQ((*snapshot)->WritePeft(tmp.path + "/later", "tiny").code(), Code::kAlreadyExists);  // immutable
}

TEST(Engine, SnapshotForSamplerIsUnchangedByLaterCallsOnItsSlot) { SnapshotIsUnchangedByLaterCalls("cpu"); }

TEST(Engine, SnapshotForSamplerIsUnchangedByLaterCallsOnItsSlotOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  SnapshotIsUnchangedByLaterCalls("cuda");
}

}  // namespace
}  // namespace loom::engine
