// The sampler's tensor-free admission checks (sample_api.h), shared by the
// in-process sampler and by a gateway that sends its samples to replicas
// (replica/remote_sampler.h): both refuse the same calls with the same words.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>

#include "engine/sample_api.h"

namespace loom::engine {

int64_t KvBlocksWorstCase(int64_t block_size, int64_t prompt_len, int64_t max_tokens, int64_t num_samples) {
  const int64_t ctx = std::max(prompt_len, prompt_len + max_tokens - 1);
  const int64_t per_sample = (ctx + block_size - 1) / block_size;
  const int64_t shared = prompt_len / block_size;
  return per_sample + (num_samples - 1) * (per_sample - shared);
}

Status ValidateSampleCall(const SamplerInfo& info, const SampleCall& c) {
  const int64_t P = static_cast<int64_t>(c.prompt.size()), W = info.context_window;
  if (P == 0) return Status::Invalid("prompt must have at least one token");
  for (size_t i = 0; i < c.prompt.size(); ++i)
    if (c.prompt[i] < 0 || c.prompt[i] >= info.vocab_size)
      return Status::Invalid("prompt token " + std::to_string(i) + " is " + std::to_string(c.prompt[i]) +
                             ", outside the vocabulary [0, " + std::to_string(info.vocab_size) + ")");
  if (c.num_samples < 1 || c.num_samples > info.max_num_samples)
    return Status::Invalid("num_samples " + std::to_string(c.num_samples) + " must be in [1, " +
                           std::to_string(info.max_num_samples) + "]");
  const SamplingParams& p = c.params;
  if (p.max_tokens && *p.max_tokens < 0)
    return Status::Invalid("sampling_params.max_tokens " + std::to_string(*p.max_tokens) + " must be >= 0");
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    return Status::Invalid("sampling_params.temperature must be a finite number >= 0");
  if (p.top_k != -1 && p.top_k < 1)
    return Status::Invalid("sampling_params.top_k " + std::to_string(p.top_k) + " must be -1 (off) or >= 1");
  if (!(p.top_p > 0 && p.top_p <= 1)) return Status::Invalid("sampling_params.top_p must be in (0, 1]");
  for (int32_t t : p.stop_tokens)
    if (t < 0 || t >= info.vocab_size)
      return Status::Invalid("sampling_params.stop token " + std::to_string(t) + " is outside the vocabulary [0, " +
                             std::to_string(info.vocab_size) + ")");
  if (!p.stop_strings.empty() && !info.has_tokenizer)
    return Status::Invalid("sampling_params.stop: stop strings need tokenizer.json in the model directory");
  for (const std::string& s : p.stop_strings)
    if (s.empty()) return Status::Invalid("sampling_params.stop: a stop string is empty");
  if (c.topk_prompt_logprobs < 0 || c.topk_prompt_logprobs > info.vocab_size)
    return Status::Invalid("topk_prompt_logprobs " + std::to_string(c.topk_prompt_logprobs) + " must be in [0, " +
                           std::to_string(info.vocab_size) + "]");
  if (P > W)
    return Status::Invalid("prompt has " + std::to_string(P) + " tokens, more than the context window of " +
                           std::to_string(W));
  const int64_t max_tokens = p.max_tokens ? *p.max_tokens : W - P;
  if (P + max_tokens > W)
    return Status::Invalid("prompt (" + std::to_string(P) + " tokens) + max_tokens (" + std::to_string(max_tokens) +
                           ") = " + std::to_string(P + max_tokens) + " exceeds the context window of " +
                           std::to_string(W));
  const int64_t need = KvBlocksWorstCase(info.block_size, P, max_tokens, c.num_samples);
  if (need > info.kv_blocks)
    return Status::Invalid("the request needs " + std::to_string(need * info.block_size) +
                           " KV cache tokens (prompt + max_tokens for each of num_samples), more than the "
                           "sampler's KV budget of " + std::to_string(info.kv_tokens));
  if (!c.adapter_dir.empty() && !c.snapshot &&
      !std::filesystem::exists(std::filesystem::path(c.adapter_dir) / "adapter_config.json"))
    return Status::NotFound("sampler snapshot " + c.adapter_dir + " has no adapter_config.json");
  return Status::Ok();
}

}  // namespace loom::engine
