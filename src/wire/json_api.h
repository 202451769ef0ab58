// Tinker's JSON control plane (spec §5, §8.8): one request struct and parser
// per JSON endpoint, and builders for every JSON answer. Parsing is lenient
// where the SDK is (unknown fields ignored, ints accepted for floats, absent
// optional fields = std::nullopt) and strict where it matters: a wrong type or
// a missing required field is kInvalidArgument naming the field, e.g.
// "optim_step.adam_params.learning_rate: expected a number". Range checks that
// need no state are done here too (rank >= 1, every AdamParams field in its
// range, ttl_seconds at most 100 years, training seq_ids within int32).
//
// Builders return nlohmann::json; send it with DumpJson(), which never emits
// NaN/Infinity and never throws on bad UTF-8.
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
#include "engine/api.h"

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

// ------------------------------------------------------------ tinker paths

// `tinker://<training_run_id>/<weights|sampler_weights>/<name>` (spec §7.2).
struct TinkerPath {
  enum class Kind { kTraining, kSampler };  // "weights" / "sampler_weights"
  std::string training_run_id;              // = model_id
  Kind kind = Kind::kTraining;
  std::string name;

  std::string ToString() const;             // the tinker:// URI
  std::string checkpoint_id() const;        // "weights/<name>" or "sampler_weights/<name>"
  const char* checkpoint_type() const;      // "training" or "sampler"
  const char* kind_segment() const;         // "weights" or "sampler_weights"
};
// Exactly three non-empty parts after "tinker://", kind in {weights,
// sampler_weights}; otherwise kInvalidArgument ("tinker_path: ...").
Result<TinkerPath> ParseTinkerPath(std::string_view uri);
// A checkpoint id as it appears in REST routes ("weights/step_10").
Result<TinkerPath> ParseCheckpointId(std::string_view training_run_id, std::string_view checkpoint_id);
// A checkpoint name chosen by the user (path in save_weights): non-empty, at
// most 256 bytes, no '/', not "." or "..", no control characters.
Status ValidateCheckpointName(std::string_view name, std::string_view field);

// --------------------------------------------------------------- requests

// Longest ttl_seconds accepted (100 years): far past any real retention, and
// created_ms + ttl x 1000 stays far from int64 overflow.
inline constexpr int64_t kMaxTtlSeconds = int64_t{100} * 365 * 24 * 3600;
// Training requests' seq_id (optim_step, save_weights, load_weights,
// save_weights_for_sampler) is at most 2^31-1, as forward_backward's int32.

using UserMetadata = std::map<std::string, std::string>;  // non-string values kept as JSON text

struct ClientConfigRequest {            // POST /api/v1/client/config, /client/dynamic_config
  std::optional<std::string> sdk_version;
};
Result<ClientConfigRequest> ParseClientConfigRequest(const Json& body);

struct CreateSessionRequest {           // POST /api/v1/create_session
  std::vector<std::string> tags;
  UserMetadata user_metadata;
  std::optional<std::string> sdk_version;
  std::optional<std::string> project_id;
};
Result<CreateSessionRequest> ParseCreateSessionRequest(const Json& body);

struct SessionHeartbeatRequest {        // POST /api/v1/session_heartbeat
  std::string session_id;
};
Result<SessionHeartbeatRequest> ParseSessionHeartbeatRequest(const Json& body);

struct CreateModelRequest {             // POST /api/v1/create_model
  std::string session_id;
  int64_t model_seq_id = 0;
  std::string base_model;
  UserMetadata user_metadata;
  engine::LoraConfig lora;              // rank, seed, train_*; alpha left at the engine default
  bool seed_given = false;              // lora_config.seed present (else the service picks one)
};
// Checks: model_seq_id >= 0, lora_config.rank >= 1, at least one train_* true.
Result<CreateModelRequest> ParseCreateModelRequest(const Json& body);

struct ModelIdRequest {                 // POST /api/v1/get_info, /api/v1/unload_model
  std::string model_id;
};
Result<ModelIdRequest> ParseGetInfoRequest(const Json& body);
Result<ModelIdRequest> ParseUnloadModelRequest(const Json& body);

struct WeightsInfoRequest {             // POST /api/v1/weights_info
  TinkerPath path;
};
Result<WeightsInfoRequest> ParseWeightsInfoRequest(const Json& body);

struct OptimStepRequest {               // POST /api/v1/optim_step
  std::string model_id;
  int64_t seq_id = 0;
  engine::AdamParams adam_params;
};
// All six AdamParams are required and finite. Ranges: learning_rate and
// weight_decay in [0, 10] with learning_rate x weight_decay <= 1 (the decoupled
// decay factor stays in [0, 1]); beta1, beta2 in [0, 1); eps in [1e-30, 1] (not
// 0 in fp32); grad_clip_norm >= 0 (0 = off).
Result<OptimStepRequest> ParseOptimStepRequest(const Json& body);

struct SaveWeightsRequest {             // POST /api/v1/save_weights (save_state)
  std::string model_id;
  int64_t seq_id = 0;
  std::optional<std::string> name;      // `path`: a checkpoint name, not a URI
  std::optional<int64_t> ttl_seconds;   // absent = never expires; in [1, kMaxTtlSeconds]
  bool overwrite = false;
};
Result<SaveWeightsRequest> ParseSaveWeightsRequest(const Json& body);

struct LoadWeightsRequest {             // POST /api/v1/load_weights
  enum class Mode { kTrainingClient, kCreateModel };
  Mode mode = Mode::kTrainingClient;
  // kTrainingClient: model_id + seq_id.
  std::string model_id;
  int64_t seq_id = 0;
  // kCreateModel (create_model_via_load_weights): session_id + model_seq_id.
  std::string session_id;
  int64_t model_seq_id = 0;
  std::optional<std::string> base_model;
  UserMetadata user_metadata;
  // Both modes.
  TinkerPath path;                      // must be a /weights/ checkpoint
  bool optimizer = false;
  std::optional<std::string> weights_access_token;
};
// Mode: model_id present -> kTrainingClient (seq_id required); else
// session_id + model_seq_id -> kCreateModel; else Invalid.
Result<LoadWeightsRequest> ParseLoadWeightsRequest(const Json& body);

struct SaveWeightsForSamplerRequest {   // POST /api/v1/save_weights_for_sampler
  std::string model_id;
  int64_t seq_id = 0;
  std::optional<std::string> name;                  // named: `path`
  std::optional<int64_t> ttl_seconds;
  std::optional<int64_t> sampling_session_seq_id;   // unnamed: the server makes a sampler
  bool named() const { return name.has_value(); }
};
// One of path / sampling_session_seq_id is required (path wins if both).
Result<SaveWeightsForSamplerRequest> ParseSaveWeightsForSamplerRequest(const Json& body);

struct CreateSamplingSessionRequest {   // POST /api/v1/create_sampling_session
  std::string session_id;
  int64_t sampling_session_seq_id = 0;
  std::optional<std::string> base_model;
  std::optional<std::string> model_path;  // starts with tinker:// (not parsed further)
};
// At least one of base_model / model_path.
Result<CreateSamplingSessionRequest> ParseCreateSamplingSessionRequest(const Json& body);

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

struct Cursor {
  int64_t offset = 0;
  int64_t limit = 0;
  int64_t total_count = 0;
};

struct Checkpoint {
  TinkerPath path;                      // gives checkpoint_id, checkpoint_type, tinker_path
  int64_t time = 0;                     // unix seconds
  std::optional<int64_t> size_bytes;
  bool is_public = false;
  std::optional<int64_t> expires_at;    // unix seconds
};

struct TrainingRun {
  std::string training_run_id;
  std::string base_model;
  std::string model_owner;
  bool is_lora = true;
  int64_t last_request_time = 0;        // unix seconds
  bool corrupted = false;
  std::optional<int64_t> lora_rank;
  std::optional<Checkpoint> last_checkpoint;
  std::optional<Checkpoint> last_sampler_checkpoint;
  UserMetadata user_metadata;
};

Json CheckpointJson(const Checkpoint& c);
Json TrainingRunJson(const TrainingRun& r);
Json CursorJson(const Cursor& c);
Json CheckpointsListJson(const std::vector<Checkpoint>& checkpoints, const std::optional<Cursor>& cursor);
Json TrainingRunsJson(const std::vector<TrainingRun>& runs, const Cursor& cursor);
Json CheckpointArchiveUrlJson(const std::string& url, int64_t expires_unix);
Json SessionsListJson(const std::vector<std::string>& session_ids);
Json SessionJson(const std::vector<std::string>& training_run_ids, const std::vector<std::string>& sampler_ids);

// Limit/offset query parameters with the SDK's defaults; bad values -> Invalid.
struct PageParams {
  int64_t limit = 20;
  int64_t offset = 0;
};
// limit in [1, 10000], offset >= 0; `limit_text` / `offset_text` empty = default.
Result<PageParams> ParsePageParams(std::string_view limit_text, std::string_view offset_text, int64_t default_limit = 20);

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

struct ModelData {
  std::string arch;                     // e.g. "qwen3"
  std::string model_name;               // HF repo id the tokenizer loads from
  std::string tokenizer_id;
};
Json GetInfoJson(const std::string& model_id, const ModelData& data, std::optional<int64_t> lora_rank);
Json WeightsInfoJson(const std::string& base_model, const engine::LoraConfig& lora);
Json GetSamplerJson(const std::string& sampler_id, const std::string& base_model,
                    const std::optional<std::string>& model_path);
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
Json CreateModelResultJson(const std::string& model_id);
Json UnloadModelResultJson(const std::string& model_id);
Json OptimStepResultJson(const std::map<std::string, double>& metrics);
Json SaveWeightsResultJson(const TinkerPath& path);
Json LoadWeightsResultJson(const TinkerPath& path, const std::string& model_id);
Json SaveWeightsForSamplerResultJson(const std::optional<TinkerPath>& path,
                                     const std::optional<std::string>& sampling_session_id);

}  // namespace loom::wire
