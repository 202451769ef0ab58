#include "wire/proto_log.h"

#include <google/protobuf/stubs/common.h>

#include <atomic>
#include <mutex>
#include <string>

#include "common/log.h"

#if GOOGLE_PROTOBUF_VERSION < 4022000
#include <google/protobuf/stubs/logging.h>
#endif

namespace loom::wire {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<uint64_t> dropped_total{0};
std::mutex mu;
Clock::duration interval{std::chrono::seconds(60)};
Clock::time_point next_pass{};  // [mu] the next line at or after this passes
uint64_t dropped_since_pass = 0;  // [mu]

#if GOOGLE_PROTOBUF_VERSION < 4022000
void Handle(google::protobuf::LogLevel level, const char* filename, int line, const std::string& message) {
  const auto now = Clock::now();
  uint64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (now < next_pass) {
      ++dropped_since_pass;
      dropped_total.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    next_pass = now + interval;
    dropped = dropped_since_pass;
    dropped_since_pass = 0;
  }
  const bool bad = level >= google::protobuf::LOGLEVEL_ERROR;
  const std::string text = fmt::format("protobuf {}:{}: {} ({} similar lines dropped before this one)", filename,
                                       line, message, dropped);
  if (bad) log::Warn("{}", text);
  else log::Info("{}", text);
}
#endif

}  // namespace

void LimitProtobufLogs(std::chrono::seconds every) {
  {
    std::lock_guard<std::mutex> lock(mu);
    interval = every;
    next_pass = Clock::time_point{};
  }
#if GOOGLE_PROTOBUF_VERSION < 4022000
  google::protobuf::SetLogHandler(&Handle);
#endif
}

uint64_t DroppedProtobufLogs() { return dropped_total.load(std::memory_order_relaxed); }

}  // namespace loom::wire
