// ServiceDriver: one in-process Service on a real Engine (the same object
// `loom serve` puts behind HTTP), with blocking helpers that act as a Tinker
// training client would: create a model, submit forward_backward/optim_step
// with consecutive seq_ids, and wait for futures without polling.
// Used by `loom demo` and `loom bench multi-tenant`.
//
// Invariant: every Tenant's requests carry seq_ids 1, 2, 3, ... in submit order.
// Threading: Submit*/Await may be called from any thread; one Tenant object
// must be used by one thread at a time.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "cli/decode_flags.h"
#include "cli/step_flags.h"
#include "common/status.h"
#include "engine/api.h"
#include "service/service.h"

namespace loom::cli {

struct DriverOptions {
  std::string model_dir;        // "" = the embedded tiny qwen3, generated under data_dir
  std::string data_dir;         // registry (a fresh temp dir is fine)
  int max_slots = 8;
  int max_rank = 16;
  int threads = 0;              // CPU intra-op threads, 0 = all cores
  bool lora_ragged = true;      // engine::EngineOptions::lora_ragged
  bool share_prefixes = true;   // engine::EngineOptions::share_prefixes
  bool small_ops_first = false;  // service::ServiceOptions::small_ops_first
  int64_t token_budget = 0;      // tokens per pass; 0: as loom serve (service::TokenBudget: on a GPU the most that fit)
  // How a pass is sized against the room free now (loom serve's --pass-tokens).
  service::ServiceOptions::PassSizing pass_sizing = service::ServiceOptions{}.pass_sizing;
  bool with_sampler = false;    // attach a Sampler on the trainer's shared base (asample)
  int64_t kv_budget_tokens = 0;  // its KV cache in tokens (loom serve's --kv-budget-tokens; 0 = serve's default)
  int publish_threads = service::ServiceOptions{}.publish_threads;  // save_weights_for_sampler writers
  bool publish_staging_ahead = false;  // service::ServiceOptions::publish_staging_ahead
  const StepFlags* sampler_steps = nullptr;  // the sampler's step limits (--contended-*), or its defaults
  const DecodeFlags* sampler_decode = nullptr;  // the sampler's decode switches (--cuda-graphs, ...), or its defaults
};

struct Tenant {
  std::string name;
  std::string model_id;
  std::string session_id;
  int64_t next_seq = 1;
  int64_t next_sampling_seq = 0;  // sampling sessions made in this tenant's session
};

class ServiceDriver {
 public:
  static Result<std::unique_ptr<ServiceDriver>> Open(const DriverOptions& options);
  ~ServiceDriver();

  service::Service& service() { return *service_; }
  const engine::ModelInfo& info() const { return service_->model_info(); }
  // Tokens per packed pass (DriverOptions::token_budget resolved).
  int64_t token_budget() const { return service_->options().token_budget; }

  // A session and a LoRA model of this rank and seed for `name`.
  Result<Tenant> NewTenant(const std::string& name, int rank, uint64_t seed);
  // Submits without waiting; returns the request id.
  Result<std::string> SubmitForwardBackward(Tenant& t, engine::ForwardBackwardCall call);
  Result<std::string> SubmitOptimStep(Tenant& t, const engine::AdamParams& adam);
  // unload_model of the tenant's model, waited for: its trainer slot is free.
  Status Unload(const Tenant& t);
  // Blocks until the future finishes; its error when it failed.
  Result<service::FutureView> Await(const Tenant& t, const std::string& request_id);

  // save_weights_for_sampler of the tenant's adapter as `name`, waited for:
  // the snapshot's tinker:// path.
  Result<std::string> SaveForSampler(Tenant& t, const std::string& name);
  // The unnamed save_weights_for_sampler (the SDK's
  // save_weights_and_get_sampling_client), waited for: its sampling session.
  Result<std::string> SaveAndGetSampler(Tenant& t);
  // A sampling session on model_path (a snapshot's tinker:// path), or on the
  // base model when model_path is "", in the tenant's session.
  Result<std::string> NewSamplingSession(Tenant& t, const std::string& model_path);
  // One asample on that session, waited for. Needs with_sampler. seq_id:
  // the call's on the session (the service answers a repeated one with the
  // first's result, as a retry): calls made at once on one session differ.
  Result<tinker::SampleOutput> Sample(const Tenant& t, const std::string& sampling_session_id,
                                      const std::vector<int32_t>& prompt, int num_samples,
                                      const tinker::SamplingParams& params, int64_t seq_id = 0);

  // Greedy continuation (temperature 0) of prompt, max_tokens long: from the
  // tenant's current adapter (saved for the sampler as `snapshot`), or from
  // the base model when snapshot is "". Needs with_sampler.
  Result<std::vector<int32_t>> Greedy(Tenant& t, const std::vector<int32_t>& prompt, int max_tokens,
                                      const std::string& snapshot);

 private:
  ServiceDriver() = default;
  std::unique_ptr<service::Service> service_;
};

// Writes the embedded default model (tiny qwen3, seed 1) into dir/default-model once.
Result<std::string> EmbeddedModel(const std::string& data_dir);

}  // namespace loom::cli
