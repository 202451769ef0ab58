// The JSON body of every 4xx/5xx answer the gateway sends:
//   {"error": "<message>", "category": "user"|"server", "code": "<code>",
//    "field"?: "<field path>"}
// It is never empty (an empty 400 is proxy noise to the SDK and is retried),
// and the message never is either: a Status without one gets its code's name.
// `field` is the leading "a.b.c:" of a wire-layer message, when there is one.
//
// Pure functions; any thread may call them.
#pragma once
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace loom::wire {

// "invalid_argument", "not_found", ... (stable names for logs and bodies).
const char* CodeName(Code code);

nlohmann::json ErrorJson(const Status& status);
// ErrorJson(status) serialised (compact, never throws).
std::string ErrorBody(const Status& status);
// The field path a wire message starts with ("optim_step.adam_params.eps"), or "".
std::string FieldOfMessage(std::string_view message);

}  // namespace loom::wire
