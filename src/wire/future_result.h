// The encodings of a finished future's result (spec §6, §8.10-8.12): the
// JSON answer of each control operation; forward_backward and asample results
// as protobuf for SDKs that accept it, else in the legacy JSON shapes that
// SDKs before 0.25 read.
//
// Pure functions; any thread may call them.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "tinker/results.h"
#include "tinker/types.h"
#include "wire/sample.h"

namespace loom::wire {

// True for the results that have a protobuf form (forward_backward, asample).
bool HasProtobufForm(const tinker::FutureResult& result);
// ForwardBackwardOutput or SampleResponse bytes; kInternal when the result
// cannot be encoded (see EncodeForwardBackwardOutput, EncodeSampleResponse)
// or has no protobuf form.
Result<std::string> FutureResultProtobuf(const tinker::FutureResult& result);
// The JSON answer: a control result's `type`d object, or the legacy shapes.
nlohmann::json FutureResultJson(const tinker::FutureResult& result);

// ForwardBackwardOutput as pre-0.25 SDKs read it from JSON (spec §8.12).
nlohmann::json LegacyForwardBackwardJson(const tinker::ForwardBackwardOutput& out);
// SampleResponse as SDKs <= 0.24 read it from JSON (spec §8.12).
nlohmann::json LegacySampleResponseJson(const SampleResult& result);

}  // namespace loom::wire
