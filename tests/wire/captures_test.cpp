// Every request the real SDK sent (shared/spec/captures) decodes with loom's
// codecs, and the decoded fields equal the capture's own decoding.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "wire/forward_backward.h"
#include "wire/json_api.h"
#include "wire/sample.h"
#include "wire_test_util.h"

namespace loom::wire {
namespace {

using namespace loom::tinker;  // the vocabulary wire/ encodes

using nlohmann::json;
using testing::Base64Decode;
using testing::CaptureFiles;

std::string Header(const json& req, const std::string& name) {
  for (const auto& h : req["headers"]) {
    std::string k = h[0].get<std::string>();
    std::transform(k.begin(), k.end(), k.begin(), ::tolower);
    if (k == name) return h[1].get<std::string>();
  }
  return "";
}

// The capture's view of one loss_fn_input as a dense row-major vector of doubles.
std::vector<double> ExpectedDense(const json& t) {
  std::vector<double> out;
  if (t["encoding"] == "dense") {
    for (const auto& v : t["dense_values"]) out.push_back(v.get<double>());
    return out;
  }
  const auto& csr = t["sparse_csr"];
  int64_t rows = t["shape"][0], cols = t["shape"][1];
  out.assign(rows * cols, 0.0);
  const auto& crow = csr["crow_indices(int64)"];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = crow[r].get<int64_t>(); k < crow[r + 1].get<int64_t>(); ++k)
      out[r * cols + csr["col_indices(int64)"][k].get<int64_t>()] = csr["values"][k].get<double>();
  return out;
}

std::vector<double> AsDoubles(const tinker::Array& a) {
  std::vector<double> out;
  if (a.dtype == tinker::Array::DType::kFloat32)
    for (float v : a.f32) out.push_back(v);
  else
    for (int64_t v : a.i64) out.push_back(static_cast<double>(v));
  return out;
}

void CheckForwardBackward(const json& req, const std::string& body, const std::string& where) {
  ForwardBackwardDecodeOptions opt;
  opt.zstd = Header(req, "content-encoding") == "zstd";
  auto r = DecodeForwardBackwardRequest(body, opt);
  ASSERT_TRUE(r.ok()) << where << ": " << r.status().message();
  const json& want = req["body_decoded"];
  EXPECT_EQ(r->model_id, want["model_id"].get<std::string>()) << where;
  EXPECT_EQ(r->seq_id, want["seq_id"].get<int>()) << where;
  EXPECT_EQ(r->call.loss_fn, want["loss_fn"].get<std::string>()) << where;
  EXPECT_EQ(r->call.forward_only, want["forward_only"].get<bool>()) << where;
  std::map<std::string, double> cfg = want["loss_fn_config"].get<std::map<std::string, double>>();
  EXPECT_EQ(r->call.loss_fn_config, cfg) << where;
  ASSERT_EQ(r->call.data.size(), want["data"].size()) << where;
  for (size_t d = 0; d < want["data"].size(); ++d) {
    const json& wd = want["data"][d];
    const tinker::Datum& got = r->call.data[d];
    std::vector<int32_t> tokens;
    for (const auto& chunk : wd["model_input"])
      for (const auto& t : chunk["encoded_text"]["tokens(int32 LE)"]) tokens.push_back(t.get<int32_t>());
    EXPECT_EQ(got.tokens, tokens) << where << " datum " << d;
    ASSERT_EQ(got.loss_fn_inputs.size(), wd["loss_fn_inputs"].size()) << where;
    for (const auto& [name, t] : wd["loss_fn_inputs"].items()) {
      ASSERT_TRUE(got.loss_fn_inputs.count(name)) << where << " missing " << name;
      const tinker::Array& a = got.loss_fn_inputs.at(name);
      EXPECT_EQ(a.shape, t["shape"].get<std::vector<int64_t>>()) << where << " " << name;
      bool is_float = t["dtype"] == "DTYPE_FLOAT32" || t["dtype"] == "DTYPE_BFLOAT16";
      EXPECT_EQ(a.dtype == tinker::Array::DType::kFloat32, is_float) << where << " " << name;
      auto want_values = ExpectedDense(t);
      auto got_values = AsDoubles(a);
      ASSERT_EQ(got_values.size(), want_values.size()) << where << " " << name;
      for (size_t i = 0; i < want_values.size(); ++i)
        EXPECT_NEAR(got_values[i], want_values[i], 1e-6 * std::max(1.0, std::abs(want_values[i]))) << where << " " << name;
    }
  }
}

void CheckSample(const json& want, const std::string& body, const std::string& where) {
  auto j = ParseJsonObject(body, "asample");
  ASSERT_TRUE(j.ok()) << where << ": " << j.status().message();
  auto r = ParseSampleRequest(j.value());
  ASSERT_TRUE(r.ok()) << where << ": " << r.status().message();
  EXPECT_EQ(r->sampling_session_id, want["sampling_session_id"].get<std::string>());
  EXPECT_EQ(r->seq_id, want["seq_id"].get<int64_t>());
  EXPECT_EQ(r->num_samples, want["num_samples"].get<int>());
  std::vector<int32_t> prompt;
  for (const auto& c : want["prompt"]["chunks"])
    for (const auto& t : c["tokens"]) prompt.push_back(t.get<int32_t>());
  EXPECT_EQ(r->prompt, prompt) << where;
  EXPECT_EQ(r->prompt_logprobs, want["prompt_logprobs"].get<bool>());
  EXPECT_EQ(r->topk_prompt_logprobs, want["topk_prompt_logprobs"].get<int>());
  const json& sp = want["sampling_params"];
  if (sp.contains("max_tokens")) {
    ASSERT_TRUE(r->sampling_params.max_tokens.has_value());
    EXPECT_EQ(*r->sampling_params.max_tokens, sp["max_tokens"].get<int>());
  }
  if (sp.contains("seed")) {
    ASSERT_TRUE(r->sampling_params.seed.has_value());
    EXPECT_EQ(*r->sampling_params.seed, sp["seed"].get<uint64_t>());
  } else {
    EXPECT_FALSE(r->sampling_params.seed.has_value());
  }
  EXPECT_DOUBLE_EQ(r->sampling_params.temperature, sp.value("temperature", 1.0));
  EXPECT_DOUBLE_EQ(r->sampling_params.top_p, sp.value("top_p", 1.0));
  EXPECT_EQ(r->sampling_params.top_k, sp.value("top_k", -1));
  std::vector<std::string> stop_strs;
  std::vector<int32_t> stop_toks;
  if (sp.contains("stop")) {
    if (sp["stop"].is_string()) stop_strs.push_back(sp["stop"]);
    else
      for (const auto& s : sp["stop"]) {
        if (s.is_string()) stop_strs.push_back(s);
        else stop_toks.push_back(s.get<int32_t>());
      }
  }
  EXPECT_EQ(r->sampling_params.stop_strings, stop_strs) << where;
  EXPECT_EQ(r->sampling_params.stop_tokens, stop_toks) << where;
}

// Checks one JSON request against its capture; returns false for an endpoint it does not know.
bool CheckJson(const std::string& path, const json& want, const std::string& body, const std::string& where) {
  std::string endpoint = path.substr(std::string("/api/v1/").size());
  auto parsed = ParseJsonObject(body, endpoint);
  EXPECT_TRUE(parsed.ok()) << where << ": " << parsed.status().message();
  if (!parsed.ok()) return true;
  const json& j = parsed.value();
  EXPECT_EQ(j, want) << where << ": the JSON parse differs from the capture's decoding";
#define EXPECT_PARSED(call)                                                   \
  [&] {                                                                       \
    auto r = call;                                                            \
    EXPECT_TRUE(r.ok()) << where << ": " << r.status().message();             \
    return r;                                                                 \
  }()
  if (endpoint == "client/config" || endpoint == "client/dynamic_config") {
    auto r = EXPECT_PARSED(ParseClientConfigRequest(j));
    EXPECT_EQ(r->sdk_version.value_or(""), want["sdk_version"].get<std::string>());
  } else if (endpoint == "auth/token") {
    EXPECT_TRUE(j.empty()) << where;
  } else if (endpoint == "create_session") {
    auto r = EXPECT_PARSED(ParseCreateSessionRequest(j));
    EXPECT_EQ(r->tags, want["tags"].get<std::vector<std::string>>());
    EXPECT_EQ(r->user_metadata.size(), want["user_metadata"].size());
    EXPECT_EQ(r->sdk_version.value_or(""), want["sdk_version"].get<std::string>());
  } else if (endpoint == "session_heartbeat") {
    auto r = EXPECT_PARSED(ParseSessionHeartbeatRequest(j));
    EXPECT_EQ(r->session_id, want["session_id"].get<std::string>());
  } else if (endpoint == "create_model") {
    auto r = EXPECT_PARSED(ParseCreateModelRequest(j));
    EXPECT_EQ(r->session_id, want["session_id"].get<std::string>());
    EXPECT_EQ(r->model_seq_id, want["model_seq_id"].get<int64_t>());
    EXPECT_EQ(r->base_model, want["base_model"].get<std::string>());
    const json& lc = want["lora_config"];
    EXPECT_EQ(r->lora.rank, lc["rank"].get<int>());
    EXPECT_EQ(r->lora.train_unembed, lc["train_unembed"].get<bool>());
    EXPECT_EQ(r->lora.train_mlp, lc["train_mlp"].get<bool>());
    EXPECT_EQ(r->lora.train_attn, lc["train_attn"].get<bool>());
    EXPECT_EQ(r->seed_given, lc.contains("seed"));
    if (lc.contains("seed")) EXPECT_EQ(r->lora.seed, lc["seed"].get<uint64_t>());
  } else if (endpoint == "get_info") {
    auto r = EXPECT_PARSED(ParseGetInfoRequest(j));
    EXPECT_EQ(r->model_id, want["model_id"].get<std::string>());
  } else if (endpoint == "weights_info") {
    auto r = EXPECT_PARSED(ParseWeightsInfoRequest(j));
    EXPECT_EQ(r->path.ToString(), want["tinker_path"].get<std::string>());
  } else if (endpoint == "optim_step") {
    auto r = EXPECT_PARSED(ParseOptimStepRequest(j));
    EXPECT_EQ(r->model_id, want["model_id"].get<std::string>());
    EXPECT_EQ(r->seq_id, want["seq_id"].get<int64_t>());
    const json& ap = want["adam_params"];
    EXPECT_DOUBLE_EQ(r->adam_params.learning_rate, ap["learning_rate"].get<double>());
    EXPECT_DOUBLE_EQ(r->adam_params.beta1, ap["beta1"].get<double>());
    EXPECT_DOUBLE_EQ(r->adam_params.beta2, ap["beta2"].get<double>());
    EXPECT_DOUBLE_EQ(r->adam_params.eps, ap["eps"].get<double>());
    EXPECT_DOUBLE_EQ(r->adam_params.weight_decay, ap["weight_decay"].get<double>());
    EXPECT_DOUBLE_EQ(r->adam_params.grad_clip_norm, ap["grad_clip_norm"].get<double>());
  } else if (endpoint == "save_weights") {
    auto r = EXPECT_PARSED(ParseSaveWeightsRequest(j));
    EXPECT_EQ(r->model_id, want["model_id"].get<std::string>());
    EXPECT_EQ(r->seq_id, want["seq_id"].get<int64_t>());
    EXPECT_EQ(r->name.value_or(""), want["path"].get<std::string>());
    EXPECT_EQ(r->overwrite, want["overwrite"].get<bool>());
    EXPECT_EQ(r->ttl_seconds.has_value(), want.contains("ttl_seconds"));
  } else if (endpoint == "load_weights") {
    auto r = EXPECT_PARSED(ParseLoadWeightsRequest(j));
    EXPECT_EQ(r->mode, LoadWeightsRequest::Mode::kTrainingClient);
    EXPECT_EQ(r->model_id, want["model_id"].get<std::string>());
    EXPECT_EQ(r->seq_id, want["seq_id"].get<int64_t>());
    EXPECT_EQ(r->path.ToString(), want["path"].get<std::string>());
    EXPECT_EQ(r->optimizer, want["optimizer"].get<bool>());
  } else if (endpoint == "save_weights_for_sampler") {
    auto r = EXPECT_PARSED(ParseSaveWeightsForSamplerRequest(j));
    EXPECT_EQ(r->model_id, want["model_id"].get<std::string>());
    EXPECT_EQ(r->seq_id, want["seq_id"].get<int64_t>());
    EXPECT_EQ(r->named(), want.contains("path"));
    if (want.contains("path")) EXPECT_EQ(*r->name, want["path"].get<std::string>());
    if (want.contains("sampling_session_seq_id"))
      EXPECT_EQ(r->sampling_session_seq_id.value_or(-1), want["sampling_session_seq_id"].get<int64_t>());
  } else if (endpoint == "create_sampling_session") {
    auto r = EXPECT_PARSED(ParseCreateSamplingSessionRequest(j));
    EXPECT_EQ(r->session_id, want["session_id"].get<std::string>());
    EXPECT_EQ(r->sampling_session_seq_id, want["sampling_session_seq_id"].get<int64_t>());
    EXPECT_EQ(r->model_path.value_or(""), want.value("model_path", ""));
    EXPECT_EQ(r->base_model.value_or(""), want.value("base_model", ""));
  } else if (endpoint == "retrieve_future") {
    auto r = EXPECT_PARSED(ParseRetrieveFutureRequest(j));
    EXPECT_EQ(r->request_id, want["request_id"].get<std::string>());
    EXPECT_EQ(r->allow_metadata_only, want["allow_metadata_only"].get<bool>());
  } else if (endpoint == "telemetry") {
    auto r = EXPECT_PARSED(ParseTelemetryRequest(j));
    EXPECT_EQ(r->session_id.value_or(""), want["session_id"].get<std::string>());
    EXPECT_EQ(r->process_uuid.value_or(""), want["process_uuid"].get<std::string>());
    EXPECT_EQ(r->event_kinds.size(), want["events"].size());
    for (size_t i = 0; i < r->event_kinds.size() && i < want["events"].size(); ++i) EXPECT_EQ(r->event_kinds[i], want["events"][i]["event"].get<std::string>());
  } else if (endpoint == "asample") {
    CheckSample(want, body, where);
  } else {
    return false;
  }
#undef EXPECT_PARSED
  return true;
}

TEST(Captures, EveryCapturedRequestDecodesToItsRecordedFields) {
  auto files = CaptureFiles();
  if (files.empty()) GTEST_SKIP() << "shared/spec/captures is not beside the repository";
  std::map<std::string, int> decoded;  // endpoint -> count
  int zstd_bodies = 0;
  for (const auto& file : files) {
    json cap = json::parse(testing::ReadFile(file));
    const json& req = cap["request"];
    const std::string where = file.parent_path().filename().string() + "/" + file.filename().string();
    const std::string path = req["path"];
    if (req.value("body_size_on_wire", 0) == 0) continue;  // GETs and empty POSTs
    std::string body = Base64Decode(req["body_b64_on_wire"].get<std::string>());
    ASSERT_EQ(body.size(), req["body_size_on_wire"].get<size_t>()) << where;
    if (path == "/api/v1/forward_backward") {
      if (Header(req, "content-encoding") == "zstd") ++zstd_bodies;
      CheckForwardBackward(req, body, where);
    } else {
      EXPECT_TRUE(CheckJson(path, req["body_decoded"], body, where)) << where << ": no codec for " << path;
    }
    ++decoded[path];
  }
  // Not vacuous: both capture sets, every kind of body.
  EXPECT_EQ(decoded["/api/v1/forward_backward"], 8);
  EXPECT_EQ(zstd_bodies, 4);
  EXPECT_GE(decoded["/api/v1/asample"], 8);
  EXPECT_GE(decoded["/api/v1/load_weights"], 6);
  EXPECT_GE(decoded.size(), 15u);
}

// The fake server's protobuf answers (what the SDK accepted) decode with
// loom's decoders to the values the capture recorded.
TEST(Captures, RecordedProtobufAnswersDecode) {
  auto files = CaptureFiles();
  if (files.empty()) GTEST_SKIP() << "shared/spec/captures is not beside the repository";
  int fwd = 0, smp = 0;
  for (const auto& file : files) {
    json cap = json::parse(testing::ReadFile(file));
    const json& resp = cap["response"];
    if (!resp.contains("body_proto_decoded") || resp["body_proto_decoded"].is_null()) continue;
    const json& want = resp["body_proto_decoded"];
    std::string bytes = Base64Decode(resp["body_b64"].get<std::string>());
    const std::string where = file.filename().string();
    if (want["proto_message"] == "tinker_public.ForwardBackwardOutput") {
      ++fwd;
      auto r = DecodeForwardBackwardOutput(bytes);
      ASSERT_TRUE(r.ok()) << where << ": " << r.status().message();
      for (const auto& [k, v] : want["metrics"].items()) EXPECT_DOUBLE_EQ(r->metrics.at(k), v.get<double>());
      size_t n = 0;
      for (const auto& rec : want["loss_fn_outputs"]) n += rec["num_datums"].get<size_t>();
      ASSERT_EQ(r->outputs.size(), n) << where;
      // Re-encode and decode again: same per-datum values.
      tinker::ForwardBackwardOutput o = r.value();
      auto again = EncodeForwardBackwardOutput(o);
      ASSERT_TRUE(again.ok()) << again.status().message();
      auto back = DecodeForwardBackwardOutput(again.value());
      ASSERT_TRUE(back.ok());
      ASSERT_EQ(back->outputs.size(), n);
      for (size_t d = 0; d < n; ++d)
        for (const auto& [name, a] : o.outputs[d]) {
          EXPECT_EQ(back->outputs[d].at(name).shape, a.shape);
          EXPECT_EQ(back->outputs[d].at(name).f32, a.f32);
        }
    } else if (want["proto_message"] == "tinker_public.SampleResponse") {
      ++smp;
      auto r = DecodeSampleResponse(bytes);
      ASSERT_TRUE(r.ok()) << where << ": " << r.status().message();
      ASSERT_EQ(r->sequences.size(), want["sequences"].size());
      for (size_t i = 0; i < r->sequences.size(); ++i)
        EXPECT_EQ(r->sequences[i].tokens, want["sequences"][i]["tokens(int32 LE)"].get<std::vector<int32_t>>());
      const bool has_plp = want.contains("prompt_logprobs(float32 LE)") && !want["prompt_logprobs(float32 LE)"].is_null();
      EXPECT_EQ(r->prompt_logprobs.has_value(), has_plp) << where;
      if (r->prompt_logprobs) EXPECT_TRUE(std::isnan((*r->prompt_logprobs)[0]));
      // loom's encoder reproduces the same bytes-level content (parsed back equal).
      auto enc = EncodeSampleResponse(r.value());
      ASSERT_TRUE(enc.ok());
      auto back = DecodeSampleResponse(enc.value());
      ASSERT_TRUE(back.ok());
      EXPECT_EQ(back->sequences.size(), r->sequences.size());
      EXPECT_EQ(back->topk_prompt_logprobs.has_value(), r->topk_prompt_logprobs.has_value());
    }
  }
  EXPECT_GE(fwd, 8);
  EXPECT_GE(smp, 8);
}

}  // namespace
}  // namespace loom::wire
