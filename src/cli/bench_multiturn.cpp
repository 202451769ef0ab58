// `loom bench sample --multi-turn`: turn k's prompt is the whole history
// (--history-tokens of earlier conversation, then every earlier user message
// and reply) plus a new user message, as a multi-turn RL environment sends
// it. Each turn goes to the sampler with the prefix cache and to the one
// without, one after the other; the row shows the prompt's length, the
// tokens each had to prefill, and each one's prefill time
// (SamplerStats::prefill_seconds of that turn's prefill steps). The history
// grows with the cached sampler's replies.
// The check: a turn's first sampled token's logprob depends only on the
// prefill, so "first" says whether the cached sampler's first token has, under
// the uncached sampler's whole prefill, a logprob within --logprob-tolerance of
// the cached one. Where the two drew different first tokens (bf16 rounds the
// cached and the whole prefill differently, and a random model's nearly flat
// distribution turns that into another draw), the uncached logprob of the
// cached token comes from a prompt-logprobs call on the history plus that
// token, so the same token is always compared. "draw" and "reply" say whether
// the first token and the whole reply were the same, for information.
#include "cli/bench_multiturn.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cli/bench_contention.h"
#include "cli/trace_profile.h"
#include "engine/sample/op_count.h"

namespace loom::cli {
namespace {

using engine::SampleCall;
using engine::SampleOutput;

struct Turn {
  SampleOutput out;
  double prefill_ms = 0;
  int64_t prefilled = 0;
  engine::sample::OpCounts ops;  // of its prefill steps, when counted
};


// trace: a Kineto trace of the turn goes there (empty: none); count_ops:
// Turn::ops counts its prefill steps' ops.
Result<Turn> RunTurn(engine::Sampler& s, SampleCall c, const std::string& trace = "", bool count_ops = false) {
  if (!trace.empty())
    if (Status st = StartTrace(); !st.ok()) return st;
  std::optional<engine::sample::OpCount> counter;
  if (count_ops) counter.emplace(engine::sample::kPrefillScope);
  const engine::SamplerStats before = s.stats();
  auto p = std::make_shared<std::promise<Result<SampleOutput>>>();
  auto f = p->get_future();
  s.Submit(std::move(c), [p](Result<SampleOutput> r) { p->set_value(std::move(r)); });
  Result<SampleOutput> r = f.get();
  const engine::SamplerStats after = s.stats();
  if (!trace.empty())
    if (Status st = StopTrace(trace); !st.ok()) return st;
  if (!r.ok()) return r.status();
  Turn t;
  if (counter) t.ops = counter->Take();
  t.out = std::move(r.value());
  t.prefill_ms = (after.prefill_seconds - before.prefill_seconds) * 1e3;
  t.prefilled = after.prefill_tokens - before.prefill_tokens;
  return t;
}

}  // namespace

int RunMultiTurn(engine::Sampler& cached, engine::Sampler& uncached, const std::string& adapter,
                 const MultiTurnOptions& o) {
  std::printf("multi-turn: %d history tokens, then %d turns of %d new user tokens and a %d-token reply, adapter %s\n",
              o.history_tokens, o.turns, o.user_tokens, o.reply_tokens, adapter.empty() ? "none (base)" : "1");
  std::mt19937 rng(5);
  const int64_t vocab = cached.info().vocab_size;
  const auto call = [&](const std::vector<int32_t>& prompt, uint64_t seed) {
    SampleCall c;
    c.prompt = prompt;
    c.adapter_dir = adapter;
    c.params.max_tokens = o.reply_tokens;
    c.params.temperature = 1.0;
    c.params.seed = seed;
    return c;
  };
  // Warm-up: unrelated calls on each, so turn 0 is not a first-use outlier:
  // a short prompt (a later turn's prefill, on the decode graphs by default)
  // and one as long as turn 0's (the eager prefill's kernels).
  const std::vector<int32_t> warm_short = RandomPrompt(rng, vocab, o.user_tokens);
  const std::vector<int32_t> warm_long = RandomPrompt(rng, vocab, o.history_tokens + o.user_tokens);
  for (engine::Sampler* s : {&cached, &uncached})
    for (const auto* warm : {&warm_short, &warm_long})
      if (auto w = RunTurn(*s, call(*warm, 1)); !w.ok())
        return std::fprintf(stderr, "loom bench sample: %s\n", w.status().message().c_str()), 1;

  std::printf("%5s %8s | %9s %10s %11s | %9s %11s | %5s %10s %5s %5s\n", "turn", "prompt", "hit", "prefilled",
              "prefill ms", "prefilled", "prefill ms", "first", "|dlogprob|", "draw", "reply");
  std::printf("%5s %8s | %33s | %21s |\n", "", "", "prefix cache on", "prefix cache off");
  std::vector<int32_t> history = RandomPrompt(rng, vocab, o.history_tokens);
  double on_total = 0, off_total = 0, worst = 0;
  int firsts_same = 0;
  for (int k = 0; k < o.turns; ++k) {
    const std::vector<int32_t> user = RandomPrompt(rng, vocab, o.user_tokens);
    history.insert(history.end(), user.begin(), user.end());
    const auto trace = [&](const char* which) {
      return o.profile.empty() ? o.profile : o.profile + ".turn" + std::to_string(k) + "." + which + ".json";
    };
    auto on = RunTurn(cached, call(history, 100 + k), trace("on"), o.count_ops);
    if (!on.ok()) return std::fprintf(stderr, "loom bench sample: %s\n", on.status().message().c_str()), 1;
    auto off = RunTurn(uncached, call(history, 100 + k), trace("off"), o.count_ops);
    if (!off.ok()) return std::fprintf(stderr, "loom bench sample: %s\n", off.status().message().c_str()), 1;
    const tinker::SampledSequence &a = on->out.sequences[0], &b = off->out.sequences[0];
    const std::vector<int32_t>& reply = a.tokens;
    // The first token of each (a reply of 0 tokens has none: max_tokens >= 1 here).
    const bool same_draw = a.tokens.at(0) == b.tokens.at(0);
    double reference = b.logprobs.at(0);
    if (!same_draw) {  // the uncached logprob of the cached sampler's first token
      SampleCall probe = call(history, 1);
      probe.prompt.push_back(a.tokens[0]);
      probe.prompt_logprobs = true;
      probe.params.max_tokens = 1;
      auto p = RunTurn(uncached, std::move(probe));
      if (!p.ok() || !p->out.prompt_logprobs)
        return std::fprintf(stderr, "loom bench sample: the prompt-logprobs probe failed\n"), 1;
      reference = p->out.prompt_logprobs->back();
    }
    const double d = std::fabs(static_cast<double>(a.logprobs.at(0)) - reference);
    const bool first = d <= o.logprob_tolerance;
    firsts_same += first;
    worst = std::max(worst, d);
    std::printf("%5d %8zu | %9d %10lld %11.2f | %9lld %11.2f | %5s %10.2e %5s %5s\n", k, history.size(),
                on->out.prompt_cache_hit_tokens, static_cast<long long>(on->prefilled), on->prefill_ms,
                static_cast<long long>(off->prefilled), off->prefill_ms, first ? "yes" : "NO", d,
                same_draw ? "same" : "other", reply == b.tokens ? "yes" : "no");
    if (o.count_ops)
      std::printf("%5s ops of the prefill: on %lld calls (%lld with nested) in %lld steps, off %lld calls (%lld) "
                  "in %lld\n      on: %s\n", "", static_cast<long long>(on->ops.calls),
                  static_cast<long long>(on->ops.ops), static_cast<long long>(on->ops.scopes),
                  static_cast<long long>(off->ops.calls), static_cast<long long>(off->ops.ops),
                  static_cast<long long>(off->ops.scopes), on->ops.Top(12).c_str());
    std::fflush(stdout);
    on_total += on->prefill_ms;
    off_total += off->prefill_ms;
    history.insert(history.end(), reply.begin(), reply.end());
  }
  std::printf("prefill over the conversation: %.1f ms with the prefix cache, %.1f ms without (%.2fx)\n", on_total,
              off_total, on_total > 0 ? off_total / on_total : 0.0);
  std::printf("prefill steps on the decode graphs (--fast-prefill): %lld of %lld with the cache, %lld of %lld without\n",
              static_cast<long long>(cached.stats().fast_prefill_steps),
              static_cast<long long>(cached.stats().prefill_steps),
              static_cast<long long>(uncached.stats().fast_prefill_steps),
              static_cast<long long>(uncached.stats().prefill_steps));
  std::printf("first-token logprobs within tolerance in %d of %d turns (|dlogprob| at most %.2e, tolerance %.0e)\n",
              firsts_same, o.turns, worst, o.logprob_tolerance);
  return firsts_same == o.turns ? 0 : 1;
}

}  // namespace loom::cli
