// `loom bench sample --multi-turn` (bench_multiturn.cpp): one conversation
// of --turns turns after --history-tokens of earlier conversation, on two
// samplers of the same model, the prefix cache on and off, to show where
// each turn's prefill time goes.
#pragma once
#include <string>

#include "engine/sample_api.h"

namespace loom::cli {

struct MultiTurnOptions {
  int turns = 10;
  int history_tokens = 0;  // earlier conversation before turn 0 (a system prompt, documents)
  int user_tokens = 64;    // each turn's new user message
  int reply_tokens = 32;   // each turn's sampled reply, at most (it may stop at EOS)
  // The largest |logprob| difference of a turn's first sampled token, cache
  // on against off, that still counts as the same (the bench sets it by dtype).
  double logprob_tolerance = 1e-3;
  // Non-empty: each turn on each sampler is traced (cli/trace_profile.h) to
  // profile.turn<k>.on.json / .off.json; the figures then include the tracing.
  std::string profile;
  // Also count the ATen ops of each turn's prefill steps (engine/sample/op_count.h).
  bool count_ops = false;
};

// The context window one conversation needs.
inline int64_t MultiTurnContext(const MultiTurnOptions& o) {
  return o.history_tokens + static_cast<int64_t>(o.turns) * (o.user_tokens + o.reply_tokens);
}

// Runs the conversation turn by turn on both samplers (same prompts, same
// seeds; `adapter` may be "" for the base) and prints one row per turn; 0 on success.
int RunMultiTurn(engine::Sampler& cached, engine::Sampler& uncached, const std::string& adapter,
                 const MultiTurnOptions& o);

}  // namespace loom::cli
