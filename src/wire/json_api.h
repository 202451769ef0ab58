// Tinker's JSON control plane (spec §5, §8.8): one request struct and parser
// per JSON endpoint, and builders for every JSON answer. Parsing is lenient
// where the SDK is (unknown fields ignored, ints accepted for floats, absent
// optional fields = std::nullopt) and strict where it matters: a wrong type or
// a missing required field is kInvalidArgument naming the field, e.g.
// "optim_step.adam_params.learning_rate: expected a number". Range checks that
// need no state are done here too (rank >= 1, every AdamParams field in its
// range, ttl_seconds at most 100 years, training seq_ids within int32).
//
// The request and result types are Tinker's (tinker/); this file is their
// JSON form. Builders return nlohmann::json; send it with DumpJson(), which
// never emits NaN/Infinity and never throws on bad UTF-8.
//
// Pure functions; any thread may call them.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "tinker/path.h"
#include "tinker/requests.h"
#include "tinker/results.h"

namespace loom::wire {

using Json = nlohmann::json;

// ---------------------------------------------------------------- helpers

// Deepest nesting of objects and arrays a JSON body may have (the body object
// is level 1). Real SDK bodies stay under 10; what recurses on a tree (dump(),
// copies, comparisons) then runs on a bounded depth.
inline constexpr int kMaxJsonDepth = 64;

// Parses a body that must be a JSON object. An empty body counts as {} (the
// SDK posts publish/unpublish/delete with a JSON content type and no body).
// `endpoint` prefixes the error ("optim_step: body is not valid JSON ...",
// "create_session: body is JSON nested deeper than 64 levels"). Every
// Parse*Request below expects a tree from here (so at most kMaxJsonDepth deep).
Result<Json> ParseJsonObject(std::string_view body, std::string_view endpoint);

// A finite double as a JSON number; NaN / +-Infinity as null.
Json JsonNumber(double v);
// Replaces every non-finite number anywhere inside j by null.
void ScrubNonFinite(Json& j);
// Serialises compactly; non-finite numbers become null, invalid UTF-8 is
// replaced (never throws).
std::string DumpJson(const Json& j);

// ISO 8601 UTC with a trailing Z, seconds precision: "2026-08-08T03:35:23Z".
std::string FormatIsoTime(int64_t unix_seconds);

// --------------------------------------------------------------- requests

// Longest ttl_seconds accepted (100 years): far past any real retention, and
// created_ms + ttl x 1000 stays far from int64 overflow.
inline constexpr int64_t kMaxTtlSeconds = int64_t{100} * 365 * 24 * 3600;
// Training requests' seq_id (optim_step, save_weights, load_weights,
// save_weights_for_sampler) is at most 2^31-1, as forward_backward's int32.

struct ClientConfigRequest {            // POST /api/v1/client/config, /client/dynamic_config
  std::optional<std::string> sdk_version;
};
Result<ClientConfigRequest> ParseClientConfigRequest(const Json& body);

Result<tinker::CreateSessionRequest> ParseCreateSessionRequest(const Json& body);

struct SessionHeartbeatRequest {        // POST /api/v1/session_heartbeat
  std::string session_id;
};
Result<SessionHeartbeatRequest> ParseSessionHeartbeatRequest(const Json& body);

// Checks: model_seq_id >= 0, lora_config.rank >= 1, at least one train_* true.
Result<tinker::CreateModelRequest> ParseCreateModelRequest(const Json& body);

struct ModelIdRequest {                 // POST /api/v1/get_info, /api/v1/unload_model
  std::string model_id;
};
Result<ModelIdRequest> ParseGetInfoRequest(const Json& body);
Result<ModelIdRequest> ParseUnloadModelRequest(const Json& body);

struct WeightsInfoRequest {             // POST /api/v1/weights_info
  tinker::TinkerPath path;
};
Result<WeightsInfoRequest> ParseWeightsInfoRequest(const Json& body);

// All six AdamParams are required and finite. Ranges: learning_rate and
// weight_decay in [0, 10] with learning_rate x weight_decay <= 1 (the decoupled
// decay factor stays in [0, 1]); beta1, beta2 in [0, 1); eps in [1e-30, 1] (not
// 0 in fp32); grad_clip_norm >= 0 (0 = off).
Result<tinker::OptimStepRequest> ParseOptimStepRequest(const Json& body);

// `path` passes tinker::ValidateCheckpointName.
Result<tinker::SaveWeightsRequest> ParseSaveWeightsRequest(const Json& body);

// Mode: model_id present -> kTrainingClient (seq_id required); else
// session_id + model_seq_id -> kCreateModel; else Invalid.
Result<tinker::LoadWeightsRequest> ParseLoadWeightsRequest(const Json& body);

// One of path / sampling_session_seq_id is required (path wins if both).
Result<tinker::SaveWeightsForSamplerRequest> ParseSaveWeightsForSamplerRequest(const Json& body);

// At least one of base_model / model_path.
Result<tinker::CreateSamplingSessionRequest> ParseCreateSamplingSessionRequest(const Json& body);

struct RetrieveFutureRequest {          // POST /api/v1/retrieve_future
  std::string request_id;
  bool allow_metadata_only = false;
};
Result<RetrieveFutureRequest> ParseRetrieveFutureRequest(const Json& body);

struct TelemetryRequest {               // POST /api/v1/telemetry (only counted, never fails on events)
  std::optional<std::string> session_id;
  std::optional<std::string> sdk_version;
  std::optional<std::string> platform;
  std::optional<std::string> process_uuid;
  std::vector<std::string> event_kinds; // events[i].event, "" when absent
};
Result<TelemetryRequest> ParseTelemetryRequest(const Json& body);

struct CheckpointTtlRequest {           // PUT .../checkpoints/{id}/ttl
  std::optional<int64_t> ttl_seconds;   // nullopt = remove expiry; else in [1, kMaxTtlSeconds]
};
Result<CheckpointTtlRequest> ParseCheckpointTtlRequest(const Json& body);

struct AssignProjectRequest {           // PUT /api/v1/sessions/{id}/project
  std::string project_id;
};
Result<AssignProjectRequest> ParseAssignProjectRequest(const Json& body);

// ------------------------------------------------------- REST types (§8.8)

Json CheckpointJson(const tinker::Checkpoint& c);
Json TrainingRunJson(const tinker::TrainingRun& r);
Json CursorJson(const tinker::Cursor& c);
Json CheckpointsListJson(const tinker::CheckpointsPage& page);
Json TrainingRunsJson(const tinker::TrainingRunsPage& page);
Json CheckpointArchiveUrlJson(const std::string& url, int64_t expires_unix);
Json SessionsListJson(const tinker::SessionsPage& page);
Json SessionJson(const tinker::SessionInfo& session);
// loom's GET /api/v1/usage (docs/usage.md): one tenant's figures, or
// {"tenants": [...]} for the admin key.
Json UsageJson(const tinker::TenantUsage& usage);
Json UsageListJson(const std::vector<tinker::TenantUsage>& usage);

// Limit/offset query parameters with the SDK's defaults; bad values -> Invalid.
// limit in [1, 10000], offset >= 0; `limit_text` / `offset_text` empty = default.
Result<tinker::PageParams> ParsePageParams(std::string_view limit_text, std::string_view offset_text, int64_t default_limit = 20);

// --------------------------------------------------- direct answers (§5)

// {} plus the flags of the spec's recommendation: no JWT, no pyqwest, no zstd
// (unless allow_zstd), no create-via-load, no batch polling.
Json ClientConfigJson(bool allow_zstd = false);
Json DynamicConfigJson(int refresh_interval_sec = 300);
Json HealthzJson();                                         // {"status":"ok"}
struct SupportedModel {
  std::string model_name;
  int64_t max_context_length = 0;
};
Json ServerCapabilitiesJson(const std::vector<SupportedModel>& models);
Json CreateSessionJson(const std::string& session_id);
Json SessionHeartbeatJson();
Json TelemetryAcceptedJson();                               // {"status":"accepted"}

Json GetInfoJson(const tinker::GetInfoResult& info);
Json WeightsInfoJson(const tinker::WeightsInfoResult& info);
Json GetSamplerJson(const tinker::SamplingSessionInfo& sampler);
Json CreateSamplingSessionJson(const std::string& sampling_session_id);

// ------------------------------------------------ futures (§5.21, §6)

// Submit answer: {"request_id", "model_id"?, "sample_sequence_ids"?}.
Json UntypedFutureJson(const std::string& request_id, const std::optional<std::string>& model_id = std::nullopt,
                       const std::vector<std::string>& sample_sequence_ids = {});

enum class QueueState { kActive, kPausedCapacity, kPausedRateLimit };
// {"type":"try_again","request_id","queue_state","queue_state_reason"?}
Json TryAgainJson(const std::string& request_id, QueueState state = QueueState::kActive,
                  const std::string& reason = "");
// {"status":"complete_metadata","response_payload_size"}
Json CompleteMetadataJson(int64_t response_payload_size);
// {"error": msg, "category": "user"|"server"}: a failed future (answered 200).
Json FutureErrorJson(const Status& status);

// Future results (JSON). Each carries the `type` literal the SDK accepts.
// (wire/future_result.h encodes any FutureResult, forward_backward and
// asample included.)
Json CreateModelResultJson(const tinker::CreateModelResult& r);
Json UnloadModelResultJson(const tinker::UnloadModelResult& r);
Json OptimStepResultJson(const tinker::OptimStepResult& r);
Json SaveWeightsResultJson(const tinker::SaveWeightsResult& r);
Json LoadWeightsResultJson(const tinker::LoadWeightsResult& r);
Json SaveWeightsForSamplerResultJson(const tinker::SaveWeightsForSamplerResult& r);

}  // namespace loom::wire
