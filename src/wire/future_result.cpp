// Encodings of future results; see future_result.h.
#include "wire/future_result.h"

#include <cmath>
#include <type_traits>

#include "wire/forward_backward.h"
#include "wire/json_api.h"

namespace loom::wire {

using Json = nlohmann::json;

bool HasProtobufForm(const tinker::FutureResult& result) {
  return std::holds_alternative<tinker::ForwardBackwardOutput>(result) ||
         std::holds_alternative<tinker::SampleOutput>(result);
}

Result<std::string> FutureResultProtobuf(const tinker::FutureResult& result) {
  if (const auto* fb = std::get_if<tinker::ForwardBackwardOutput>(&result)) return EncodeForwardBackwardOutput(*fb);
  if (const auto* sample = std::get_if<tinker::SampleOutput>(&result)) {
    return EncodeSampleResponse(SampleResultOf(*sample));
  }
  return Status::Internal("this result has no protobuf form");
}

Json FutureResultJson(const tinker::FutureResult& result) {
  return std::visit(
      [](const auto& r) -> Json {
        using T = std::decay_t<decltype(r)>;
        if constexpr (std::is_same_v<T, tinker::CreateModelResult>) return CreateModelResultJson(r);
        else if constexpr (std::is_same_v<T, tinker::UnloadModelResult>) return UnloadModelResultJson(r);
        else if constexpr (std::is_same_v<T, tinker::ForwardBackwardOutput>) return LegacyForwardBackwardJson(r);
        else if constexpr (std::is_same_v<T, tinker::OptimStepResult>) return OptimStepResultJson(r);
        else if constexpr (std::is_same_v<T, tinker::SaveWeightsResult>) return SaveWeightsResultJson(r);
        else if constexpr (std::is_same_v<T, tinker::LoadWeightsResult>) return LoadWeightsResultJson(r);
        else if constexpr (std::is_same_v<T, tinker::SaveWeightsForSamplerResult>) {
          return SaveWeightsForSamplerResultJson(r);
        } else {
          static_assert(std::is_same_v<T, tinker::SampleOutput>);
          return LegacySampleResponseJson(SampleResultOf(r));
        }
      },
      result);
}

Json LegacyForwardBackwardJson(const tinker::ForwardBackwardOutput& out) {
  Json outputs = Json::array();
  for (const auto& datum : out.outputs) {
    Json m = Json::object();
    for (const auto& [name, a] : datum) {
      Json data = Json::array();
      if (a.dtype == tinker::Array::DType::kFloat32) {
        for (float v : a.f32) data.push_back(JsonNumber(v));
      } else {
        for (int64_t v : a.i64) data.push_back(v);
      }
      m[name] = {{"data", data},
                 {"dtype", a.dtype == tinker::Array::DType::kFloat32 ? "float32" : "int64"},
                 {"shape", a.shape}};
    }
    outputs.push_back(m);
  }
  Json metrics = Json::object();
  for (const auto& [k, v] : out.metrics) metrics[k] = JsonNumber(v);
  return {{"loss_fn_output_type", "ArrayRecord"}, {"loss_fn_outputs", outputs}, {"metrics", metrics}};
}

Json LegacySampleResponseJson(const SampleResult& result) {
  Json sequences = Json::array();
  for (const SampledSequence& s : result.sequences) {
    Json lps = Json::array();
    for (float v : s.logprobs) lps.push_back(JsonNumber(v));
    sequences.push_back({{"stop_reason", s.stop_reason == StopReason::kStop ? "stop" : "length"},
                         {"tokens", s.tokens},
                         {"logprobs", lps}});
  }
  Json j = {{"type", "sample"}, {"sequences", sequences}, {"prompt_cache_hit_tokens", result.prompt_cache_hit_tokens}};
  if (result.prompt_logprobs) {
    Json p = Json::array();
    for (float v : *result.prompt_logprobs) p.push_back(std::isnan(v) ? Json(nullptr) : JsonNumber(v));
    j["prompt_logprobs"] = p;
  }
  if (const auto& t = result.topk_prompt_logprobs) {
    Json rows = Json::array();
    for (uint32_t i = 0; i < t->prompt_length; ++i) {
      if (i == 0) {  // nothing predicts the first token
        rows.push_back(nullptr);
        continue;
      }
      Json row = Json::array();
      for (uint32_t k = 0; k < t->k; ++k) {
        const size_t at = static_cast<size_t>(i) * t->k + k;
        if (t->logprobs[at] == TopkPromptLogprobs::kTopkPadLogprob) continue;
        row.push_back(Json::array({t->token_ids[at], JsonNumber(t->logprobs[at])}));
      }
      rows.push_back(row);
    }
    j["topk_prompt_logprobs"] = rows;
  }
  return j;
}

}  // namespace loom::wire
