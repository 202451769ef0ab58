#include "wire/errors.h"

namespace loom::wire {

const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid_argument";
    case Code::kNotFound: return "not_found";
    case Code::kAlreadyExists: return "already_exists";
    case Code::kResourceExhausted: return "resource_exhausted";
    case Code::kFailedPrecondition: return "failed_precondition";
    case Code::kUnauthenticated: return "unauthenticated";
    case Code::kPayloadTooLarge: return "payload_too_large";
    case Code::kInternal: return "internal";
    case Code::kUnavailable: return "unavailable";
  }
  return "unknown";
}

std::string FieldOfMessage(std::string_view message) {
  size_t colon = message.find(": ");
  if (colon == std::string_view::npos || colon == 0) return "";
  std::string_view head = message.substr(0, colon);
  if (head.find_first_of(" \t'\"") != std::string_view::npos) return "";
  if (head.find_first_of(".[") == std::string_view::npos) return "";
  return std::string(head);
}

nlohmann::json ErrorJson(const Status& status) {
  std::string msg = status.message();
  if (msg.empty()) msg = status.ok() ? "error" : CodeName(status.code());
  nlohmann::json j = {{"error", msg}, {"category", status.category()}, {"code", CodeName(status.code())}};
  std::string field = FieldOfMessage(msg);
  if (!field.empty()) j["field"] = field;
  return j;
}

std::string ErrorBody(const Status& status) {
  return ErrorJson(status).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace loom::wire
