// JSON control plane: request parsing (types, required fields, ranges, unknown
// fields), answer builders (shapes the SDK validates), NaN-free output, tinker
// paths, and the error body.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "wire/errors.h"
#include "wire/json_api.h"

namespace loom::wire {
namespace {

using namespace loom::tinker;  // the vocabulary wire/ encodes

Json J(const std::string& s) { return Json::parse(s); }

void ExpectInvalid(const Status& s, const std::string& prefix) {
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.message();
  EXPECT_EQ(s.message().rfind(prefix, 0), 0u) << "want prefix '" << prefix << "', got '" << s.message() << "'";
}

const char* kAdam =
    R"({"adam_params":{"learning_rate":0.0001,"beta1":0.9,"beta2":0.95,"eps":1e-12,"weight_decay":0.01,
        "grad_clip_norm":1.0},"model_id":"s:train:0","seq_id":3,"type":"optim_step","future_field":[1]})";

TEST(JsonRequests, OptimStepAcceptsIntsForFloatsAndIgnoresUnknownFields) {
  auto r = ParseOptimStepRequest(J(kAdam));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->seq_id, 3);
  EXPECT_DOUBLE_EQ(r->adam_params.weight_decay, 0.01);
  Json j = J(kAdam);
  j["adam_params"]["learning_rate"] = 1;
  j["adam_params"]["grad_clip_norm"] = 0;
  r = ParseOptimStepRequest(j);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->adam_params.learning_rate, 1.0);
}

TEST(JsonRequests, OptimStepErrorsNameTheField) {
  Json j = J(kAdam);
  j["adam_params"]["learning_rate"] = "fast";
  ExpectInvalid(ParseOptimStepRequest(j).status(), "optim_step.adam_params.learning_rate: expected a number");
  j = J(kAdam);
  j["adam_params"].erase("beta2");
  ExpectInvalid(ParseOptimStepRequest(j).status(), "optim_step.adam_params.beta2: required field is missing");
  j = J(kAdam);
  j["adam_params"]["learning_rate"] = -1e-4;
  ExpectInvalid(ParseOptimStepRequest(j).status(), "optim_step.adam_params.learning_rate: must be >= 0");
  j = J(kAdam);
  j["adam_params"]["beta1"] = 1.0;
  ExpectInvalid(ParseOptimStepRequest(j).status(), "optim_step.adam_params.beta1: must be in [0, 1)");
  j = J(kAdam);
  j["adam_params"]["eps"] = 1e999;  // parses as +inf
  ExpectInvalid(ParseOptimStepRequest(j).status(), "optim_step.adam_params.eps: must be finite");
  j = J(kAdam);
  j.erase("adam_params");
  ExpectInvalid(ParseOptimStepRequest(j).status(), "optim_step.adam_params: required field is missing");
  j = J(kAdam);
  j["seq_id"] = 2.5;
  ExpectInvalid(ParseOptimStepRequest(j).status(), "optim_step.seq_id: expected an integer");
  j = J(kAdam);
  j["model_id"] = 7;
  ExpectInvalid(ParseOptimStepRequest(j).status(), "optim_step.model_id: expected a string");
}

TEST(JsonRequests, CreateModelLoraConfig) {
  auto r = ParseCreateModelRequest(J(R"({"session_id":"s","model_seq_id":0,"base_model":"Qwen/Qwen3-8B",
      "lora_config":{"rank":8,"seed":12,"train_unembed":false,"train_mlp":true,"train_attn":true},"type":"create_model"})"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->lora.rank, 8);
  EXPECT_EQ(r->lora.seed, 12u);
  EXPECT_TRUE(r->seed_given);
  EXPECT_FALSE(r->lora.train_unembed);
  r = ParseCreateModelRequest(J(R"({"session_id":"s","model_seq_id":1,"base_model":"b","lora_config":{"rank":4}})"));
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->seed_given);
  EXPECT_TRUE(r->lora.train_attn && r->lora.train_mlp && r->lora.train_unembed);
  ExpectInvalid(ParseCreateModelRequest(J(R"({"session_id":"s","model_seq_id":0,"base_model":"b","lora_config":{"rank":0}})")).status(),
                "create_model.lora_config.rank: must be in [1, 65536]");
  ExpectInvalid(ParseCreateModelRequest(J(R"({"session_id":"s","model_seq_id":0,"base_model":"b",
      "lora_config":{"rank":2,"train_unembed":false,"train_mlp":false,"train_attn":false}})")).status(),
                "create_model.lora_config: at least one");
  ExpectInvalid(ParseCreateModelRequest(J(R"({"session_id":"s","model_seq_id":0,"base_model":"b","lora_config":{"train_mlp":"yes"}})")).status(),
                "create_model.lora_config.train_mlp: expected true or false");
  ExpectInvalid(ParseCreateModelRequest(J(R"({"session_id":"s","base_model":"b"})")).status(),
                "create_model.model_seq_id: required field is missing");
  ExpectInvalid(ParseCreateModelRequest(J(R"({"session_id":"","model_seq_id":0,"base_model":"b"})")).status(),
                "create_model.session_id: must not be empty");
}

TEST(JsonRequests, LoadWeightsBothAddressingModes) {
  auto r = ParseLoadWeightsRequest(J(R"({"model_id":"s:train:1","seq_id":1,"path":"tinker://s:train:0/weights/ckpt-001",
      "optimizer":true,"type":"load_weights"})"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->mode, LoadWeightsRequest::Mode::kTrainingClient);
  EXPECT_EQ(r->path.training_run_id, "s:train:0");
  EXPECT_EQ(r->path.name, "ckpt-001");
  EXPECT_TRUE(r->optimizer);
  r = ParseLoadWeightsRequest(J(R"({"session_id":"s","model_seq_id":2,"path":"tinker://s:train:0/weights/a",
      "optimizer":false,"weights_access_token":"tml-x","type":"load_weights"})"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->mode, LoadWeightsRequest::Mode::kCreateModel);
  EXPECT_EQ(r->model_seq_id, 2);
  EXPECT_EQ(r->weights_access_token.value_or(""), "tml-x");
  ExpectInvalid(ParseLoadWeightsRequest(J(R"({"path":"tinker://a/weights/b","optimizer":false})")).status(),
                "load_weights.model_id: required");
  ExpectInvalid(ParseLoadWeightsRequest(J(R"({"model_id":"m","seq_id":1,"path":"tinker://a/sampler_weights/b"})")).status(),
                "load_weights.path: must name a training checkpoint");
  ExpectInvalid(ParseLoadWeightsRequest(J(R"({"model_id":"m","seq_id":1,"path":"/tmp/x"})")).status(),
                "load_weights.path: '/tmp/x' must start with tinker://");
}

TEST(JsonRequests, SaveWeightsAndSamplerSaves) {
  auto s = ParseSaveWeightsRequest(J(R"({"model_id":"m","path":"step_100","seq_id":5,"overwrite":false,"ttl_seconds":60})"));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->name.value_or(""), "step_100");
  EXPECT_EQ(s->ttl_seconds.value_or(0), 60);
  ExpectInvalid(ParseSaveWeightsRequest(J(R"({"model_id":"m","path":"a/b","seq_id":5})")).status(),
                "save_weights.path: checkpoint name must not contain '/'");
  ExpectInvalid(ParseSaveWeightsRequest(J(R"({"model_id":"m","path":"..","seq_id":5})")).status(), "save_weights.path");
  ExpectInvalid(ParseSaveWeightsRequest(J(R"({"model_id":"m","path":"x","seq_id":5,"ttl_seconds":0})")).status(),
                "save_weights.ttl_seconds: must be >= 1");

  auto named = ParseSaveWeightsForSamplerRequest(J(R"({"model_id":"m","path":"sampler-001","seq_id":8})"));
  ASSERT_TRUE(named.ok());
  EXPECT_TRUE(named->named());
  auto unnamed = ParseSaveWeightsForSamplerRequest(J(R"({"model_id":"m","sampling_session_seq_id":1,"seq_id":9})"));
  ASSERT_TRUE(unnamed.ok());
  EXPECT_FALSE(unnamed->named());
  EXPECT_EQ(unnamed->sampling_session_seq_id.value_or(-1), 1);
  ExpectInvalid(ParseSaveWeightsForSamplerRequest(J(R"({"model_id":"m","seq_id":9})")).status(),
                "save_weights_for_sampler.path: required field is missing");
}

TEST(JsonRequests, SmallEndpoints) {
  EXPECT_TRUE(ParseCreateSessionRequest(J(R"({"tags":["a"],"user_metadata":{"k":"v","n":3},"sdk_version":"0.26.2"})")).ok());
  auto cs = ParseCreateSessionRequest(J(R"({"user_metadata":{"n":3}})"));
  ASSERT_TRUE(cs.ok());
  EXPECT_EQ(cs->user_metadata.at("n"), "3");
  ExpectInvalid(ParseCreateSessionRequest(J(R"({"tags":"a"})")).status(), "create_session.tags: expected a list");
  ExpectInvalid(ParseSessionHeartbeatRequest(J("{}")).status(), "session_heartbeat.session_id: required");
  ExpectInvalid(ParseGetInfoRequest(J(R"({"model_id":null})")).status(), "get_info.model_id: required");
  EXPECT_TRUE(ParseUnloadModelRequest(J(R"({"model_id":"m","type":"unload_model"})")).ok());
  ExpectInvalid(ParseWeightsInfoRequest(J(R"({"tinker_path":"tinker://a/b"})")).status(), "weights_info.tinker_path");
  auto rf = ParseRetrieveFutureRequest(J(R"({"request_id":"f1","allow_metadata_only":true})"));
  ASSERT_TRUE(rf.ok());
  EXPECT_TRUE(rf->allow_metadata_only);
  ExpectInvalid(ParseRetrieveFutureRequest(J(R"({"request_id":"f1","allow_metadata_only":"yes"})")).status(),
                "retrieve_future.allow_metadata_only: expected true or false");
  ExpectInvalid(ParseCreateSamplingSessionRequest(J(R"({"session_id":"s","sampling_session_seq_id":0})")).status(),
                "create_sampling_session.model_path: required");
  ExpectInvalid(ParseCreateSamplingSessionRequest(J(R"({"session_id":"s","sampling_session_seq_id":0,"model_path":"x"})")).status(),
                "create_sampling_session.model_path: must start with tinker://");
  auto ttl = ParseCheckpointTtlRequest(J(R"({"ttl_seconds":null})"));
  ASSERT_TRUE(ttl.ok());
  EXPECT_FALSE(ttl->ttl_seconds.has_value());
  ExpectInvalid(ParseCheckpointTtlRequest(J(R"({"ttl_seconds":-5})")).status(), "checkpoint_ttl.ttl_seconds: must be >= 1");
  // Telemetry never fails on odd events (a failure makes the SDK resend forever).
  auto tel = ParseTelemetryRequest(J(R"({"events":[{"event":"SESSION_START"},7,{"x":1}],"session_id":"s"})"));
  ASSERT_TRUE(tel.ok());
  EXPECT_EQ(tel->event_kinds, (std::vector<std::string>{"SESSION_START", "", ""}));
  ExpectInvalid(ParseAssignProjectRequest(J("{}")).status(), "assign_project.project_id: required");
}

TEST(JsonBodies, EmptyBodyIsAnEmptyObjectAndGarbageIsInvalid) {
  auto e = ParseJsonObject("", "publish");
  ASSERT_TRUE(e.ok());
  EXPECT_TRUE(e->is_object() && e->empty());
  EXPECT_TRUE(ParseJsonObject("  \n", "x").ok());
  ExpectInvalid(ParseJsonObject("{\"a\":", "optim_step").status(), "optim_step: body is not valid JSON");
  ExpectInvalid(ParseJsonObject("[]", "optim_step").status(), "optim_step: body must be a JSON object");
  ExpectInvalid(ParseJsonObject("{\"a\":NaN}", "x").status(), "x: body is not valid JSON");
  ExpectInvalid(ParseJsonObject(std::string("{\"a\":\"\xff\"}"), "x").status(), "x: body is not valid JSON");
}

TEST(TinkerPaths, ExactlyThreeParts) {
  auto p = ParseTinkerPath("tinker://s:train:0/sampler_weights/final");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->training_run_id, "s:train:0");
  EXPECT_EQ(p->kind, TinkerPath::Kind::kSampler);
  EXPECT_EQ(p->checkpoint_id(), "sampler_weights/final");
  EXPECT_STREQ(p->checkpoint_type(), "sampler");
  EXPECT_EQ(p->ToString(), "tinker://s:train:0/sampler_weights/final");
  for (const char* bad : {"tinker://a/weights", "tinker://a/weights/b/c", "tinker://a/other/b", "tinker:///weights/b",
                          "tinker://a/weights/", "http://a/weights/b", "tinker://a//b", ""}) {
    EXPECT_EQ(ParseTinkerPath(bad).status().code(), Code::kInvalidArgument) << bad;
  }
  auto c = ParseCheckpointId("s:train:0", "weights/step_10");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->kind, TinkerPath::Kind::kTraining);
  EXPECT_FALSE(ParseCheckpointId("s:train:0", "weights/a/b").ok());
}

TEST(JsonAnswers, NeverNaNOrInfinity) {
  Json j = {{"a", std::nan("")}, {"b", {1.0, std::numeric_limits<double>::infinity()}}, {"c", {{"d", -INFINITY}}}};
  std::string text = DumpJson(j);
  EXPECT_EQ(text.find("NaN"), std::string::npos) << text;
  EXPECT_EQ(text.find("nan"), std::string::npos) << text;
  EXPECT_EQ(text.find("Infinity"), std::string::npos) << text;
  EXPECT_EQ(text.find("inf"), std::string::npos) << text;
  EXPECT_EQ(Json::parse(text)["a"], nullptr);
  ScrubNonFinite(j);
  EXPECT_TRUE(j["b"][1].is_null());
  EXPECT_TRUE(j["c"]["d"].is_null());
  EXPECT_EQ(j["b"][0], 1.0);
  EXPECT_TRUE(JsonNumber(NAN).is_null());
  EXPECT_EQ(JsonNumber(2.5), 2.5);
  // Optim-step metrics are Dict[str, float]: a null would fail validation, so leave them out.
  Json m = OptimStepResultJson({{{"grad_norm", NAN}, {"step", 3}}});
  EXPECT_FALSE(m["metrics"].contains("grad_norm"));
  EXPECT_EQ(m["metrics"]["step"], 3.0);
  // Invalid UTF-8 never makes DumpJson throw.
  EXPECT_NO_THROW(DumpJson(Json(std::string("bad \xff byte"))));
}

TEST(JsonAnswers, RestTypesCarryEveryRequiredKey) {
  TinkerPath path{"s:train:0", TinkerPath::Kind::kTraining, "ckpt-001"};
  Checkpoint c{path, 1735689600, 123456, false, std::nullopt};
  Json cj = CheckpointJson(c);
  EXPECT_EQ(cj["checkpoint_id"], "weights/ckpt-001");
  EXPECT_EQ(cj["checkpoint_type"], "training");
  EXPECT_EQ(cj["time"], "2025-01-01T00:00:00Z");
  EXPECT_EQ(cj["tinker_path"], "tinker://s:train:0/weights/ckpt-001");
  EXPECT_EQ(cj["size_bytes"], 123456);
  EXPECT_EQ(cj["public"], false);
  EXPECT_FALSE(cj.contains("expires_at"));
  TrainingRun r;
  r.training_run_id = "s:train:0";
  r.base_model = "Qwen/Qwen3-8B";
  r.model_owner = "tenant-a";
  r.last_request_time = 0;
  r.lora_rank = 8;
  r.last_checkpoint = c;
  Json runs = TrainingRunsJson({{r}, Cursor{0, 20, 1}});
  for (const char* k : {"training_run_id", "base_model", "model_owner", "is_lora", "last_request_time", "corrupted"})
    EXPECT_TRUE(runs["training_runs"][0].contains(k)) << k;
  EXPECT_EQ(runs["training_runs"][0]["last_request_time"], "1970-01-01T00:00:00Z");
  EXPECT_EQ(runs["cursor"]["total_count"], 1);
  EXPECT_TRUE(CheckpointsListJson({{c}, std::nullopt})["cursor"].is_null());
  EXPECT_EQ(CheckpointsListJson({{}, Cursor{0, 100, 0}})["checkpoints"].size(), 0u);
  EXPECT_EQ(FormatIsoTime(1786160123), "2026-08-08T03:35:23Z");
}

TEST(JsonAnswers, FutureStatesMatchTheSdkClassifier) {
  Json t = TryAgainJson("f1", QueueState::kPausedCapacity, "busy");
  EXPECT_EQ(t["type"], "try_again");
  EXPECT_EQ(t["queue_state"], "paused_capacity");
  EXPECT_EQ(t["queue_state_reason"], "busy");
  EXPECT_FALSE(TryAgainJson("f1").contains("queue_state_reason"));
  Json m = CompleteMetadataJson(135);
  EXPECT_EQ(m["status"], "complete_metadata");
  EXPECT_EQ(m["response_payload_size"], 135);
  Json e = FutureErrorJson(Status::Invalid("data[0]: bad"));
  EXPECT_EQ(e["error"], "data[0]: bad");
  EXPECT_EQ(e["category"], "user");
  EXPECT_EQ(FutureErrorJson(Status::Internal(""))["category"], "server");
  EXPECT_FALSE(FutureErrorJson(Status::Internal(""))["error"].get<std::string>().empty());
  // Success results must not look like any other state.
  for (const Json& ok : {CreateModelResultJson({"m"}), SaveWeightsResultJson({{"m", TinkerPath::Kind::kTraining, "a"}}),
                         LoadWeightsResultJson({{"m", TinkerPath::Kind::kTraining, "a"}, "m2"}),
                         SaveWeightsForSamplerResultJson({std::nullopt, std::string("s:sample:1")}),
                         OptimStepResultJson({}), UnloadModelResultJson({"m"})}) {
    EXPECT_FALSE(ok.contains("error")) << ok;
    EXPECT_NE(ok.value("type", ""), "try_again") << ok;
    EXPECT_FALSE(ok.contains("status")) << ok;
  }
  EXPECT_EQ(SaveWeightsResultJson({{"m", TinkerPath::Kind::kTraining, "a"}})["path"], "tinker://m/weights/a");
  Json u = UntypedFutureJson("f9", std::nullopt, {"a", "b"});
  EXPECT_EQ(u["request_id"], "f9");
  EXPECT_FALSE(u.contains("model_id"));
  EXPECT_EQ(u["sample_sequence_ids"].size(), 2u);
}

TEST(JsonAnswers, DirectAnswers) {
  Json cfg = ClientConfigJson();
  EXPECT_EQ(cfg["pjwt_auth_enabled"], false);
  EXPECT_EQ(cfg["proto_compress_fwdbwd"], false);
  EXPECT_EQ(ClientConfigJson(true)["proto_compress_fwdbwd"], true);
  EXPECT_EQ(TelemetryAcceptedJson()["status"], "accepted");
  EXPECT_EQ(HealthzJson()["status"], "ok");
  Json info = GetInfoJson({"m", {"qwen3", "Qwen/Qwen3-8B", "Qwen/Qwen3-8B"}, 8});
  EXPECT_EQ(info["model_data"]["model_name"], "Qwen/Qwen3-8B");
  EXPECT_EQ(info["lora_rank"], 8);
  EXPECT_EQ(info["type"], "get_info");
  tinker::LoraConfig lc;
  lc.rank = 4;
  lc.train_unembed = false;
  Json wi = WeightsInfoJson({"b", lc});
  EXPECT_EQ(wi["lora_rank"], 4);
  EXPECT_EQ(wi["is_lora"], true);
  EXPECT_EQ(wi["train_unembed"], false);
  EXPECT_FALSE(GetSamplerJson({"s:sample:0", "b", std::nullopt}).contains("model_path"));
  EXPECT_EQ(ServerCapabilitiesJson({{"tiny", 2048}})["supported_models"][0]["max_context_length"], 2048);
}

TEST(PageParams, DefaultsAndBounds) {
  auto p = ParsePageParams("", "", 20);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->limit, 20);
  EXPECT_EQ(p->offset, 0);
  p = ParsePageParams("100", "40");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->limit, 100);
  EXPECT_EQ(p->offset, 40);
  ExpectInvalid(ParsePageParams("0", "").status(), "limit: must be in");
  ExpectInvalid(ParsePageParams("ten", "").status(), "limit: expected an integer");
  ExpectInvalid(ParsePageParams("", "-1").status(), "offset: must be in");
}

TEST(ErrorBodies, NeverEmptyAndNameTheField) {
  Json e = ErrorJson(Status::Invalid("optim_step.adam_params.learning_rate: expected a number"));
  EXPECT_EQ(e["category"], "user");
  EXPECT_EQ(e["code"], "invalid_argument");
  EXPECT_EQ(e["field"], "optim_step.adam_params.learning_rate");
  EXPECT_EQ(ErrorJson(Status::Invalid("data[1].loss_fn_inputs[weights]: bad"))["field"], "data[1].loss_fn_inputs[weights]");
  EXPECT_FALSE(ErrorJson(Status::NotFound("model 'x' not found: gone"))
                   .contains("field"));  // a sentence, not a field path
  Json s = ErrorJson(Status::Internal(""));
  EXPECT_EQ(s["category"], "server");
  EXPECT_EQ(s["error"], "internal");
  std::string body = ErrorBody(Status(Code::kPayloadTooLarge, "too big"));
  EXPECT_FALSE(body.empty());
  EXPECT_EQ(Json::parse(body)["code"], "payload_too_large");
  EXPECT_EQ(Json::parse(body)["error"], "too big");
}

}  // namespace
}  // namespace loom::wire
