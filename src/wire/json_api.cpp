#include "wire/json_api.h"

#include <charconv>
#include <cmath>
#include <ctime>
#include <limits>

#include <fmt/format.h>

#include "wire/json_fields.h"

namespace loom::wire {

namespace f = fields;

// ---------------------------------------------------------------- helpers

namespace {

// True when the text nests objects/arrays deeper than `limit` (the body
// object is level 1), counted over the raw bytes with strings skipped, so it
// stops at the first level too many and allocates nothing. Text that is not
// JSON may be miscounted; the parser refuses it anyway.
bool NestedDeeperThan(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped character cannot end the string
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > limit) return true;
    } else if (c == '}' || c == ']') {
      if (--depth < 0) return false;  // not JSON
    }
  }
  return false;
}

}  // namespace

Result<Json> ParseJsonObject(std::string_view body, std::string_view endpoint) {
  size_t i = 0;
  while (i < body.size() && (body[i] == ' ' || body[i] == '\n' || body[i] == '\r' || body[i] == '\t')) ++i;
  if (i == body.size()) return Json::object();
  // nlohmann parses iteratively, but dump(), copies and comparisons recurse:
  // bound the depth before a tree exists.
  if (NestedDeeperThan(body, kMaxJsonDepth))
    return Status::Invalid(std::string(endpoint) + ": body is JSON nested deeper than " +
                           std::to_string(kMaxJsonDepth) + " levels");
  Json j = Json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::Invalid(std::string(endpoint) + ": body is not valid JSON");
  if (!j.is_object()) return Status::Invalid(std::string(endpoint) + ": body must be a JSON object");
  return j;
}

Json JsonNumber(double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); }

void ScrubNonFinite(Json& j) {
  if (j.is_number_float()) {
    if (!std::isfinite(j.get<double>())) j = nullptr;
  } else if (j.is_structured()) {
    for (auto& e : j) ScrubNonFinite(e);
  }
}

std::string DumpJson(const Json& j) {
  // nlohmann writes non-finite floats as null; invalid UTF-8 is replaced by U+FFFD.
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string FormatIsoTime(int64_t unix_seconds) {
  std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

namespace {

constexpr std::string_view kScheme = "tinker://";

Status TinkerPathField(const Json& obj, const std::string& where, const char* key, tinker::TinkerPath* out) {
  std::string s;
  LOOM_WIRE_TRY(f::String(obj, where, key, &s));
  auto p = tinker::ParseTinkerPath(s, f::Path(where, key));
  if (!p.ok()) return p.status();
  *out = std::move(p.value());
  return Status::Ok();
}

Status NonNegative(int64_t v, const std::string& path) {
  if (v < 0) return Status::Invalid(path + ": must be >= 0, got " + std::to_string(v));
  return Status::Ok();
}

Status OptTtl(const Json& obj, const std::string& where, std::optional<int64_t>* ttl) {
  LOOM_WIRE_TRY(f::OptInt(obj, where, "ttl_seconds", ttl));
  if (*ttl && **ttl < 1)
    return Status::Invalid(f::Path(where, "ttl_seconds") + ": must be >= 1 second, got " + std::to_string(**ttl));
  if (*ttl && **ttl > kMaxTtlSeconds)
    return Status::Invalid(f::Path(where, "ttl_seconds") + ": must be <= " + std::to_string(kMaxTtlSeconds) +
                           " (100 years), got " + std::to_string(**ttl));
  return Status::Ok();
}

// A training request's seq_id: forward_backward carries it as an int32, so one
// TrainingClient never numbers past 2^31-1, and nothing downstream can overflow.
Status TrainingSeqId(const Json& obj, const std::string& where, int64_t* seq_id) {
  LOOM_WIRE_TRY(f::Int(obj, where, "seq_id", seq_id));
  if (*seq_id > std::numeric_limits<int32_t>::max())
    return Status::Invalid(f::Path(where, "seq_id") + ": must be <= 2147483647 (forward_backward carries it as int32), "
                           "got " + std::to_string(*seq_id));
  return Status::Ok();
}

// A double in shortest round-trip form ("1e-12", "1e+300", "10").
std::string Num(double v) { return fmt::format("{}", v); }

Status OptCheckpointName(const Json& obj, const std::string& where, std::optional<std::string>* name) {
  LOOM_WIRE_TRY(f::OptString(obj, where, "path", name));
  if (*name) LOOM_WIRE_TRY(tinker::ValidateCheckpointName(**name, f::Path(where, "path")));
  return Status::Ok();
}

}  // namespace

// --------------------------------------------------------------- requests

Result<ClientConfigRequest> ParseClientConfigRequest(const Json& body) {
  const std::string w = "client_config";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  ClientConfigRequest r;
  LOOM_WIRE_TRY(f::OptString(body, w, "sdk_version", &r.sdk_version));
  return r;
}

Result<tinker::CreateSessionRequest> ParseCreateSessionRequest(const Json& body) {
  const std::string w = "create_session";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  tinker::CreateSessionRequest r;
  LOOM_WIRE_TRY(f::OptStringList(body, w, "tags", &r.tags));
  LOOM_WIRE_TRY(f::OptStringMap(body, w, "user_metadata", &r.user_metadata));
  LOOM_WIRE_TRY(f::OptString(body, w, "sdk_version", &r.sdk_version));
  LOOM_WIRE_TRY(f::OptString(body, w, "project_id", &r.project_id));
  return r;
}

Result<SessionHeartbeatRequest> ParseSessionHeartbeatRequest(const Json& body) {
  const std::string w = "session_heartbeat";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  SessionHeartbeatRequest r;
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "session_id", &r.session_id));
  return r;
}

Result<tinker::CreateModelRequest> ParseCreateModelRequest(const Json& body) {
  const std::string w = "create_model";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  tinker::CreateModelRequest r;
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "session_id", &r.session_id));
  LOOM_WIRE_TRY(f::Int(body, w, "model_seq_id", &r.model_seq_id));
  LOOM_WIRE_TRY(NonNegative(r.model_seq_id, f::Path(w, "model_seq_id")));
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "base_model", &r.base_model));
  LOOM_WIRE_TRY(f::OptStringMap(body, w, "user_metadata", &r.user_metadata));
  if (const Json* lc = f::Find(body, "lora_config")) {
    const std::string lw = w + ".lora_config";
    LOOM_WIRE_TRY(f::RequireObject(*lc, lw));
    std::optional<int64_t> rank;
    LOOM_WIRE_TRY(f::OptInt(*lc, lw, "rank", &rank));
    if (rank) {
      if (*rank < 1 || *rank > 65536)
        return Status::Invalid(lw + ".rank: must be in [1, 65536], got " + std::to_string(*rank));
      r.lora.rank = static_cast<int>(*rank);
    }
    std::optional<uint64_t> seed;
    LOOM_WIRE_TRY(f::OptAnyU64(*lc, lw, "seed", &seed));
    r.seed_given = seed.has_value();
    if (seed) r.lora.seed = *seed;
    LOOM_WIRE_TRY(f::Bool(*lc, lw, "train_unembed", &r.lora.train_unembed));
    LOOM_WIRE_TRY(f::Bool(*lc, lw, "train_mlp", &r.lora.train_mlp));
    LOOM_WIRE_TRY(f::Bool(*lc, lw, "train_attn", &r.lora.train_attn));
    if (!r.lora.train_unembed && !r.lora.train_mlp && !r.lora.train_attn)
      return Status::Invalid(lw + ": at least one of train_attn, train_mlp, train_unembed must be true");
  }
  return r;
}

static Result<ModelIdRequest> ParseModelIdRequest(const Json& body, const std::string& w) {
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  ModelIdRequest r;
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "model_id", &r.model_id));
  return r;
}
Result<ModelIdRequest> ParseGetInfoRequest(const Json& body) { return ParseModelIdRequest(body, "get_info"); }
Result<ModelIdRequest> ParseUnloadModelRequest(const Json& body) { return ParseModelIdRequest(body, "unload_model"); }

Result<WeightsInfoRequest> ParseWeightsInfoRequest(const Json& body) {
  const std::string w = "weights_info";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  WeightsInfoRequest r;
  LOOM_WIRE_TRY(TinkerPathField(body, w, "tinker_path", &r.path));
  return r;
}

Result<tinker::OptimStepRequest> ParseOptimStepRequest(const Json& body) {
  const std::string w = "optim_step";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  tinker::OptimStepRequest r;
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "model_id", &r.model_id));
  LOOM_WIRE_TRY(TrainingSeqId(body, w, &r.seq_id));
  const Json* ap = f::Find(body, "adam_params");
  const std::string aw = w + ".adam_params";
  if (!ap) return Status::Invalid(aw + ": required field is missing");
  LOOM_WIRE_TRY(f::RequireObject(*ap, aw));
  tinker::AdamParams& p = r.adam_params;
  // Ranges wide enough for any real run (the SDK's defaults are 1e-4, 0.9,
  // 0.95, 1e-12, 0, 0) and narrow enough that one step stays finite in fp32.
  struct Field {
    const char* key;
    double* out;
    double lo, hi;
    bool hi_open;  // [lo, hi) instead of [lo, hi]
  };
  const Field fields_[] = {
      {"learning_rate", &p.learning_rate, 0.0, 10.0, false},
      {"beta1", &p.beta1, 0.0, 1.0, true},
      {"beta2", &p.beta2, 0.0, 1.0, true},
      {"eps", &p.eps, 1e-30, 1.0, false},  // a smaller eps is 0 in fp32, and 0/0 on untouched rows
      {"weight_decay", &p.weight_decay, 0.0, 10.0, false},
      {"grad_clip_norm", &p.grad_clip_norm, 0.0, std::numeric_limits<double>::infinity(), false},  // 0 = off
  };
  for (const Field& fd : fields_) {
    LOOM_WIRE_TRY(f::Double(*ap, aw, fd.key, fd.out));
    const double v = *fd.out;
    if (!std::isfinite(v)) return Status::Invalid(f::Path(aw, fd.key) + ": must be finite");
    if (v >= fd.lo && (fd.hi_open ? v < fd.hi : v <= fd.hi)) continue;
    const std::string range = fd.hi_open                 ? "in [" + Num(fd.lo) + ", " + Num(fd.hi) + ")"
                              : std::isinf(fd.hi)        ? ">= " + Num(fd.lo)
                                                         : ">= " + Num(fd.lo) + " and <= " + Num(fd.hi);
    return Status::Invalid(f::Path(aw, fd.key) + ": must be " + range + ", got " + Num(v));
  }
  // Decoupled decay multiplies the weights by 1 - lr x wd each step: past 1 it
  // flips their sign and grows them until they overflow.
  if (p.learning_rate * p.weight_decay > 1.0)
    return Status::Invalid(f::Path(aw, "weight_decay") + ": learning_rate x weight_decay must be <= 1, got " +
                           Num(p.learning_rate * p.weight_decay));
  return r;
}

Result<tinker::SaveWeightsRequest> ParseSaveWeightsRequest(const Json& body) {
  const std::string w = "save_weights";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  tinker::SaveWeightsRequest r;
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "model_id", &r.model_id));
  LOOM_WIRE_TRY(TrainingSeqId(body, w, &r.seq_id));
  LOOM_WIRE_TRY(OptCheckpointName(body, w, &r.name));
  LOOM_WIRE_TRY(OptTtl(body, w, &r.ttl_seconds));
  LOOM_WIRE_TRY(f::Bool(body, w, "overwrite", &r.overwrite));
  return r;
}

Result<tinker::LoadWeightsRequest> ParseLoadWeightsRequest(const Json& body) {
  const std::string w = "load_weights";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  tinker::LoadWeightsRequest r;
  if (f::Find(body, "model_id")) {
    r.mode = tinker::LoadWeightsRequest::Mode::kTrainingClient;
    LOOM_WIRE_TRY(f::NonEmptyString(body, w, "model_id", &r.model_id));
    LOOM_WIRE_TRY(TrainingSeqId(body, w, &r.seq_id));
  } else if (f::Find(body, "session_id")) {
    r.mode = tinker::LoadWeightsRequest::Mode::kCreateModel;
    LOOM_WIRE_TRY(f::NonEmptyString(body, w, "session_id", &r.session_id));
    LOOM_WIRE_TRY(f::Int(body, w, "model_seq_id", &r.model_seq_id));
    LOOM_WIRE_TRY(NonNegative(r.model_seq_id, f::Path(w, "model_seq_id")));
    LOOM_WIRE_TRY(f::OptString(body, w, "base_model", &r.base_model));
    LOOM_WIRE_TRY(f::OptStringMap(body, w, "user_metadata", &r.user_metadata));
  } else {
    return Status::Invalid(w + ".model_id: required field is missing (or session_id + model_seq_id)");
  }
  LOOM_WIRE_TRY(TinkerPathField(body, w, "path", &r.path));
  if (r.path.kind != tinker::TinkerPath::Kind::kTraining)
    return Status::Invalid(w + ".path: must name a training checkpoint (tinker://<run>/weights/<name>), got '" +
                           r.path.ToString() + "'");
  LOOM_WIRE_TRY(f::Bool(body, w, "optimizer", &r.optimizer));
  LOOM_WIRE_TRY(f::OptString(body, w, "weights_access_token", &r.weights_access_token));
  return r;
}

Result<tinker::SaveWeightsForSamplerRequest> ParseSaveWeightsForSamplerRequest(const Json& body) {
  const std::string w = "save_weights_for_sampler";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  tinker::SaveWeightsForSamplerRequest r;
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "model_id", &r.model_id));
  LOOM_WIRE_TRY(TrainingSeqId(body, w, &r.seq_id));
  LOOM_WIRE_TRY(OptCheckpointName(body, w, &r.name));
  LOOM_WIRE_TRY(OptTtl(body, w, &r.ttl_seconds));
  LOOM_WIRE_TRY(f::OptInt(body, w, "sampling_session_seq_id", &r.sampling_session_seq_id));
  if (r.sampling_session_seq_id)
    LOOM_WIRE_TRY(NonNegative(*r.sampling_session_seq_id, f::Path(w, "sampling_session_seq_id")));
  if (!r.name && !r.sampling_session_seq_id)
    return Status::Invalid(w + ".path: required field is missing (or sampling_session_seq_id for an unnamed save)");
  return r;
}

Result<tinker::CreateSamplingSessionRequest> ParseCreateSamplingSessionRequest(const Json& body) {
  const std::string w = "create_sampling_session";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  tinker::CreateSamplingSessionRequest r;
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "session_id", &r.session_id));
  LOOM_WIRE_TRY(f::Int(body, w, "sampling_session_seq_id", &r.sampling_session_seq_id));
  LOOM_WIRE_TRY(NonNegative(r.sampling_session_seq_id, f::Path(w, "sampling_session_seq_id")));
  LOOM_WIRE_TRY(f::OptString(body, w, "base_model", &r.base_model));
  LOOM_WIRE_TRY(f::OptString(body, w, "model_path", &r.model_path));
  if (r.model_path && r.model_path->rfind(std::string(kScheme), 0) != 0)
    return Status::Invalid(w + ".model_path: must start with tinker://");
  if (!r.base_model && !r.model_path)
    return Status::Invalid(w + ".model_path: required field is missing (or base_model)");
  return r;
}

Result<RetrieveFutureRequest> ParseRetrieveFutureRequest(const Json& body) {
  const std::string w = "retrieve_future";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  RetrieveFutureRequest r;
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "request_id", &r.request_id));
  LOOM_WIRE_TRY(f::Bool(body, w, "allow_metadata_only", &r.allow_metadata_only));
  return r;
}

Result<TelemetryRequest> ParseTelemetryRequest(const Json& body) {
  const std::string w = "telemetry";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  TelemetryRequest r;
  // Lenient on purpose: a rejected batch is re-sent by the SDK every second forever.
  auto str = [&](const char* key, std::optional<std::string>* out) {
    const Json* v = f::Find(body, key);
    if (v && v->is_string()) *out = v->get<std::string>();
  };
  str("session_id", &r.session_id);
  str("sdk_version", &r.sdk_version);
  str("platform", &r.platform);
  str("process_uuid", &r.process_uuid);
  if (const Json* ev = f::Find(body, "events"); ev && ev->is_array()) {
    for (const Json& e : *ev) {
      const Json* kind = e.is_object() ? f::Find(e, "event") : nullptr;
      r.event_kinds.push_back(kind && kind->is_string() ? kind->get<std::string>() : "");
    }
  }
  return r;
}

Result<CheckpointTtlRequest> ParseCheckpointTtlRequest(const Json& body) {
  const std::string w = "checkpoint_ttl";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  CheckpointTtlRequest r;
  LOOM_WIRE_TRY(OptTtl(body, w, &r.ttl_seconds));
  return r;
}

Result<AssignProjectRequest> ParseAssignProjectRequest(const Json& body) {
  const std::string w = "assign_project";
  LOOM_WIRE_TRY(f::RequireObject(body, w));
  AssignProjectRequest r;
  LOOM_WIRE_TRY(f::NonEmptyString(body, w, "project_id", &r.project_id));
  return r;
}

// ------------------------------------------------------- REST types (§8.8)

Json CursorJson(const tinker::Cursor& c) {
  return {{"offset", c.offset}, {"limit", c.limit}, {"total_count", c.total_count}};
}

Json CheckpointJson(const tinker::Checkpoint& c) {
  Json j = {{"checkpoint_id", c.path.checkpoint_id()},
            {"checkpoint_type", c.path.checkpoint_type()},
            {"time", FormatIsoTime(c.time)},
            {"tinker_path", c.path.ToString()},
            {"public", c.is_public}};
  if (c.size_bytes) j["size_bytes"] = *c.size_bytes;
  if (c.expires_at) j["expires_at"] = FormatIsoTime(*c.expires_at);
  return j;
}

Json TrainingRunJson(const tinker::TrainingRun& r) {
  Json j = {{"training_run_id", r.training_run_id},
            {"base_model", r.base_model},
            {"model_owner", r.model_owner},
            {"is_lora", r.is_lora},
            {"last_request_time", FormatIsoTime(r.last_request_time)},
            {"corrupted", r.corrupted}};
  if (r.lora_rank) j["lora_rank"] = *r.lora_rank;
  if (r.last_checkpoint) j["last_checkpoint"] = CheckpointJson(*r.last_checkpoint);
  if (r.last_sampler_checkpoint) j["last_sampler_checkpoint"] = CheckpointJson(*r.last_sampler_checkpoint);
  if (!r.user_metadata.empty()) j["user_metadata"] = r.user_metadata;
  return j;
}

Json CheckpointsListJson(const tinker::CheckpointsPage& page) {
  Json list = Json::array();
  for (const auto& c : page.checkpoints) list.push_back(CheckpointJson(c));
  return {{"checkpoints", std::move(list)}, {"cursor", page.cursor ? CursorJson(*page.cursor) : Json(nullptr)}};
}

Json TrainingRunsJson(const tinker::TrainingRunsPage& page) {
  Json list = Json::array();
  for (const auto& r : page.runs) list.push_back(TrainingRunJson(r));
  return {{"training_runs", std::move(list)}, {"cursor", CursorJson(page.cursor)}};
}

Json CheckpointArchiveUrlJson(const std::string& url, int64_t expires_unix) {
  return {{"url", url}, {"expires", FormatIsoTime(expires_unix)}};
}

Json SessionsListJson(const tinker::SessionsPage& page) { return {{"sessions", page.session_ids}}; }

Json SessionJson(const tinker::SessionInfo& session) {
  return {{"training_run_ids", session.training_run_ids}, {"sampler_ids", session.sampler_ids}};
}

Json UsageJson(const tinker::TenantUsage& u) {
  return {{"tenant", u.tenant},
          {"since", FormatIsoTime(u.since_ms / 1000)},
          {"tokens_trained", u.tokens_trained},
          {"tokens_forward", u.tokens_forward},
          {"tokens_sampled", u.tokens_sampled},
          {"prompt_tokens", u.prompt_tokens},
          {"prompt_tokens_cached", u.prompt_tokens_cached},
          {"passes", u.passes},
          {"slot_seconds", u.slot_seconds},
          {"live_models", u.live_models},
          {"waiting_models", u.waiting_models},
          {"checkpoints", u.checkpoints},
          {"bytes_stored", u.bytes_stored}};
}

Json UsageListJson(const std::vector<tinker::TenantUsage>& usage) {
  Json tenants = Json::array();
  for (const tinker::TenantUsage& u : usage) tenants.push_back(UsageJson(u));
  return {{"tenants", std::move(tenants)}};
}

Result<tinker::PageParams> ParsePageParams(std::string_view limit_text, std::string_view offset_text, int64_t default_limit) {
  tinker::PageParams p;
  p.limit = default_limit;
  auto parse = [](std::string_view s, const char* name, int64_t lo, int64_t hi, int64_t* out) -> Status {
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || ptr != s.data() + s.size())
      return Status::Invalid(std::string(name) + ": expected an integer, got '" + std::string(s.substr(0, 40)) + "'");
    if (v < lo || v > hi)
      return Status::Invalid(std::string(name) + ": must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                             "], got " + std::to_string(v));
    *out = v;
    return Status::Ok();
  };
  if (!limit_text.empty()) LOOM_WIRE_TRY(parse(limit_text, "limit", 1, 10000, &p.limit));
  if (!offset_text.empty())
    LOOM_WIRE_TRY(parse(offset_text, "offset", 0, std::numeric_limits<int64_t>::max(), &p.offset));
  return p;
}

// --------------------------------------------------- direct answers (§5)

Json ClientConfigJson(bool allow_zstd) {
  return {{"pjwt_auth_enabled", false},
          {"use_pyqwest_transport", false},
          {"proto_compress_fwdbwd", allow_zstd},
          {"create_model_via_load_weights", false},
          {"sample_use_retrieve_futures", false}};
}

Json DynamicConfigJson(int refresh_interval_sec) { return {{"refresh_interval_sec", refresh_interval_sec}}; }
Json HealthzJson() { return {{"status", "ok"}}; }

Json ServerCapabilitiesJson(const std::vector<SupportedModel>& models) {
  Json list = Json::array();
  for (const auto& m : models) list.push_back({{"model_name", m.model_name}, {"max_context_length", m.max_context_length}});
  return {{"supported_models", std::move(list)}};
}

Json CreateSessionJson(const std::string& session_id) {
  return {{"type", "create_session"}, {"session_id", session_id}};
}
Json SessionHeartbeatJson() { return {{"type", "session_heartbeat"}}; }
Json TelemetryAcceptedJson() { return {{"status", "accepted"}}; }

Json GetInfoJson(const tinker::GetInfoResult& info) {
  const tinker::ModelData& data = info.model_data;
  const std::optional<int64_t>& lora_rank = info.lora_rank;
  Json j = {{"type", "get_info"},
            {"model_id", info.model_id},
            {"model_data", {{"arch", data.arch}, {"model_name", data.model_name}, {"tokenizer_id", data.tokenizer_id}}},
            {"is_lora", lora_rank.has_value()},
            {"model_name", data.model_name}};
  if (lora_rank) j["lora_rank"] = *lora_rank;
  return j;
}

Json WeightsInfoJson(const tinker::WeightsInfoResult& info) {
  const tinker::LoraConfig& lora = info.lora;
  return {{"base_model", info.base_model},     {"is_lora", true},
          {"lora_rank", lora.rank},       {"train_unembed", lora.train_unembed},
          {"train_mlp", lora.train_mlp},  {"train_attn", lora.train_attn}};
}

Json GetSamplerJson(const tinker::SamplingSessionInfo& sampler) {
  Json j = {{"sampler_id", sampler.sampler_id}, {"base_model", sampler.base_model}};
  if (sampler.model_path) j["model_path"] = sampler.model_path->ToString();
  return j;
}

Json CreateSamplingSessionJson(const std::string& sampling_session_id) {
  return {{"type", "create_sampling_session"}, {"sampling_session_id", sampling_session_id}};
}

// ------------------------------------------------ futures (§5.21, §6)

Json UntypedFutureJson(const std::string& request_id, const std::optional<std::string>& model_id,
                       const std::vector<std::string>& sample_sequence_ids) {
  Json j = {{"request_id", request_id}};
  if (model_id) j["model_id"] = *model_id;
  if (!sample_sequence_ids.empty()) j["sample_sequence_ids"] = sample_sequence_ids;
  return j;
}

Json TryAgainJson(const std::string& request_id, QueueState state, const std::string& reason) {
  const char* s = state == QueueState::kActive           ? "active"
                  : state == QueueState::kPausedCapacity ? "paused_capacity"
                                                         : "paused_rate_limit";
  Json j = {{"type", "try_again"}, {"request_id", request_id}, {"queue_state", s}};
  if (!reason.empty()) j["queue_state_reason"] = reason;
  return j;
}

Json CompleteMetadataJson(int64_t response_payload_size) {
  return {{"status", "complete_metadata"}, {"response_payload_size", response_payload_size}};
}

Json FutureErrorJson(const Status& status) {
  std::string msg = status.message();
  if (msg.empty()) msg = status.ok() ? "unknown error" : "request failed";
  return {{"error", msg}, {"category", status.ok() ? "unknown" : status.category()}};
}

Json CreateModelResultJson(const tinker::CreateModelResult& r) {
  return {{"type", "create_model"}, {"model_id", r.model_id}};
}
Json UnloadModelResultJson(const tinker::UnloadModelResult& r) {
  return {{"type", "unload_model"}, {"model_id", r.model_id}};
}

Json OptimStepResultJson(const tinker::OptimStepResult& r) {
  const std::map<std::string, double>& metrics = r.metrics;
  // metrics is Dict[str, float] in the SDK: a null would fail validation, so
  // non-finite values are left out.
  Json m = Json::object();
  for (const auto& [k, v] : metrics)
    if (std::isfinite(v)) m[k] = v;
  return {{"metrics", std::move(m)}};
}

Json SaveWeightsResultJson(const tinker::SaveWeightsResult& r) {
  return {{"type", "save_weights"}, {"path", r.path.ToString()}};
}

Json LoadWeightsResultJson(const tinker::LoadWeightsResult& r) {
  return {{"type", "load_weights"}, {"path", r.path.ToString()}, {"model_id", r.model_id}};
}

Json SaveWeightsForSamplerResultJson(const tinker::SaveWeightsForSamplerResult& r) {
  Json j = {{"type", "save_weights_for_sampler"}};
  if (r.path) j["path"] = r.path->ToString();
  if (r.sampling_session_id) j["sampling_session_id"] = *r.sampling_session_id;
  return j;
}

}  // namespace loom::wire
