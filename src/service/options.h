// ServiceOptions: the Service's settings, set from the CLI (cli/serve) and
// read by every part of the Service. Plain data, fixed after construction.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace loom::service {

struct ServiceOptions {
  std::string base_model_name = "loom/tiny-qwen3";  // --model-name: base_model clients send
  std::string tokenizer_id;                          // "" = base_model_name
  std::chrono::milliseconds session_ttl{std::chrono::seconds(300)};
  std::chrono::milliseconds seq_gap_timeout{std::chrono::seconds(120)};
  std::chrono::milliseconds janitor_period{std::chrono::milliseconds(500)};
  std::chrono::seconds future_retention{std::chrono::hours(2)};
  std::chrono::seconds archive_url_ttl{std::chrono::minutes(15)};
  double lora_alpha = 32.0;
  std::string instance_tag;  // prefix of request ids; "" = random
  int64_t token_budget = 8192;  // --token-budget: tokens per packed forward(_backward) pass
  // Base models whose passes share the device's room for activations (the
  // Service sets it to its base models' count): a pass is planned to at most
  // Engine::MaxPassTokens() / room_share tokens, the room free when it is
  // planned, as `loom serve` sized token_budget at start-up.
  int64_t room_share = 1;
  // --pass-tokens: how a pass is sized against that room (pass_room.h).
  //   most (the default): to the most that fit with every layer recomputed;
  //         the memory plan then recomputes the fewest layers that fit.
  //   kept: to the tokens that fit with every layer's activations kept, when
  //         those are at least min_kept_pass_tokens (else that many, with
  //         the fewest layers recomputed that fit). A recomputed layer runs
  //         its forward twice (bench train on the H100, qwen3-4b, 4 x 2048:
  //         every layer recomputed is 1.57x every layer kept), so one tenant's
  //         large request trains faster in such passes (bench rl one by one:
  //         20.3k tokens/s against 18.8k); but many tenants' requests spread
  //         over more passes finish at different times, and their sampling
  //         batches less (bench rl together: 2.40x against most's 2.65x).
  enum class PassSizing { kKept, kMost };
  PassSizing pass_sizing = PassSizing::kMost;
  // kKept's floor: a pass the kept room would make smaller holds this many
  // tokens instead (with layers recomputed): below it a pass's fixed costs
  // and narrow GEMMs outweigh the recompute it saves.
  int64_t min_kept_pass_tokens = 4096;
  // --batch-window-ms: before a pass, the engine waits until no request has
  // arrived for this long (tenants submitting "at once" land in one pass),
  // but never keeps a request waiting longer than BatchWindow::kMaxWindows
  // windows (common/batch_window.h, the sampler's rule too).
  std::chrono::milliseconds batch_window{2};
  // --small-ops-first: ready optim_steps and saves run before the next
  // packable pass (sched/planner.h, POLICY 6), so that tenants whose
  // forward_backward completed early step, publish and sample while the
  // others' pieces still train, instead of the whole round in lockstep.
  // Off by default: on the H100 (bench rl, 16 tenants, session 32) the
  // decode steps that then ran beside passes took 19 ms instead of 14 and
  // the passes slowed as much, on either decode stream (2.90x against
  // 2.96x; docs/benchmarks.md).
  bool small_ops_first = false;
  // --max-models-per-tenant: live models (adapter slots, held or being bound)
  // one tenant may have at once; 0 = no per-tenant limit (only the slots).
  int max_models_per_tenant = 0;
  // --capacity-wait: how long a create_model may wait for an adapter slot
  // when all are bound (its future reports queue_state paused_capacity
  // meanwhile); past it, the future fails naming the limit. 0 = no waiting:
  // create_model on a full service is refused at once (503, retryable).
  std::chrono::milliseconds capacity_wait{std::chrono::minutes(10)};
  // --sample-queue: asample calls the sampler holds at once, queued or
  // running; one tenant may hold half. Beyond either, asample answers 429.
  int sample_queue = 256;
  // --publish-threads: writer threads that write and commit
  // save_weights_for_sampler snapshots off the engine thread (service/publisher.h).
  int publish_threads = 2;
  // --publish-staging ahead: each writer takes the pinned host memory its
  // writes stage snapshots through when it starts (Engine::
  // PrepareSnapshotWriter), before the service takes requests, and keeps it;
  // per-write (the default): each write takes it from the caching host
  // allocator. On the H100 (session 41) two of a round's first saves waited
  // 242 and 298 ms on the engine thread while the writers first pinned
  // theirs; `ahead` is off until measured on a GPU (its first form, 5d8dcae,
  // ended bench rl there in a fault, session 42).
  bool publish_staging_ahead = false;
};

}  // namespace loom::service
