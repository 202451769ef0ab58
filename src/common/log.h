// Structured one-line logs ("event key=value ..."). Thread-safe. Kept out of
// spdlog's heavy header so that every file can include it.
#pragma once
#include <fmt/format.h>

#include <string>

namespace loom::log {

enum class Level { kDebug, kInfo, kWarn, kError };
void Write(Level level, const std::string& line);
void SetLevel(Level level);

template <typename... Args>
void Info(fmt::format_string<Args...> f, Args&&... args) { Write(Level::kInfo, fmt::format(f, std::forward<Args>(args)...)); }
template <typename... Args>
void Warn(fmt::format_string<Args...> f, Args&&... args) { Write(Level::kWarn, fmt::format(f, std::forward<Args>(args)...)); }
template <typename... Args>
void Error(fmt::format_string<Args...> f, Args&&... args) { Write(Level::kError, fmt::format(f, std::forward<Args>(args)...)); }
template <typename... Args>
void Debug(fmt::format_string<Args...> f, Args&&... args) { Write(Level::kDebug, fmt::format(f, std::forward<Args>(args)...)); }

}  // namespace loom::log
