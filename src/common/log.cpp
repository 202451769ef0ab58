#include "common/log.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace loom::log {
namespace {
std::mutex g_mu;
Level g_level = Level::kInfo;
const char* Name(Level l) {
  switch (l) {
    case Level::kDebug: return "debug";
    case Level::kInfo: return "info";
    case Level::kWarn: return "warn";
    case Level::kError: return "error";
  }
  return "?";
}
}  // namespace

void SetLevel(Level level) { g_level = level; }

void Write(Level level, const std::string& line) {
  if (level < g_level) return;
  auto now = std::chrono::system_clock::now();
  auto t = std::chrono::system_clock::to_time_t(now);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char ts[32];
  std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "%s.%03lldZ %s %s\n", ts, static_cast<long long>(ms), Name(level), line.c_str());
}

}  // namespace loom::log
