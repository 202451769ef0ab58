#include "cli/step_flags.h"

namespace loom::cli {

StepFlags::StepFlags(CLI::App& app) {
  engine::SamplerOptions& d = values_;  // parsed into; starts at the defaults
  app.add_option("--max-prefill-tokens", d.max_prefill_tokens,
                 "sampler prompt tokens prefilled per step; a longer prompt is prefilled in chunks, with decode "
                 "steps for the running samples between them")
      ->default_val(d.max_prefill_tokens)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--contended-prefill-tokens", d.contended_prefill_tokens,
                 "while tenants contend, prompt tokens of the tenants over their share per sampler step (after "
                 "the others' work), so a light tenant's step never waits behind a long chunk (0 = 32 on the CPU, "
                 "--max-prefill-tokens on a GPU)")
      ->default_val(d.contended_prefill_tokens)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--contended-decode-rows", d.contended_decode_rows,
                 "while tenants contend, running rows of the tenants over their share per decode step (0 = all)")
      ->default_val(d.contended_decode_rows)
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--mixed-steps", mixed_,
                 "on | off: while tenants contend, a decode step also carries the capped prompt chunks of the "
                 "tenants over their share, in one forward (CUDA decode graphs only; for use with a small "
                 "--contended-prefill-tokens)")
      ->default_val(mixed_)
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--contended-prefill-riders", riders_,
                 "on | off: while tenants contend, a prefill step of a tenant within its share also carries the "
                 "capped prompt chunks of the tenants over their share (off: its prompt is prefilled alone)")
      ->default_val(riders_)
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--device-turn-ms", turn_ms_,
                 "how the sampler's steps share a GPU with the trainer's passes: 0 = interleaved on one stream in "
                 "launch order; N > 0 = in turns, first come first served, each turn ending with the device's "
                 "queued work done, the sampler keeping its turn for consecutive steps until idle or, while a "
                 "pass waits, N ms")
      ->default_val(turn_ms_)
      ->check(CLI::Range(int64_t{0}, int64_t{60000}));
}

void StepFlags::Apply(engine::SamplerOptions* o) const {
  o->max_prefill_tokens = values_.max_prefill_tokens;
  o->contended_prefill_tokens = values_.contended_prefill_tokens;
  o->contended_decode_rows = values_.contended_decode_rows;
  o->mixed_steps = mixed_ == "on";
  o->contended_prefill_riders = riders_ == "on";
  o->device_turn = std::chrono::milliseconds(turn_ms_);
}

}  // namespace loom::cli
