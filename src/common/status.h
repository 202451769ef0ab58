// Status: the result of an operation that can fail, passed across module
// borders instead of exceptions (LevelDB style). The code maps onto an HTTP
// status in http/, and onto a Tinker error category ("user" / "server").
#pragma once
#include <string>
#include <utility>

namespace loom {

enum class Code {
  kOk = 0,
  kInvalidArgument,    // the caller's input is wrong: 400, category "user"
  kNotFound,           // unknown or foreign id: 404
  kAlreadyExists,      // name collision: 409 (answered as 400 on the wire, see http/)
  kResourceExhausted,  // no free slot, KV budget full: retryable, 429
  kFailedPrecondition, // e.g. the model's lease expired: 400/410
  kUnauthenticated,    // 401
  kPayloadTooLarge,    // 413
  kInternal,           // a bug or a device failure: 500, category "server"
  kUnavailable,        // shutting down: 503
};

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  static Status Invalid(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
  static Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
  static Status Exists(std::string m) { return {Code::kAlreadyExists, std::move(m)}; }
  static Status Exhausted(std::string m) { return {Code::kResourceExhausted, std::move(m)}; }
  static Status Precondition(std::string m) { return {Code::kFailedPrecondition, std::move(m)}; }
  static Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }
  static Status Unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "user" when the caller can fix it, "server" otherwise (Tinker's categories).
  const char* category() const {
    return (code_ == Code::kInternal || code_ == Code::kUnavailable) ? "server" : "user";
  }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// A value or the reason there is none.
template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}  // NOLINT
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() { return value_; }
  const T& value() const { return value_; }
  T* operator->() { return &value_; }
  T& operator*() { return value_; }

 private:
  Status status_;
  T value_{};
};

}  // namespace loom
