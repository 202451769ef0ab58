// Fault isolation: tenant A (slot 0) produces inf/NaN in every way it can
// (its adapter's weights, weights so large its activations overflow, loss
// weights and advantages that overflow, optimizer hyperparameters), and
// tenant B (slot 1), packed into the same passes, gets logprobs, gradients and
// samples bit-identical to those of a run in which A behaved. On the routed and
// the segment LoRA form (the CPU's two), and in the sampler's prefill and
// decode. Also: a step that would make a slot non-finite fails and changes
// nothing, and gradient marks undo a forward_backward whole.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <future>
#include <limits>
#include <optional>
#include <random>

#include "../common/temp_dir.h"
#include "engine/api.h"
#include "engine/io/peft.h"
#include "engine/lora/slot_bank.h"
#include "testmodel/make_model.h"
#include "engine/model/transformer.h"
#include "engine/sample_api.h"
#include "engine/train/forward_backward.h"

namespace loom::engine {
namespace {

constexpr int64_t kVocab = 512;  // the tiny preset
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

const std::string& ModelDir() {
  static test::TempDir dir("loom-isolation-test");
  static const std::string model = [] {
    testmodel::MakeModelOptions o;
    o.arch = "qwen3";
    o.preset = "tiny";
    o.seed = 3;
    Status s = testmodel::MakeModel(o, dir / "model");
    EXPECT_TRUE(s.ok()) << s.message();
    return dir / "model";
  }();
  return model;
}

std::shared_ptr<const Transformer> Model() {
  static std::shared_ptr<const Transformer> m = [] {
    auto t = Transformer::Load(ModelDir(), at::kCPU, at::kFloat);
    EXPECT_TRUE(t.ok()) << t.status().message();
    return std::shared_ptr<const Transformer>(std::move(t.value()));
  }();
  return m;
}

// The ways tenant A poisons a pass.
enum class Poison {
  kNone,             // the reference: A behaves
  kInfNanWeights,    // +inf in some A factors, NaN in some B factors
  kHugeWeights,      // finite B of 1e30: A's activations overflow
  kHugeLossWeights,  // cross_entropy weights of 3e38
  kNanLossWeights,   // NaN weights (the wire refuses them; the engine must not care)
  kHugeAdvantages,   // importance_sampling: advantages 3e38, sampling logprobs -1e30
};

const char* Name(Poison p) {
  switch (p) {
    case Poison::kNone: return "none";
    case Poison::kInfNanWeights: return "inf/nan weights";
    case Poison::kHugeWeights: return "huge weights";
    case Poison::kHugeLossWeights: return "huge loss weights";
    case Poison::kNanLossWeights: return "nan loss weights";
    case Poison::kHugeAdvantages: return "huge advantages";
  }
  return "?";
}

Datum MakeDatum(int n, uint32_t seed, const std::string& loss, float weight_value, bool poison_weights) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(0, kVocab - 1);
  std::uniform_real_distribution<float> w(-0.5f, 1.5f);
  Datum d;
  std::vector<int64_t> targets;
  std::vector<float> weights, logprobs;
  for (int i = 0; i < n; ++i) {
    d.tokens.push_back(tok(rng));
    targets.push_back(tok(rng));
    weights.push_back(poison_weights ? weight_value : w(rng));
    logprobs.push_back(poison_weights && loss != "cross_entropy" ? -1e30f : -6.0f + 0.1f * w(rng));
  }
  d.loss_fn_inputs["target_tokens"] = Array::Ints(targets);
  if (loss == "cross_entropy") {
    d.loss_fn_inputs["weights"] = Array::Floats(weights);
  } else {
    d.loss_fn_inputs["logprobs"] = Array::Floats(logprobs);
    d.loss_fn_inputs["advantages"] = Array::Floats(weights);
  }
  return d;
}

void Bind(SlotBank& bank, int s, int rank, uint64_t seed) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = 2.0 * rank;
  c.seed = seed;
  ASSERT_TRUE(bank.Bind(s, c).ok());
  c10::NoGradGuard ng;
  at::manual_seed(seed);
  for (auto& t : bank.targets()) t.B.select(0, s).narrow(1, 0, rank).normal_(0.0, 0.05);
}

void PoisonWeights(SlotBank& bank, int s, int rank, Poison p) {
  c10::NoGradGuard ng;
  auto& ts = bank.targets();
  if (p == Poison::kInfNanWeights) {
    for (size_t i = 0; i < ts.size(); ++i) {
      if (i % 3 == 0) ts[i].A.select(0, s).narrow(0, 0, rank).fill_(kInf);
      if (i % 3 == 1) ts[i].B.select(0, s).narrow(1, 0, rank).fill_(kNaN);
    }
  }
  if (p == Poison::kHugeWeights)
    for (auto& t : ts) t.B.select(0, s).narrow(1, 0, rank).fill_(1e30f);
}

struct Outcome {
  bool a_ok = false;
  std::vector<float> b_logprobs;
  std::vector<float> b_grads;  // every target's A and B gradient rows of slot 1
  std::vector<float> a_grads;  // and of slot 0
  LoraForm form = LoraForm::kSegment;
};

// One packed forward_backward of A's and B's calls through the engine's own
// pass (train::ForwardBackward: one forward, one backward of the finite
// losses). max_rank picks the LoRA form: U*R <= 64 is routed on the CPU.
Outcome RunPass(int max_rank, Poison poison, const std::string& loss, bool with_a = true,
                std::optional<LoraForm> force = std::nullopt, bool ragged = false) {
  const std::shared_ptr<const Transformer> model = Model();
  SlotBank bank(2, max_rank, at::kCPU, model->LoraTargets());
  bank.ForceForm(force);
  bank.AllowRagged(ragged);
  const int rank_a = std::min(4, max_rank), rank_b = std::min(6, max_rank);
  Bind(bank, 0, rank_a, 21);
  Bind(bank, 1, rank_b, 22);
  PoisonWeights(bank, 0, rank_a, poison);
  const bool loss_poison = poison == Poison::kHugeLossWeights || poison == Poison::kNanLossWeights ||
                           poison == Poison::kHugeAdvantages;
  const float value = poison == Poison::kNanLossWeights ? kNaN : 3e38f;
  ForwardBackwardCall a, b;
  a.slot = 0;
  b.slot = 1;
  a.loss_fn = b.loss_fn = loss;
  a.data = {MakeDatum(9, 1, loss, value, loss_poison), MakeDatum(5, 2, loss, value, loss_poison)};
  b.data = {MakeDatum(7, 3, loss, 0, false), MakeDatum(11, 4, loss, 0, false)};
  std::vector<ForwardBackwardCall> calls = {b};
  if (with_a) calls.insert(calls.begin(), a);
  auto results = train::ForwardBackward(*model, bank, calls, kVocab, 0);
  Result<ForwardBackwardOutput>& rb = results.back();
  Outcome o;
  {
    std::vector<std::vector<int32_t>> seqs;
    for (const auto* c : {&a, &b})
      for (const Datum& d : c->data) seqs.push_back(d.tokens);
    const PackedBatch batch = PackedBatch::Make(seqs, {0, 0, 1, 1}, at::kCPU);
    o.form = bank.ChooseForm(TargetGroup::kAttn, batch.seq_begin, batch.seq_slot);
  }
  o.a_ok = with_a && results[0].ok();
  EXPECT_TRUE(rb.ok()) << rb.status().message();
  if (rb.ok())
    for (const auto& out : rb->outputs) {
      const auto& lp = out.at("logprobs").f32;
      o.b_logprobs.insert(o.b_logprobs.end(), lp.begin(), lp.end());
    }
  for (auto& t : bank.targets())
    for (const at::Tensor* p : {&t.A, &t.B})
      for (int s : {0, 1}) {
        const at::Tensor g =
            p->grad().defined() ? p->grad().select(0, s).contiguous() : at::zeros_like(p->select(0, s));
        std::vector<float>& into = s == 1 ? o.b_grads : o.a_grads;
        into.insert(into.end(), g.data_ptr<float>(), g.data_ptr<float>() + g.numel());
      }
  return o;
}

// Bit equality that also holds for two NaNs (a NaN in B's results is a leak
// either way, and is reported by the finiteness check).
bool SameBits(const std::vector<float>& x, const std::vector<float>& y) {
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == y[i])) return false;
  return true;
}

bool AllFinite(const std::vector<float>& v) {
  for (float f : v)
    if (!std::isfinite(f)) return false;
  return true;
}

struct FormCase {
  int max_rank;
  LoraForm form;
  bool forced = false;  // the form is forced (the CPU rule never picks the grouped one)
  bool ragged = false;  // the grouped form over the rows as they are (SlotBank::AllowRagged)
};

class IsolationForms : public ::testing::TestWithParam<FormCase> {};

TEST_P(IsolationForms, PoisonedTenantLeavesItsNeighbourBitIdentical) {
  const FormCase fc = GetParam();
  const std::optional<LoraForm> force = fc.forced ? std::optional<LoraForm>(fc.form) : std::nullopt;
  for (const std::string loss : {"cross_entropy", "importance_sampling"}) {
    const Outcome ref = RunPass(fc.max_rank, Poison::kNone, loss, true, force, fc.ragged);
    ASSERT_EQ(ref.form, fc.form) << "the batch must take the form under test";
    ASSERT_TRUE(ref.a_ok);
    ASSERT_TRUE(AllFinite(ref.b_logprobs) && AllFinite(ref.b_grads));
    const std::vector<Poison> poisons =
        loss == "cross_entropy"
            ? std::vector<Poison>{Poison::kInfNanWeights, Poison::kHugeWeights, Poison::kHugeLossWeights,
                                  Poison::kNanLossWeights}
            : std::vector<Poison>{Poison::kInfNanWeights, Poison::kHugeWeights, Poison::kHugeAdvantages};
    // NaN loss inputs are refused before the pass (train::ValidateCallData),
    // so B then runs as it would without A at all.
    const Outcome alone = RunPass(fc.max_rank, Poison::kNone, loss, /*with_a=*/false, force, fc.ragged);
    for (Poison p : poisons) {
      const Outcome got = RunPass(fc.max_rank, p, loss, true, force, fc.ragged);
      const Outcome& want = p == Poison::kNanLossWeights ? alone : ref;
      EXPECT_TRUE(AllFinite(got.b_logprobs)) << loss << ", A: " << Name(p);
      EXPECT_TRUE(AllFinite(got.b_grads)) << loss << ", A: " << Name(p);
      EXPECT_TRUE(SameBits(got.b_logprobs, want.b_logprobs)) << loss << ", A: " << Name(p);
      EXPECT_TRUE(SameBits(got.b_grads, want.b_grads)) << loss << ", A: " << Name(p);
      // A's own call fails, except where its loss happens to stay finite, or
      // where the routed form counts its non-finite factor entries as zeros.
      const bool may_pass = p == Poison::kHugeLossWeights ||
                            (p == Poison::kInfNanWeights && fc.form == LoraForm::kRouted);
      if (!may_pass) EXPECT_FALSE(got.a_ok) << loss << ", A: " << Name(p);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, IsolationForms,
                         ::testing::Values(FormCase{8, LoraForm::kRouted}, FormCase{40, LoraForm::kSegment},
                                           FormCase{8, LoraForm::kGrouped, /*forced=*/true},
                                           FormCase{8, LoraForm::kGrouped, /*forced=*/true, /*ragged=*/true}),
                         [](const auto& info) {
                           switch (info.param.form) {
                             case LoraForm::kRouted: return "routed";
                             case LoraForm::kGrouped: return info.param.ragged ? "grouped_ragged" : "grouped";
                             case LoraForm::kSegment: break;
                           }
                           return "segment";
                         });

// max |got - want| over max |want| (want not all zero).
double MaxRelErr(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0, scale = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    err = std::max(err, static_cast<double>(std::fabs(got[i] - want[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
  }
  EXPECT_GT(scale, 1e-6);
  return err / scale;
}

// A whole pass in the grouped form (A's 14 rows and B's 18: the padded
// order, A's group with pads, and the joint nodes) gives the segment form's
// logprobs and both slots' gradients, to fp32 rounding.
TEST(GroupedForm, AWholePassMatchesTheSegmentForm) {
  for (const std::string loss : {"cross_entropy", "importance_sampling"}) {
    const Outcome segment = RunPass(8, Poison::kNone, loss, true, LoraForm::kSegment);
    // A's 14 rows and B's 18: padded to 2 x 18, or ragged (each slot's own length).
    for (const bool ragged : {false, true}) {
      const Outcome grouped = RunPass(8, Poison::kNone, loss, true, LoraForm::kGrouped, ragged);
      ASSERT_EQ(grouped.form, LoraForm::kGrouped);
      EXPECT_LT(MaxRelErr(grouped.b_logprobs, segment.b_logprobs), 1e-5) << loss << " ragged " << ragged;
      EXPECT_LT(MaxRelErr(grouped.b_grads, segment.b_grads), 1e-4) << loss << " ragged " << ragged;
      EXPECT_LT(MaxRelErr(grouped.a_grads, segment.a_grads), 1e-4) << loss << " ragged " << ragged;
    }
  }
}

// ---------------------------------------------------------------------------
// The engine: optimizer steps that would overflow, and gradient marks.

std::unique_ptr<Engine> OpenEngine() {
  EngineOptions o;
  o.model_dir = ModelDir();
  o.device = "cpu";
  o.max_slots = 2;
  o.max_rank = 8;
  o.threads = 2;
  auto e = Engine::Open(o);
  EXPECT_TRUE(e.ok()) << e.status().message();
  return std::move(e.value());
}

LoraConfig Lora(uint64_t seed) {
  LoraConfig c;
  c.rank = 4;
  c.alpha = 8;
  c.seed = seed;
  return c;
}

ForwardBackwardCall Ce(int slot, uint32_t seed) {
  ForwardBackwardCall c;
  c.slot = slot;
  c.data = {MakeDatum(8, seed, "cross_entropy", 0, false), MakeDatum(6, seed + 1, "cross_entropy", 0, false)};
  return c;
}

std::vector<float> Logprobs(Engine& e, int slot, uint32_t seed) {
  ForwardBackwardCall c = Ce(slot, seed);
  c.forward_only = true;
  auto r = e.ForwardBackward({c});
  EXPECT_TRUE(r[0].ok()) << r[0].status().message();
  std::vector<float> v;
  if (r[0].ok())
    for (const auto& o : r[0]->outputs) v.insert(v.end(), o.at("logprobs").f32.begin(), o.at("logprobs").f32.end());
  return v;
}

AdamParams Adam(double lr, double wd = 0.0) {
  AdamParams p;
  p.learning_rate = lr;
  p.weight_decay = wd;
  return p;
}

TEST(IsolationEngine, StepThatWouldOverflowFailsAndChangesNothing) {
  for (const AdamParams& bad : {Adam(1e300), Adam(1e-3, 1e300)}) {
    auto e = OpenEngine();
    ASSERT_TRUE(e->BindSlot(0, Lora(1)).ok());
    ASSERT_TRUE(e->BindSlot(1, Lora(2)).ok());
    // Steps with B != 0, so that A's weights feed its logprobs.
    for (int s : {0, 1}) {
      ASSERT_TRUE(e->ForwardBackward({Ce(s, 10 + s)})[0].ok());
      ASSERT_TRUE(e->OptimStep({{s, Adam(1e-2)}})[0].ok());
    }
    const std::vector<float> a_before = Logprobs(*e, 0, 50), b_ref_after = [&] {
      // B's result of the same sequence of calls with A behaving.
      auto twin = OpenEngine();
      EXPECT_TRUE(twin->BindSlot(0, Lora(1)).ok());
      EXPECT_TRUE(twin->BindSlot(1, Lora(2)).ok());
      for (int s : {0, 1}) {
        EXPECT_TRUE(twin->ForwardBackward({Ce(s, 10 + s)})[0].ok());
        EXPECT_TRUE(twin->OptimStep({{s, Adam(1e-2)}})[0].ok());
      }
      EXPECT_TRUE(twin->ForwardBackward({Ce(0, 30), Ce(1, 31)})[0].ok());
      EXPECT_TRUE(twin->OptimStep({{0, Adam(1e-3)}, {1, Adam(1e-3)}})[1].ok());
      return Logprobs(*twin, 1, 51);
    }();
    auto fb = e->ForwardBackward({Ce(0, 30), Ce(1, 31)});
    ASSERT_TRUE(fb[0].ok() && fb[1].ok());
    auto steps = e->OptimStep({{0, bad}, {1, Adam(1e-3)}});
    ASSERT_FALSE(steps[0].ok()) << "lr " << bad.learning_rate << " wd " << bad.weight_decay;
    EXPECT_EQ(steps[0].status().code(), Code::kInvalidArgument);
    EXPECT_NE(steps[0].status().message().find("non-finite"), std::string::npos) << steps[0].status().message();
    ASSERT_TRUE(steps[1].ok()) << steps[1].status().message();
    EXPECT_EQ(steps[1]->metrics.at("step"), 2.0);
    // A's weights are as before; B's are those of the twin where A behaved.
    EXPECT_TRUE(SameBits(Logprobs(*e, 0, 50), a_before));
    EXPECT_TRUE(SameBits(Logprobs(*e, 1, 51), b_ref_after));
    // A kept its gradient and its step count: a sane retry steps it.
    auto retry = e->OptimStep({{0, Adam(1e-3)}});
    ASSERT_TRUE(retry[0].ok()) << retry[0].status().message();
    EXPECT_EQ(retry[0]->metrics.at("step"), 2.0);
    EXPECT_GT(retry[0]->metrics.at("grad_norm"), 0.0);
  }
}

double GradNorm(Engine& e, int slot) {
  auto r = e.OptimStep({{slot, Adam(1e-3)}});
  EXPECT_TRUE(r[0].ok()) << r[0].status().message();
  return r[0].ok() ? r[0]->metrics.at("grad_norm") : -1.0;
}

TEST(IsolationEngine, RollbackReturnsTheGradientToItsMark) {
  // Reference: only the first call's gradient.
  auto ref = OpenEngine();
  ASSERT_TRUE(ref->BindSlot(0, Lora(1)).ok());
  ASSERT_TRUE(ref->ForwardBackward({Ce(0, 60)})[0].ok());
  const double first_only = GradNorm(*ref, 0);
  ASSERT_GT(first_only, 0.0);

  auto e = OpenEngine();
  ASSERT_TRUE(e->BindSlot(0, Lora(1)).ok());
  // A mark on a clean slot: rolling back zeroes the gradient.
  e->MarkGrad(0);
  ASSERT_TRUE(e->ForwardBackward({Ce(0, 61)})[0].ok());
  e->RollbackGrad(0);
  // A mark on an accumulated gradient: rolling back restores it exactly.
  ASSERT_TRUE(e->ForwardBackward({Ce(0, 60)})[0].ok());
  e->MarkGrad(0);
  ASSERT_TRUE(e->ForwardBackward({Ce(0, 62)})[0].ok());
  ASSERT_TRUE(e->ForwardBackward({Ce(0, 63)})[0].ok());
  e->RollbackGrad(0);
  EXPECT_EQ(GradNorm(*e, 0), first_only);
  // A forgotten mark does nothing on a later rollback.
  ASSERT_TRUE(e->ForwardBackward({Ce(0, 60)})[0].ok());
  e->MarkGrad(0);
  ASSERT_TRUE(e->ForwardBackward({Ce(0, 61)})[0].ok());
  e->ForgetGradMark(0);
  e->RollbackGrad(0);
  EXPECT_GT(GradNorm(*e, 0), first_only);
}

// ---------------------------------------------------------------------------
// The sampler: a poisoned snapshot sampled in the same prefill and decode
// steps as a healthy adapter and the base.

std::string Snapshot(const test::TempDir& dir, const std::string& name, uint64_t seed, float fill) {
  SlotBank bank(1, 8, at::kCPU, Model()->LoraTargets());
  Bind(bank, 0, 4, seed);
  if (fill != 0) {
    c10::NoGradGuard ng;
    for (auto& t : bank.targets()) t.B.select(0, 0).narrow(1, 0, 4).fill_(fill);
  }
  const std::string path = dir / name;
  EXPECT_TRUE(SavePeft(bank, 0, path, "tiny").ok());
  return path;
}

// Call i (prompt length, seed) is the (first + i)-th of a fixed list.
std::vector<Result<SampleOutput>> SampleTogether(Sampler& s, const std::vector<std::string>& adapters,
                                                 size_t first = 0) {
  std::vector<std::shared_ptr<std::promise<Result<SampleOutput>>>> ps;
  std::vector<std::future<Result<SampleOutput>>> fs;
  for (size_t n = 0; n < adapters.size(); ++n) {
    const size_t i = first + n;
    SampleCall c;
    // Prompts of different lengths, so that decode steps pad the shorter
    // contexts (the padding must not read another sequence's cache rows).
    c.prompt = {300, 17, 99, 260, 45, 301, 7, 402, 88, 120, 33};
    c.prompt.resize(c.prompt.size() - 3 * i);
    c.adapter_dir = adapters[n];
    c.params.max_tokens = 12;
    c.params.temperature = 1.0;
    c.params.seed = 5 + i;
    auto p = std::make_shared<std::promise<Result<SampleOutput>>>();
    fs.push_back(p->get_future());
    s.Submit(std::move(c), [p](Result<SampleOutput> r) { p->set_value(std::move(r)); });
    ps.push_back(p);
  }
  std::vector<Result<SampleOutput>> out;
  for (auto& f : fs) out.push_back(f.get());
  return out;
}

TEST(IsolationSampler, PoisonedAdapterLeavesTheOthersInItsStepsBitIdentical) {
  test::TempDir dir("loom-isolation-sampler");
  const std::string healthy = Snapshot(dir, "healthy", 31, 0);
  const std::string huge = Snapshot(dir, "huge", 31, 1e30f);  // finite: loads, its activations overflow
  const std::string inf = Snapshot(dir, "inf", 31, kInf);    // refused at load
  const std::string other = Snapshot(dir, "other", 32, 0);
  SamplerOptions o;
  o.model_dir = ModelDir();
  o.max_rank = 8;  // two adapters of R = 8: the routed form in the prefill
  // Requests sent together share one prefill and then every decode step, so
  // the two batches below run the same steps with the same shapes.
  o.admission_window = std::chrono::milliseconds(100);
  auto s = Sampler::Open(Model(), o);
  ASSERT_TRUE(s.ok()) << s.status().message();
  // Every adapter loaded once first, so that both batches below meet warm
  // caches and are admitted, prefilled and decoded in the same steps.
  for (const std::string& a : {healthy, huge, other}) ASSERT_TRUE(SampleTogether(**s, {a})[0].ok());
  const int64_t prefills = (*s)->stats().prefill_steps;
  auto ref = SampleTogether(**s, {healthy, other, ""});
  auto got = SampleTogether(**s, {huge, other, ""});
  ASSERT_EQ((*s)->stats().prefill_steps, prefills + 2) << "each batch must be one prefill";
  // A non-finite snapshot fails its own request; the others run as they
  // would without it.
  auto pair = SampleTogether(**s, {other, ""}, 1);
  auto with_inf = SampleTogether(**s, {inf, other, ""});
  ASSERT_FALSE(with_inf[0].ok());
  EXPECT_NE(with_inf[0].status().message().find("non-finite"), std::string::npos) << with_inf[0].status().message();
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(pair[i].ok() && with_inf[i + 1].ok());
    EXPECT_EQ(with_inf[i + 1]->sequences[0].tokens, pair[i]->sequences[0].tokens) << "request " << i;
  }
  for (size_t i = 1; i < 3; ++i) {
    ASSERT_TRUE(ref[i].ok() && got[i].ok());
    EXPECT_EQ(got[i]->sequences[0].tokens, ref[i]->sequences[0].tokens) << "request " << i;
    EXPECT_TRUE(SameBits(got[i]->sequences[0].logprobs, ref[i]->sequences[0].logprobs)) << "request " << i;
    EXPECT_TRUE(AllFinite(got[i]->sequences[0].logprobs)) << "request " << i;
  }
  EXPECT_GE((*s)->stats().max_adapters_in_step, 2);
}

}  // namespace
}  // namespace loom::engine
