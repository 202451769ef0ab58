// The internal API between a gateway and its sampler replicas (`loom serve
// --role sampler`): JSON bodies for a SampleCall, the replica's SamplerInfo
// and SamplerStats; a finished sample travels as Tinker's protobuf
// SampleResponse (wire/sample.h), the bytes the SDK already gets.
//
//   GET  /replica/v1/info      SamplerInfo (+ "model_dir")
//   GET  /replica/v1/health    {"stats": SamplerStats, "in_flight": n}
//   POST /replica/v1/sample    SampleCall -> {"request_id": id}; 4xx: refused
//   POST /replica/v1/retrieve  {"request_id"} -> SampleResponse bytes, an
//                              error body, or {"type":"try_again"} after the hold
//   POST /replica/v1/cancel    {"session", "message"} -> {}
//
// With a replica key (--replica-key) every call carries it in
// X-Replica-Key; without one the replica takes calls only on loopback.
//
// Pure functions; any thread may call them.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "engine/sample_api.h"

namespace loom::replica {

inline constexpr const char* kKeyHeader = "x-replica-key";

nlohmann::json SampleCallJson(const engine::SampleCall& call);
// Invalid naming the field on a malformed body.
Result<engine::SampleCall> ParseSampleCall(const nlohmann::json& body);

nlohmann::json SamplerInfoJson(const engine::SamplerInfo& info);
Result<engine::SamplerInfo> ParseSamplerInfo(const nlohmann::json& body);

nlohmann::json SamplerStatsJson(const engine::SamplerStats& stats);
engine::SamplerStats ParseSamplerStats(const nlohmann::json& body);  // missing fields stay 0
// a + b, field by field (the replicas' sum, as the gateway reports it).
engine::SamplerStats AddStats(engine::SamplerStats a, const engine::SamplerStats& b);

}  // namespace loom::replica
