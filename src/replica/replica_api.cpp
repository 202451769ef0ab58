#include "replica/replica_api.h"

namespace loom::replica {

using Json = nlohmann::json;

namespace {

// One field read with its name in the error (the body comes from a gateway,
// but a replica still answers a malformed one with 400, never a crash).
template <typename T>
Status Read(const Json& body, const char* field, T* out, bool required = true) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) {
    return required ? Status::Invalid(std::string("replica sample.") + field + ": missing") : Status::Ok();
  }
  try {
    *out = it->get<T>();
  } catch (const Json::exception& e) {
    return Status::Invalid(std::string("replica sample.") + field + ": " + e.what());
  }
  return Status::Ok();
}

// The counters of SamplerStats, by name, for both directions and the sum.
template <typename F>
void EachCounter(engine::SamplerStats& s, F&& f) {
  f("requests_done", s.requests_done);
  f("decode_steps", s.decode_steps);
  f("prefill_steps", s.prefill_steps);
  f("tokens_generated", s.tokens_generated);
  f("decode_rows", s.decode_rows);
  f("adapter_loads", s.adapter_loads);
  f("adapter_installs", s.adapter_installs);
  f("adapter_evictions", s.adapter_evictions);
  f("max_rows_in_step", s.max_rows_in_step);
  f("max_adapters_in_step", s.max_adapters_in_step);
  f("admission_waits", s.admission_waits);
  f("requests_cancelled", s.requests_cancelled);
  f("requests_waiting", s.requests_waiting);
  f("kv_blocks_free", s.kv_blocks_free);
  f("kv_blocks_cached", s.kv_blocks_cached);
  f("kv_cache_evictions", s.kv_cache_evictions);
  f("prefill_tokens", s.prefill_tokens);
  f("fast_prefill_steps", s.fast_prefill_steps);
  f("prompt_cache_hit_tokens", s.prompt_cache_hit_tokens);
  f("contended_steps", s.contended_steps);
  f("mixed_steps", s.mixed_steps);
  f("decode_graphs_captured", s.decode_graphs_captured);
  f("decode_graph_capture_seconds", s.decode_graph_capture_seconds);
  f("prefill_seconds", s.prefill_seconds);
  f("decode_seconds", s.decode_seconds);
}

}  // namespace

Json SampleCallJson(const engine::SampleCall& c) {
  Json params = {{"temperature", c.params.temperature},
                 {"top_k", c.params.top_k},
                 {"top_p", c.params.top_p},
                 {"stop_tokens", c.params.stop_tokens},
                 {"stop_strings", c.params.stop_strings}};
  if (c.params.max_tokens) params["max_tokens"] = *c.params.max_tokens;
  if (c.params.seed) params["seed"] = *c.params.seed;
  return {{"adapter_dir", c.adapter_dir},
          {"prompt", c.prompt},
          {"num_samples", c.num_samples},
          {"params", std::move(params)},
          {"prompt_logprobs", c.prompt_logprobs},
          {"topk_prompt_logprobs", c.topk_prompt_logprobs},
          {"tenant", c.tenant},
          {"session", c.session}};
}

Result<engine::SampleCall> ParseSampleCall(const Json& body) {
  if (!body.is_object()) return Status::Invalid("replica sample: the body must be a JSON object");
  engine::SampleCall c;
  Status st;
  if (!(st = Read(body, "adapter_dir", &c.adapter_dir, false)).ok()) return st;
  if (!(st = Read(body, "prompt", &c.prompt)).ok()) return st;
  if (!(st = Read(body, "num_samples", &c.num_samples)).ok()) return st;
  if (!(st = Read(body, "prompt_logprobs", &c.prompt_logprobs, false)).ok()) return st;
  if (!(st = Read(body, "topk_prompt_logprobs", &c.topk_prompt_logprobs, false)).ok()) return st;
  if (!(st = Read(body, "tenant", &c.tenant, false)).ok()) return st;
  if (!(st = Read(body, "session", &c.session, false)).ok()) return st;
  auto params = body.find("params");
  if (params == body.end() || !params->is_object()) return Status::Invalid("replica sample.params: missing");
  engine::SamplingParams& p = c.params;
  int32_t max_tokens = -1;
  uint64_t seed = 0;
  if (!(st = Read(*params, "max_tokens", &max_tokens, false)).ok()) return st;
  if (params->contains("max_tokens")) p.max_tokens = max_tokens;
  if (!(st = Read(*params, "seed", &seed, false)).ok()) return st;
  if (params->contains("seed")) p.seed = seed;
  if (!(st = Read(*params, "temperature", &p.temperature, false)).ok()) return st;
  if (!(st = Read(*params, "top_k", &p.top_k, false)).ok()) return st;
  if (!(st = Read(*params, "top_p", &p.top_p, false)).ok()) return st;
  if (!(st = Read(*params, "stop_tokens", &p.stop_tokens, false)).ok()) return st;
  if (!(st = Read(*params, "stop_strings", &p.stop_strings, false)).ok()) return st;
  return c;
}

Json SamplerInfoJson(const engine::SamplerInfo& i) {
  return {{"vocab_size", i.vocab_size},           {"context_window", i.context_window},
          {"kv_tokens", i.kv_tokens},             {"kv_blocks", i.kv_blocks},
          {"block_size", i.block_size},           {"sampler_adapters", i.sampler_adapters},
          {"has_tokenizer", i.has_tokenizer},     {"eos_token_ids", i.eos_token_ids},
          {"max_num_samples", i.max_num_samples}, {"max_rank", i.max_rank}};
}

Result<engine::SamplerInfo> ParseSamplerInfo(const Json& body) {
  if (!body.is_object()) return Status::Invalid("replica info: not a JSON object");
  engine::SamplerInfo i;
  try {
    i.vocab_size = body.at("vocab_size").get<int64_t>();
    i.context_window = body.at("context_window").get<int64_t>();
    i.kv_tokens = body.at("kv_tokens").get<int64_t>();
    i.kv_blocks = body.at("kv_blocks").get<int64_t>();
    i.block_size = body.at("block_size").get<int>();
    i.sampler_adapters = body.at("sampler_adapters").get<int>();
    i.has_tokenizer = body.at("has_tokenizer").get<bool>();
    i.eos_token_ids = body.at("eos_token_ids").get<std::vector<int32_t>>();
    i.max_num_samples = body.at("max_num_samples").get<int32_t>();
    i.max_rank = body.at("max_rank").get<int>();
  } catch (const Json::exception& e) {
    return Status::Invalid(std::string("replica info: ") + e.what());
  }
  return i;
}

Json SamplerStatsJson(const engine::SamplerStats& stats) {
  Json j = Json::object();
  engine::SamplerStats s = stats;
  EachCounter(s, [&](const char* name, auto& v) { j[name] = v; });
  return j;
}

engine::SamplerStats ParseSamplerStats(const Json& body) {
  engine::SamplerStats s;
  if (!body.is_object()) return s;
  EachCounter(s, [&](const char* name, auto& v) {
    auto it = body.find(name);
    if (it != body.end() && it->is_number()) v = it->get<std::decay_t<decltype(v)>>();
  });
  return s;
}

engine::SamplerStats AddStats(engine::SamplerStats a, const engine::SamplerStats& b) {
  engine::SamplerStats rhs = b;
  Json other = SamplerStatsJson(rhs);
  EachCounter(a, [&](const char* name, auto& v) {
    const auto add = other[name].get<std::decay_t<decltype(v)>>();
    // Maxima stay maxima; the rest add up.
    if (std::string(name).rfind("max_", 0) == 0) {
      v = std::max(v, add);
    } else {
      v += add;
    }
  });
  return a;
}

}  // namespace loom::replica
