// Cat / JoinInts: building error messages without fmt. The engine's
// translation units see libtorch's include directory, and the PyTorch wheel
// ships its own (newer) fmt headers there, which then disagree with the
// system libfmt at link time on the GPU machine; iostreams have no such
// problem. Pure functions; any thread.
#pragma once
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace loom::engine::train {

// Streams every argument in order: Cat("data[", 3, "]") == "data[3]". Bools print as true/false.
template <typename... Args>
std::string Cat(const Args&... args) {
  std::ostringstream out;
  out << std::boolalpha;
  (out << ... << args);
  return out.str();
}

// "2, 3, 4"
inline std::string JoinInts(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out;
}

}  // namespace loom::engine::train
