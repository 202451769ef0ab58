#include "wire/sample.h"

#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

#include "tinker_public.pb.h"
#include "wire/proto_bytes.h"
#include "wire/json_api.h"
#include "wire/json_fields.h"

namespace loom::wire {

namespace pb = ::tinker_public;
namespace f = fields;

namespace {

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

template <typename T>
bool FromBytes(const std::string& b, std::vector<T>* out) {
  if (b.size() % sizeof(T) != 0) return false;
  out->resize(b.size() / sizeof(T));
  if (!b.empty()) std::memcpy(out->data(), b.data(), b.size());
  return true;
}

Status Int32In(int64_t v, const std::string& path, int64_t lo, int32_t* out) {
  if (v < lo || v > std::numeric_limits<int32_t>::max())
    return Status::Invalid(path + ": " + std::to_string(v) + " is outside [" + std::to_string(lo) + ", 2^31-1]");
  *out = static_cast<int32_t>(v);
  return Status::Ok();
}

Status ParseStop(const nlohmann::json& stop, const std::string& path, tinker::SamplingParams* p) {
  if (stop.is_null()) return Status::Ok();
  if (stop.is_string()) {
    p->stop_strings.push_back(stop.get<std::string>());
    return Status::Ok();
  }
  const std::string kind = ": expected a string, a list of strings or a list of token ids";
  if (!stop.is_array()) return Status::Invalid(path + kind);
  bool strings = false, ints = false;
  for (size_t i = 0; i < stop.size(); ++i) {
    const auto& e = stop[i];
    if (e.is_string()) {
      strings = true;
      p->stop_strings.push_back(e.get<std::string>());
    } else if (e.is_number()) {
      ints = true;
      int64_t t = 0;
      int32_t t32 = 0;
      LOOM_WIRE_TRY(f::AsInt(e, path + "[" + std::to_string(i) + "]", &t));
      LOOM_WIRE_TRY(Int32In(t, path + "[" + std::to_string(i) + "]", 0, &t32));
      p->stop_tokens.push_back(t32);
    } else {
      return Status::Invalid(path + "[" + std::to_string(i) + "]" + kind);
    }
  }
  if (strings && ints) return Status::Invalid(path + ": mixes strings and token ids" );
  return Status::Ok();
}

Status ParseSamplingParams(const nlohmann::json& j, const std::string& w, tinker::SamplingParams* p) {
  LOOM_WIRE_TRY(f::RequireObject(j, w));
  std::optional<int64_t> max_tokens, top_k;
  LOOM_WIRE_TRY(f::OptInt(j, w, "max_tokens", &max_tokens));
  if (max_tokens) {
    int32_t v = 0;
    LOOM_WIRE_TRY(Int32In(*max_tokens, f::Path(w, "max_tokens"), 0, &v));
    p->max_tokens = v;
  }
  LOOM_WIRE_TRY(f::OptAnyU64(j, w, "seed", &p->seed));
  std::optional<double> temperature, top_p;
  LOOM_WIRE_TRY(f::OptDouble(j, w, "temperature", &temperature));
  if (temperature) {
    if (!std::isfinite(*temperature) || *temperature < 0)
      return Status::Invalid(f::Path(w, "temperature") + ": must be finite and >= 0");
    p->temperature = *temperature;
  }
  LOOM_WIRE_TRY(f::OptInt(j, w, "top_k", &top_k));
  if (top_k) {
    if (*top_k != -1 && *top_k < 1) return Status::Invalid(f::Path(w, "top_k") + ": must be -1 (no limit) or >= 1");
    LOOM_WIRE_TRY(Int32In(*top_k, f::Path(w, "top_k"), -1, &p->top_k));
  }
  LOOM_WIRE_TRY(f::OptDouble(j, w, "top_p", &top_p));
  if (top_p) {
    if (!(*top_p > 0.0 && *top_p <= 1.0)) return Status::Invalid(f::Path(w, "top_p") + ": must be in (0, 1]");
    p->top_p = *top_p;
  }
  if (const auto* stop = f::Find(j, "stop")) LOOM_WIRE_TRY(ParseStop(*stop, f::Path(w, "stop"), p));
  return Status::Ok();
}

}  // namespace

Result<std::vector<int32_t>> ParseModelInputTokens(const nlohmann::json& model_input, const std::string& where) {
  LOOM_WIRE_TRY(f::RequireObject(model_input, where));
  const auto* chunks = f::Find(model_input, "chunks");
  if (!chunks) return Status::Invalid(where + ".chunks: required field is missing");
  if (!chunks->is_array()) return Status::Invalid(where + ".chunks: expected a list");
  std::vector<int32_t> tokens;
  for (size_t i = 0; i < chunks->size(); ++i) {
    const auto& c = (*chunks)[i];
    const std::string cw = where + " chunk " + std::to_string(i);
    if (!c.is_object()) return Status::Invalid(cw + ": expected an object");
    std::string type = "encoded_text";
    if (const auto* t = f::Find(c, "type")) {
      if (!t->is_string()) return Status::Invalid(cw + ".type: expected a string");
      type = t->get<std::string>();
    }
    if (type == "image" || type == "image_asset_pointer")
      return Status::Invalid(cw + ": image chunks are not supported by this text-only model");
    if (type == "dmel") return Status::Invalid(cw + ": dmel (audio) chunks are not supported by this text-only model");
    if (type != "encoded_text") return Status::Invalid(cw + ": unknown chunk type '" + type + "'");
    const auto* toks = f::Find(c, "tokens");
    if (!toks) return Status::Invalid(cw + ".tokens: required field is missing");
    if (!toks->is_array()) return Status::Invalid(cw + ".tokens: expected a list of token ids");
    tokens.reserve(tokens.size() + toks->size());
    for (size_t k = 0; k < toks->size(); ++k) {
      const std::string tp = cw + ".tokens[" + std::to_string(k) + "]";
      int64_t t = 0;
      int32_t t32 = 0;
      LOOM_WIRE_TRY(f::AsInt((*toks)[k], tp, &t));
      LOOM_WIRE_TRY(Int32In(t, tp, 0, &t32));
      tokens.push_back(t32);
    }
  }
  return tokens;
}

Result<tinker::SampleRequest> ParseSampleRequest(const nlohmann::json& body) {
  const std::string w = "asample";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  tinker::SampleRequest r;
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "sampling_session_id", &r.sampling_session_id));
  LOOM_WIRE_TRY(f::Int(body, w, "seq_id", &r.seq_id));
  std::optional<int64_t> n, topk;
  LOOM_WIRE_TRY(f::OptInt(body, w, "num_samples", &n));
  if (n) LOOM_WIRE_TRY(Int32In(*n, f::Path(w, "num_samples"), 1, &r.num_samples));
  const auto* prompt = f::Find(body, "prompt");
  if (!prompt) return Status::Invalid("asample.prompt: required field is missing");
  auto toks = ParseModelInputTokens(*prompt, "asample.prompt");
  if (!toks.ok()) return toks.status();
  r.prompt = std::move(toks.value());
  if (r.prompt.empty()) return Status::Invalid("asample.prompt: must hold at least one token");
  if (const auto* sp = f::Find(body, "sampling_params"))
    LOOM_WIRE_TRY(ParseSamplingParams(*sp, "asample.sampling_params", &r.sampling_params));
  LOOM_WIRE_TRY(f::Bool(body, w, "prompt_logprobs", &r.prompt_logprobs));
  LOOM_WIRE_TRY(f::OptInt(body, w, "topk_prompt_logprobs", &topk));
  if (topk) LOOM_WIRE_TRY(Int32In(*topk, f::Path(w, "topk_prompt_logprobs"), 0, &r.topk_prompt_logprobs));
  LOOM_WIRE_TRY(f::OptString(body, w, "base_model", &r.base_model));
  LOOM_WIRE_TRY(f::OptString(body, w, "model_path", &r.model_path));
  return r;
}

SampleResult SampleResultOf(const tinker::SampleOutput& output) {
  SampleResult r;
  for (const tinker::SampledSequence& s : output.sequences) {
    SampledSequence w;
    w.stop_reason = s.stop_reason == tinker::StopReason::kStop ? StopReason::kStop : StopReason::kLength;
    w.tokens = s.tokens;
    w.logprobs = s.logprobs;
    r.sequences.push_back(std::move(w));
  }
  r.prompt_logprobs = output.prompt_logprobs;
  r.prompt_cache_hit_tokens = output.prompt_cache_hit_tokens;
  if (output.topk > 0) {
    TopkPromptLogprobs t;
    t.k = static_cast<uint32_t>(output.topk);
    t.prompt_length = static_cast<uint32_t>(output.topk_token_ids.size() / static_cast<size_t>(output.topk));
    t.token_ids = output.topk_token_ids;
    t.logprobs = output.topk_logprobs;
    r.topk_prompt_logprobs = std::move(t);
  }
  return r;
}

tinker::SampleOutput SampleOutputOf(const SampleResult& result) {
  tinker::SampleOutput out;
  for (const SampledSequence& w : result.sequences) {
    tinker::SampledSequence s;
    s.stop_reason = w.stop_reason == StopReason::kStop ? tinker::StopReason::kStop : tinker::StopReason::kLength;
    s.tokens = w.tokens;
    s.logprobs = w.logprobs;
    out.sequences.push_back(std::move(s));
  }
  out.prompt_logprobs = result.prompt_logprobs;
  out.prompt_cache_hit_tokens = result.prompt_cache_hit_tokens;
  if (result.topk_prompt_logprobs && result.topk_prompt_logprobs->k > 0) {
    out.topk = static_cast<int32_t>(result.topk_prompt_logprobs->k);
    out.topk_token_ids = result.topk_prompt_logprobs->token_ids;
    out.topk_logprobs = result.topk_prompt_logprobs->logprobs;
  }
  return out;
}

Result<std::string> EncodeSampleResponse(const SampleResult& result) {
  pb::SampleResponse msg;
  for (size_t i = 0; i < result.sequences.size(); ++i) {
    const SampledSequence& s = result.sequences[i];
    if (s.logprobs.size() != s.tokens.size())
      return Status::Internal("sequences[" + std::to_string(i) + "]: " + std::to_string(s.logprobs.size()) +
                              " logprobs for " + std::to_string(s.tokens.size()) + " tokens");
    pb::SampledSequence* ps = msg.add_sequences();
    ps->set_stop_reason(s.stop_reason == StopReason::kLength ? pb::STOP_REASON_LENGTH : pb::STOP_REASON_STOP);
    ps->set_tokens(Bytes(s.tokens));
    ps->set_logprobs(Bytes(s.logprobs));
  }
  if (result.prompt_logprobs) msg.set_prompt_logprobs(Bytes(*result.prompt_logprobs));
  if (result.topk_prompt_logprobs) {
    const TopkPromptLogprobs& t = *result.topk_prompt_logprobs;
    const size_t cells = static_cast<size_t>(t.k) * t.prompt_length;
    if (t.token_ids.size() != cells || t.logprobs.size() != cells)
      return Status::Internal("topk_prompt_logprobs: expected N x K = " + std::to_string(cells) + " cells");
    pb::TopkPromptLogprobs* pt = msg.mutable_topk_prompt_logprobs();
    pt->set_k(t.k);
    pt->set_prompt_length(t.prompt_length);
    pt->set_token_ids(Bytes(t.token_ids));
    pt->set_logprobs(Bytes(t.logprobs));
  }
  msg.set_prompt_cache_hit_tokens(result.prompt_cache_hit_tokens);
  return SerializeDeterministic(msg);
}

Result<SampleResult> DecodeSampleResponse(std::string_view bytes) {
  pb::SampleResponse msg;
  if (bytes.size() > static_cast<size_t>(INT_MAX) || !msg.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())))
    return Status::Invalid("SampleResponse: not a valid protobuf message");
  SampleResult r;
  for (int i = 0; i < msg.sequences_size(); ++i) {
    const auto& ps = msg.sequences(i);
    SampledSequence s;
    if (ps.stop_reason() != pb::STOP_REASON_STOP && ps.stop_reason() != pb::STOP_REASON_LENGTH)
      return Status::Invalid("SampleResponse.sequences[" + std::to_string(i) + "]: unknown stop_reason");
    s.stop_reason = ps.stop_reason() == pb::STOP_REASON_LENGTH ? StopReason::kLength : StopReason::kStop;
    if (!FromBytes(ps.tokens(), &s.tokens) || !FromBytes(ps.logprobs(), &s.logprobs))
      return Status::Invalid("SampleResponse.sequences[" + std::to_string(i) + "]: ragged byte arrays");
    r.sequences.push_back(std::move(s));
  }
  if (msg.has_prompt_logprobs()) {
    std::vector<float> v;
    if (!FromBytes(msg.prompt_logprobs(), &v)) return Status::Invalid("SampleResponse.prompt_logprobs: ragged bytes");
    r.prompt_logprobs = std::move(v);
  }
  if (msg.has_topk_prompt_logprobs()) {
    const auto& pt = msg.topk_prompt_logprobs();
    TopkPromptLogprobs t;
    t.k = pt.k();
    t.prompt_length = pt.prompt_length();
    if (!FromBytes(pt.token_ids(), &t.token_ids) || !FromBytes(pt.logprobs(), &t.logprobs) ||
        t.token_ids.size() != static_cast<size_t>(t.k) * t.prompt_length || t.logprobs.size() != t.token_ids.size())
      return Status::Invalid("SampleResponse.topk_prompt_logprobs: sizes do not match N x K");
    r.topk_prompt_logprobs = std::move(t);
  }
  r.prompt_cache_hit_tokens = msg.prompt_cache_hit_tokens();
  return r;
}

}  // namespace loom::wire
