// libFuzzer target: every JSON request decoder of wire/json_api.h and
// wire/sample.h, plus the decoders of text taken from URLs (tinker paths,
// checkpoint ids, limit/offset), driven the way http/router.cpp drives them:
// ParseJsonObject(body, endpoint), then the endpoint's parser, then the error
// body the gateway would send.
//
// Input: one byte that picks the decoder (modulo the table's size), then the
// body. tests/fuzz/make_corpus.py reads kDecoders' names from this file to
// write the seeds, so the table may grow, but entries keep their order.
//
// A decoder may refuse anything; it must not crash, throw, leak, or accept a
// value outside the ranges its header promises (checked below).
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "wire/errors.h"
#include "wire/json_api.h"
#include "wire/sample.h"
#include "require.h"

namespace {

using loom::fuzz::Require;
using namespace loom;
using namespace loom::wire;
using namespace loom::tinker;  // the types wire/ parses into

// Like the gateway: a refused request becomes an error body (errors.cpp).
bool Answer(const Status& s) {
  if (s.ok()) return true;
  Require(!s.message().empty(), "an error without a message");
  Require(!ErrorBody(s).empty(), "an empty error body");
  return false;
}
template <typename T>
bool Answer(const Result<T>& r) {
  return Answer(r.status());
}

// On success, check(request) tests what the decoder's header promises.
template <typename Parse, typename Check>
void Json(std::string_view endpoint, std::string_view body, Parse parse, Check check) {
  Result<wire::Json> j = ParseJsonObject(body, endpoint);
  if (!Answer(j)) return;
  Require(j->is_object(), "ParseJsonObject returned a non-object");
  auto req = parse(*j);
  if (!Answer(req)) return;
  check(*req);
  DumpJson(*j);  // received values are echoed back in answers and logs: dumping must not throw
}
template <typename Parse>
void Json(std::string_view endpoint, std::string_view body, Parse parse) {
  Json(endpoint, body, parse, [](const auto&) {});
}

void TtlInRange(const std::optional<int64_t>& ttl) { Require(!ttl || *ttl >= 1, "ttl_seconds < 1"); }

// Splits "a\0b" (run id, checkpoint id) or "a&b" (limit, offset) at the first sep.
std::pair<std::string_view, std::string_view> Split(std::string_view s, char sep) {
  size_t at = s.find(sep);
  if (at == std::string_view::npos) return {s, {}};
  return {s.substr(0, at), s.substr(at + 1)};
}

using Body = std::string_view;

struct Decoder {
  const char* name;  // the endpoint; make_corpus.py maps captured routes onto it
  void (*run)(Body name, Body body);
};

// ORDER IS THE CORPUS FORMAT: append only.
const Decoder kDecoders[] = {
    {"client/config", [](Body e, Body b) { Json(e, b, ParseClientConfigRequest); }},
    {"create_session", [](Body e, Body b) { Json(e, b, ParseCreateSessionRequest); }},
    {"session_heartbeat", [](Body e, Body b) { Json(e, b, ParseSessionHeartbeatRequest); }},
    {"telemetry", [](Body e, Body b) { Json(e, b, ParseTelemetryRequest); }},
    {"create_model",
     [](Body e, Body b) {
       Json(e, b, ParseCreateModelRequest, [](const CreateModelRequest& r) {
         Require(r.model_seq_id >= 0, "create_model.model_seq_id < 0");
         Require(r.lora.rank >= 1, "create_model.lora_config.rank < 1");
         Require(r.lora.train_attn || r.lora.train_mlp || r.lora.train_unembed, "no train_* set");
       });
     }},
    {"get_info", [](Body e, Body b) { Json(e, b, ParseGetInfoRequest); }},
    {"unload_model", [](Body e, Body b) { Json(e, b, ParseUnloadModelRequest); }},
    {"weights_info", [](Body e, Body b) { Json(e, b, ParseWeightsInfoRequest); }},
    {"optim_step",
     [](Body e, Body b) {
       Json(e, b, ParseOptimStepRequest, [](const OptimStepRequest& r) {
         const tinker::AdamParams& p = r.adam_params;
         for (double v : {p.learning_rate, p.eps, p.weight_decay, p.grad_clip_norm})
           Require(std::isfinite(v) && v >= 0, "optim_step: a non-finite or negative hyperparameter");
         for (double beta : {p.beta1, p.beta2}) Require(beta >= 0 && beta < 1, "optim_step: beta outside [0, 1)");
       });
     }},
    {"save_weights",
     [](Body e, Body b) {
       Json(e, b, ParseSaveWeightsRequest, [](const SaveWeightsRequest& r) { TtlInRange(r.ttl_seconds); });
     }},
    {"load_weights", [](Body e, Body b) { Json(e, b, ParseLoadWeightsRequest); }},
    {"save_weights_for_sampler",
     [](Body e, Body b) {
       Json(e, b, ParseSaveWeightsForSamplerRequest, [](const SaveWeightsForSamplerRequest& r) {
         TtlInRange(r.ttl_seconds);
         Require(r.name || r.sampling_session_seq_id, "save_weights_for_sampler: neither path nor seq id");
       });
     }},
    {"create_sampling_session",
     [](Body e, Body b) {
       Json(e, b, ParseCreateSamplingSessionRequest, [](const CreateSamplingSessionRequest& r) {
         Require(r.base_model || r.model_path, "create_sampling_session: no model");
       });
     }},
    {"asample",
     [](Body e, Body b) {
       Json(e, b, ParseSampleRequest, [](const SampleRequest& r) {
         const SamplingParams& p = r.sampling_params;
         Require(r.num_samples >= 1, "asample.num_samples < 1");
         Require(!r.prompt.empty(), "asample.prompt empty");
         Require(!p.max_tokens || *p.max_tokens >= 0, "asample.max_tokens < 0");
         Require(std::isfinite(p.temperature) && p.temperature >= 0, "asample.temperature");
         Require(p.top_p > 0 && p.top_p <= 1, "asample.top_p outside (0, 1]");
         Require(p.top_k == -1 || p.top_k >= 1, "asample.top_k");
         Require(r.topk_prompt_logprobs >= 0, "asample.topk_prompt_logprobs < 0");
       });
     }},
    {"retrieve_future", [](Body e, Body b) { Json(e, b, ParseRetrieveFutureRequest); }},
    {"checkpoint ttl",
     [](Body e, Body b) {
       Json(e, b, ParseCheckpointTtlRequest, [](const CheckpointTtlRequest& r) { TtlInRange(r.ttl_seconds); });
     }},
    {"assign_project", [](Body e, Body b) { Json(e, b, ParseAssignProjectRequest); }},
    // Text from URLs and from inside bodies (not JSON).
    {"tinker_path",
     [](Body, Body b) {
       auto p = ParseTinkerPath(b);
       if (Answer(p)) {
         auto again = ParseTinkerPath(p->ToString());  // what loom hands out must parse back
         Require(again.ok() && again->ToString() == p->ToString(), "tinker path does not round-trip");
       }
     }},
    {"checkpoint_id",
     [](Body, Body b) {
       auto [run, id] = Split(b, '\0');
       Answer(ParseCheckpointId(run, id));
     }},
    {"page_params",
     [](Body, Body b) {
       auto [limit, offset] = Split(b, '&');
       auto p = ParsePageParams(limit, offset);
       if (Answer(p)) Require(p->limit >= 1 && p->limit <= 10000 && p->offset >= 0, "page params out of range");
     }},
    {"checkpoint_name", [](Body, Body b) { Answer(ValidateCheckpointName(b, "path")); }},
};
constexpr size_t kNumDecoders = sizeof(kDecoders) / sizeof(kDecoders[0]);

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Decoder& d = kDecoders[data[0] % kNumDecoders];
  d.run(d.name, Body(reinterpret_cast<const char*>(data + 1), size - 1));
  return 0;
}
