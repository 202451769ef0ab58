// Gated DeltaNet's pieces (engine/model/gated_deltanet.h) against each other
// and against HF's formulas: the chunked rule == the token-by-token
// recurrence (values, final states and gradients into every input, at toy
// and at the model's head widths), the decode step == the recurrence, value
// heads sharing key heads == q, k repeated, states chaining over a split
// sequence, the packed wrapper == per-sequence calls (values and gradients),
// the causal conv == HF's conv1d formula (packed, split with the state
// carried, initial states, gradients), bf16 inputs computed in fp32, and
// GatedRmsNorm == HF's op order.
#include "engine/model/gated_deltanet.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace loom::engine {
namespace {

constexpr int64_t Hk = 2, Hv = 4, dk = 32, dv = 16;

double MaxDiff(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) {
    ADD_FAILURE() << "shape mismatch " << a.sizes() << " vs " << b.sizes();
    return std::numeric_limits<double>::infinity();
  }
  if (a.numel() == 0) return 0.0;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

struct Inputs {
  at::Tensor q, k, v, g, beta, s0;  // leaves requiring grad (s0 undefined when without)
  std::vector<at::Tensor> leaves() const {
    std::vector<at::Tensor> l{q, k, v, g, beta};
    if (s0.defined()) l.push_back(s0);
    return l;
  }
};

Inputs Make(int64_t n, bool with_state) {
  Inputs in;
  in.q = at::randn({n, Hk, dk}).requires_grad_();
  in.k = at::randn({n, Hk, dk}).requires_grad_();
  in.v = at::randn({n, Hv, dv}).requires_grad_();
  in.g = (-at::rand({n, Hv}) * 0.7 - 0.01).requires_grad_();  // log decay in (-0.71, -0.01)
  in.beta = at::rand({n, Hv}).requires_grad_();
  if (with_state) in.s0 = (at::randn({Hv, dk, dv}) * 0.5).requires_grad_();
  return in;
}

// Gradients of <out, R1> + <state, R2> with respect to the leaves.
std::vector<at::Tensor> Grads(const GdnResult& r, const at::Tensor& R1, const at::Tensor& R2,
                              const std::vector<at::Tensor>& leaves) {
  const at::Tensor loss = (r.out * R1).sum() + (r.state * R2).sum();
  return torch::autograd::grad({loss}, leaves, {}, /*retain_graph=*/true);
}

// HF's causal_conv1d_fn for one sequence: conv1d over [1, C, n] with K-1
// zero padding, the first n outputs, SiLU.
at::Tensor HfConv(const at::Tensor& x, const at::Tensor& w) {
  const int64_t n = x.size(0), C = x.size(1), K = w.size(1);
  const at::Tensor y = at::conv1d(x.t().unsqueeze(0), w.unsqueeze(1), {}, 1, K - 1, 1, C);
  return at::silu(y.narrow(2, 0, n)).squeeze(0).t();
}

std::vector<int64_t> Offsets(const std::vector<int64_t>& lens) {
  std::vector<int64_t> begin{0};
  for (int64_t l : lens) begin.push_back(begin.back() + l);
  return begin;
}

TEST(GatedDeltaNet, ChunkedMatchesRecurrentWithGradients) {
  at::manual_seed(0);
  const char* names[] = {"q", "k", "v", "g", "beta", "state0"};
  // Shorter than, equal to, just past and past two chunks of 64.
  for (int64_t n : {1, 5, 64, 67, 130}) {
    for (bool with_state : {false, true}) {
      const Inputs in = Make(n, with_state);
      const GdnResult c = GatedDeltaRuleChunked(in.q, in.k, in.v, in.g, in.beta, in.s0);
      const GdnResult r = GatedDeltaRuleRecurrent(in.q, in.k, in.v, in.g, in.beta, in.s0);
      const std::string tag = "n=" + std::to_string(n) + (with_state ? " state0" : " zero state");
      EXPECT_LT(MaxDiff(c.out, r.out), 1e-5) << "out, " << tag;
      EXPECT_LT(MaxDiff(c.state, r.state), 1e-5) << "final state, " << tag;
      const at::Tensor R1 = at::randn_like(c.out), R2 = at::randn_like(c.state);
      const auto gc = Grads(c, R1, R2, in.leaves()), gr = Grads(r, R1, R2, in.leaves());
      ASSERT_EQ(gc.size(), gr.size());
      for (size_t i = 0; i < gc.size(); ++i)
        EXPECT_LT(MaxDiff(gc[i], gr[i]), 1e-4) << "grad " << names[i] << ", " << tag;
    }
  }
}

// The model's head widths (dk = dv = 128, two value heads a key head as
// Qwen3.5-35B-A3B's 16/32) and gates drawn as the model makes them (GdnGates
// over A = exp(A_log) in [0.01, 16], as HF initialises it): strong decays included.
TEST(GatedDeltaNet, ChunkedMatchesRecurrentAtModelWidths) {
  at::manual_seed(1);
  const int64_t n = 150, hk = 2, hv = 4, d = 128;
  const at::Tensor q = at::randn({n, hk, d}).requires_grad_(), k = at::randn({n, hk, d}).requires_grad_();
  const at::Tensor v = at::randn({n, hv, d}).requires_grad_();
  const at::Tensor A_log = (at::rand({hv}) * (std::log(16.0) - std::log(0.01)) + std::log(0.01));
  const at::Tensor a = at::randn({n, hv}).requires_grad_(), b = at::randn({n, hv}).requires_grad_();
  const at::Tensor s0 = (at::randn({hv, d, d}) * 0.1).requires_grad_();
  const auto [g, beta] = GdnGates(a, b, A_log, at::ones({hv}));
  const GdnResult c = GatedDeltaRuleChunked(q, k, v, g, beta, s0);
  const GdnResult r = GatedDeltaRuleRecurrent(q, k, v, g, beta, s0);
  EXPECT_LT(MaxDiff(c.out, r.out), 1e-5) << "out";
  EXPECT_LT(MaxDiff(c.state, r.state), 1e-5) << "final state";
  const at::Tensor R1 = at::randn_like(c.out), R2 = at::randn_like(c.state);
  const std::vector<at::Tensor> leaves{q, k, v, a, b, s0};
  const char* names[] = {"q", "k", "v", "a", "b", "state0"};
  const auto gc = Grads(c, R1, R2, leaves), gr = Grads(r, R1, R2, leaves);
  ASSERT_EQ(gc.size(), leaves.size());
  for (size_t i = 0; i < gc.size(); ++i)
    EXPECT_LT(MaxDiff(gc[i], gr[i]), 1e-4) << "grad " << names[i] << " (through GdnGates)";
}

// The decode step, token after token, equals the recurrence (bitwise: the same arithmetic).
TEST(GatedDeltaNet, StepMatchesRecurrence) {
  at::manual_seed(2);
  const Inputs in = Make(9, true);
  const GdnResult r = GatedDeltaRuleRecurrent(in.q, in.k, in.v, in.g, in.beta, in.s0);
  at::Tensor S = in.s0.unsqueeze(0);
  std::vector<at::Tensor> outs;
  for (int64_t t = 0; t < 9; ++t) {
    const auto sl = [&](const at::Tensor& x) { return x.narrow(0, t, 1); };
    const GdnResult s = GatedDeltaStep(sl(in.q), sl(in.k), sl(in.v), sl(in.g), sl(in.beta), S);
    outs.push_back(s.out);
    S = s.state;
  }
  EXPECT_EQ(MaxDiff(at::cat(outs, 0), r.out), 0.0) << "out, 9 steps";
  EXPECT_EQ(MaxDiff(S.squeeze(0), r.state), 0.0) << "state, 9 steps";
}

// Value head h reads key head h / (Hv / Hk): equal to the call with q, k
// repeated to Hv heads by repeat_interleave.
TEST(GatedDeltaNet, ValueHeadsShareConsecutiveKeyHeads) {
  at::manual_seed(3);
  const Inputs in = Make(70, true);
  const GdnResult a = GatedDeltaRuleChunked(in.q, in.k, in.v, in.g, in.beta, in.s0);
  const GdnResult b = GatedDeltaRuleChunked(in.q.repeat_interleave(Hv / Hk, 1), in.k.repeat_interleave(Hv / Hk, 1),
                                            in.v, in.g, in.beta, in.s0);
  EXPECT_EQ(MaxDiff(a.out, b.out), 0.0) << "grouped heads vs q, k repeat_interleave'd to Hv heads";
}

// Running [0, m) then [m, n) with the state carried equals one run.
TEST(GatedDeltaNet, StatesChain) {
  at::manual_seed(4);
  for (bool chunked : {true, false}) {
    const Inputs in = Make(130, true);
    const auto run = [&](int64_t from, int64_t len, const at::Tensor& s) {
      const auto sl = [&](const at::Tensor& x) { return x.narrow(0, from, len); };
      return chunked ? GatedDeltaRuleChunked(sl(in.q), sl(in.k), sl(in.v), sl(in.g), sl(in.beta), s)
                     : GatedDeltaRuleRecurrent(sl(in.q), sl(in.k), sl(in.v), sl(in.g), sl(in.beta), s);
    };
    const GdnResult whole = run(0, 130, in.s0);
    const GdnResult first = run(0, 50, in.s0);
    const GdnResult second = run(50, 80, first.state);
    const std::string form = chunked ? "chunked" : "recurrent";
    EXPECT_LT(MaxDiff(at::cat({first.out, second.out}, 0), whole.out), 1e-5) << form << ", 50 + 80 == 130, out";
    EXPECT_LT(MaxDiff(second.state, whole.state), 1e-5) << form << ", 50 + 80 == 130, final state";
  }
}

// The packed wrapper (right-padded batch) against one call per sequence, an
// empty sequence included; with initial states, the gradients too.
TEST(GatedDeltaNet, PackedMatchesPerSequence) {
  at::manual_seed(5);
  const std::vector<int64_t> lens{5, 0, 67, 1, 130, 64};
  const std::vector<int64_t> begin = Offsets(lens);
  const int64_t T = begin.back(), S = static_cast<int64_t>(lens.size());
  const Inputs in = Make(T, false);
  const at::Tensor s0 = (at::randn({S, Hv, dk, dv}) * 0.5).requires_grad_();
  for (GdnForm form : {GdnForm::kChunked, GdnForm::kRecurrent}) {
    const bool chunked = form == GdnForm::kChunked;
    for (bool with_state : {false, true}) {
      const at::Tensor init = with_state ? s0 : at::Tensor();
      const GdnResult p = GatedDeltaRulePacked(in.q, in.k, in.v, in.g, in.beta, begin, init, form);
      std::vector<at::Tensor> outs, states;
      for (int64_t i = 0; i < S; ++i) {
        const auto sl = [&](const at::Tensor& x) { return x.narrow(0, begin[i], lens[i]); };
        const at::Tensor si = with_state ? s0[i] : at::Tensor();
        const GdnResult r = chunked ? GatedDeltaRuleChunked(sl(in.q), sl(in.k), sl(in.v), sl(in.g), sl(in.beta), si)
                                    : GatedDeltaRuleRecurrent(sl(in.q), sl(in.k), sl(in.v), sl(in.g), sl(in.beta), si);
        outs.push_back(r.out);
        states.push_back(r.state);
      }
      const std::string tag = std::string(chunked ? "chunked" : "recurrent") +
                              (with_state ? ", state0" : ", zero state") + ", lens 5,0,67,1,130,64";
      EXPECT_LT(MaxDiff(p.out, at::cat(outs, 0)), 1e-5) << "out, " << tag;
      EXPECT_LT(MaxDiff(p.state, at::stack(states, 0)), 1e-5) << "states, " << tag;
      if (with_state) {  // gradients through the padded layout, against the per-sequence graph
        const at::Tensor R1 = at::randn_like(p.out), R2 = at::randn_like(p.state);
        const std::vector<at::Tensor> leaves{in.q, in.k, in.v, in.g, in.beta, s0};
        const char* names[] = {"q", "k", "v", "g", "beta", "state0"};
        const auto gp = torch::autograd::grad({(p.out * R1).sum() + (p.state * R2).sum()}, leaves);
        const auto gs = torch::autograd::grad(
            {(at::cat(outs, 0) * R1).sum() + (at::stack(states, 0) * R2).sum()}, leaves);
        ASSERT_EQ(gp.size(), leaves.size());
        for (size_t i = 0; i < gp.size(); ++i)
          EXPECT_LT(MaxDiff(gp[i], gs[i]), 1e-5) << "grad " << names[i] << ", " << tag;
      }
    }
  }
}

// The packed conv against HF's formula per sequence (an empty one and ones
// shorter than K-1 included); each final state is the sequence's last K-1
// inputs, zeros before its start.
TEST(GatedDeltaNet, ConvMatchesHfConv1d) {
  at::manual_seed(6);
  const int64_t C = 24, K = 4;
  const at::Tensor w = at::randn({C, K});
  const std::vector<int64_t> lens{20, 1, 0, 3, 9};
  const std::vector<int64_t> begin = Offsets(lens);
  const at::Tensor x = at::randn({begin.back(), C});
  const GdnConvResult packed = GdnCausalConv(x, w, begin);
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < lens.size(); ++i) {
    const at::Tensor xi = x.narrow(0, begin[i], lens[i]);
    ys.push_back(lens[i] ? HfConv(xi, w) : at::empty({0, C}));
    const GdnConvResult one = GdnCausalConv(xi, w, {0, lens[i]});
    const at::Tensor tail = at::cat({at::zeros({K - 1, C}), xi}, 0).narrow(0, lens[i], K - 1).t();
    const std::string seq = "sequence " + std::to_string(i) + " (len " + std::to_string(lens[i]) + ")";
    EXPECT_EQ(MaxDiff(one.state[0], tail), 0.0) << "final state, one call, " << seq;
    EXPECT_EQ(MaxDiff(packed.state[i], tail), 0.0) << "final state, packed, " << seq;
  }
  EXPECT_LT(MaxDiff(packed.y, at::cat(ys, 0)), 1e-5) << "packed (lens 20,1,0,3,9) vs HF conv1d per sequence";
}

// A sequence split at m, the second part starting from the first's state,
// equals the whole (both from one initial state).
TEST(GatedDeltaNet, ConvSplitWithStateMatchesWhole) {
  at::manual_seed(7);
  const int64_t C = 24, K = 4;
  const at::Tensor w = at::randn({C, K});
  const at::Tensor whole = at::randn({20, C});
  const at::Tensor s0 = at::randn({1, C, K - 1});
  const GdnConvResult full = GdnCausalConv(whole, w, {0, 20}, s0);
  for (int64_t m : {1, 2, 7, 19}) {
    const GdnConvResult a = GdnCausalConv(whole.narrow(0, 0, m), w, {0, m}, s0);
    const GdnConvResult b = GdnCausalConv(whole.narrow(0, m, 20 - m), w, {0, 20 - m}, a.state);
    EXPECT_LT(MaxDiff(at::cat({a.y, b.y}, 0), full.y), 1e-6) << "split at " << m << ", rows";
    EXPECT_EQ(MaxDiff(b.state, full.state), 0.0) << "split at " << m << ", final state";
  }
}

// Several sequences with initial states, packed, == one call each; and the
// gradient into x and the states.
TEST(GatedDeltaNet, ConvPackedWithStatesMatchesPerSequence) {
  at::manual_seed(8);
  const int64_t C = 24, K = 4;
  const at::Tensor w = at::randn({C, K});
  const std::vector<int64_t> lens{20, 1, 0, 3, 9};
  const std::vector<int64_t> begin = Offsets(lens);
  const at::Tensor xs = at::randn({begin.back(), C}).requires_grad_();
  const at::Tensor st = at::randn({static_cast<int64_t>(lens.size()), C, K - 1}).requires_grad_();
  const GdnConvResult ps = GdnCausalConv(xs, w, begin, st);
  std::vector<at::Tensor> ys, ss;
  for (size_t i = 0; i < lens.size(); ++i) {
    const GdnConvResult one = GdnCausalConv(xs.narrow(0, begin[i], lens[i]), w, {0, lens[i]},
                                            st.narrow(0, static_cast<int64_t>(i), 1));
    ys.push_back(one.y);
    ss.push_back(one.state);
  }
  EXPECT_LT(MaxDiff(ps.y, at::cat(ys, 0)), 1e-6) << "rows";
  EXPECT_EQ(MaxDiff(ps.state, at::cat(ss, 0)), 0.0) << "states";
  const at::Tensor R = at::randn_like(ps.y), Rs = at::randn_like(ps.state);
  const auto g1 = torch::autograd::grad({(ps.y * R).sum() + (ps.state * Rs).sum()}, {xs, st});
  const auto g2 = torch::autograd::grad({(at::cat(ys, 0) * R).sum() + (at::cat(ss, 0) * Rs).sum()}, {xs, st});
  EXPECT_LT(MaxDiff(g1[0], g2[0]), 1e-6) << "grad x";
  EXPECT_LT(MaxDiff(g1[1], g2[1]), 1e-6) << "grad initial state";
}

// bf16 inputs: computed in fp32 after the cast up, so exactly the fp32
// call on the same (bf16-representable) values, out rounded once, state fp32.
TEST(GatedDeltaNet, Bf16InputsComputeInFp32) {
  at::manual_seed(9);
  const Inputs in = Make(70, true);
  const auto h = [](const at::Tensor& x) { return x.detach().to(at::kBFloat16); };
  const auto f = [](const at::Tensor& x) { return x.detach().to(at::kBFloat16).to(at::kFloat); };
  const GdnResult b = GatedDeltaRuleChunked(h(in.q), h(in.k), h(in.v), h(in.g), h(in.beta), h(in.s0));
  const GdnResult r = GatedDeltaRuleChunked(f(in.q), f(in.k), f(in.v), f(in.g), f(in.beta), f(in.s0));
  EXPECT_EQ(b.out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(MaxDiff(b.out, r.out.to(at::kBFloat16)), 0.0) << "bf16 out vs the fp32 call's out rounded";
  EXPECT_EQ(b.state.scalar_type(), at::kFloat);
  EXPECT_EQ(MaxDiff(b.state, r.state), 0.0) << "fp32 state vs the fp32 call's state";
  const at::Tensor x = at::randn({12, 8}).to(at::kBFloat16), w = at::randn({8, 4}).to(at::kBFloat16);
  const GdnConvResult c = GdnCausalConv(x, w, {0, 5, 12});
  const GdnConvResult cf = GdnCausalConv(x.to(at::kFloat), w.to(at::kFloat), {0, 5, 12});
  EXPECT_EQ(c.y.scalar_type(), at::kBFloat16);
  EXPECT_EQ(c.state.scalar_type(), at::kBFloat16);
  EXPECT_EQ(MaxDiff(c.y, cf.y.to(at::kBFloat16)), 0.0) << "bf16 conv rows vs the fp32 call rounded";
  EXPECT_EQ(MaxDiff(c.state, cf.state), 0.0) << "bf16 conv state vs the fp32 call's";
}

// GatedRmsNorm in bf16 == HF's RMSNormGated op order (bitwise); the gates'
// range and dtype.
TEST(GatedDeltaNet, GatedRmsNormAndGatesMatchFormulas) {
  at::manual_seed(10);
  const at::Tensor x = at::randn({7, Hv, dv}).to(at::kBFloat16), z = at::randn({7, Hv, dv}).to(at::kBFloat16);
  const at::Tensor w = (at::rand({dv}) + 0.5).to(at::kBFloat16);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor n = (xf * at::rsqrt(xf.pow(2).mean(-1, true) + 1e-6)).to(at::kBFloat16);
  const at::Tensor want =
      ((w * n).to(at::kFloat) * (z.to(at::kFloat) * at::sigmoid(z.to(at::kFloat)))).to(at::kBFloat16);
  const at::Tensor got = GatedRmsNorm(x, z, w, 1e-6);
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  EXPECT_EQ(MaxDiff(got, want), 0.0) << "GatedRmsNorm (bf16) vs HF's op order";
  // The gates: g <= 0, in fp32.
  const auto [g, beta] = GdnGates(at::randn({5, Hv}), at::randn({5, Hv}), at::randn({Hv}), at::randn({Hv}));
  EXPECT_LE(g.max().item<double>(), 0.0) << "GdnGates: g <= 0";
  EXPECT_EQ(g.scalar_type(), at::kFloat) << "GdnGates: g is fp32";
}

}  // namespace
}  // namespace loom::engine
