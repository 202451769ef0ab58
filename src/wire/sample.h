// The sampling wire codec: JSON `SampleRequest` bodies of /api/v1/asample in
// (spec §5.19, §8.1, §8.4), protobuf `tinker_public.SampleResponse` bytes out
// (spec §8.11). The request and the sampler's output are Tinker's types
// (tinker/); this file only translates.
//
// Pure functions; any thread may call them.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "tinker/requests.h"
#include "tinker/types.h"

namespace loom::wire {

enum class StopReason { kStop, kLength };  // kStop: EOS / stop token / stop string

struct SampledSequence {
  StopReason stop_reason = StopReason::kStop;
  std::vector<int32_t> tokens;   // generated tokens, stop token included
  std::vector<float> logprobs;   // same length as tokens
};

// Top-k prompt logprobs, row-major N x K. Empty cells are padded with token
// id 0 and logprob -99999.0 (kTopkPadLogprob); row 0 is all padding.
struct TopkPromptLogprobs {
  static constexpr float kTopkPadLogprob = -99999.0f;
  uint32_t k = 0;
  uint32_t prompt_length = 0;     // N
  std::vector<int32_t> token_ids; // N*K
  std::vector<float> logprobs;    // N*K
};

// The SampleResponse message as it goes on the wire (the sampler's
// tinker::SampleOutput, with top-k as its own message).
struct SampleResult {
  std::vector<SampledSequence> sequences;          // in sample_sequence_ids order
  std::optional<std::vector<float>> prompt_logprobs;  // one per prompt token, [0] = NaN
  std::optional<TopkPromptLogprobs> topk_prompt_logprobs;
  int32_t prompt_cache_hit_tokens = 0;
};

// The sampler's output as the SampleResponse to encode.
SampleResult SampleResultOf(const tinker::SampleOutput& output);
// The inverse: what a gateway hands on after decoding a replica's answer.
tinker::SampleOutput SampleOutputOf(const SampleResult& result);

// Protobuf SampleResponse bytes. Fails (kInternal) if a sequence's logprobs
// length differs from its tokens, or top-k sizes differ from N*K.
Result<std::string> EncodeSampleResponse(const SampleResult& result);
// The inverse, for tests and C++ clients.
Result<SampleResult> DecodeSampleResponse(std::string_view bytes);

// Parses an asample body. Unknown fields are ignored. Errors are
// kInvalidArgument naming the field ("asample.sampling_params.top_p: expected
// a number"); stateless range checks: num_samples >= 1, max_tokens >= 0,
// temperature >= 0 and finite, top_p in (0, 1], top_k == -1 or >= 1,
// topk_prompt_logprobs >= 0, prompt non-empty, image / dmel chunks rejected
// ("asample.prompt chunk i: image chunks are not supported by this text-only
// model"). Take the body through ParseJsonObject(body, "asample") first.
Result<tinker::SampleRequest> ParseSampleRequest(const nlohmann::json& body);

// The chunk list of a JSON ModelInput ({"chunks": [...]}) as tokens; `where`
// prefixes error messages (e.g. "asample.prompt").
Result<std::vector<int32_t>> ParseModelInputTokens(const nlohmann::json& model_input, const std::string& where);

}  // namespace loom::wire
