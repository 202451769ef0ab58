// Helpers shared by the wire tests: base64 / hex decoding, file reading and
// the location of the SDK captures ($LOOM_SOURCE_DIR/../shared/spec/captures).
#pragma once
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace loom::wire::testing {

inline std::string Base64Decode(const std::string& in) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  int bits = 0, acc = 0;
  for (char c : in) {
    int v = val(c);
    if (v < 0) continue;  // '=' padding, whitespace
    acc = (acc << 6) | v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return out;
}

inline std::string HexDecode(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

inline std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Empty when the captures are not beside the repository.
inline std::filesystem::path CapturesDir() {
  const char* src = std::getenv("LOOM_SOURCE_DIR");
  std::filesystem::path base = src ? src : LOOM_SOURCE_DIR;
  std::filesystem::path dir = base / ".." / "shared" / "spec" / "captures";
  return std::filesystem::is_directory(dir) ? dir : std::filesystem::path();
}

// Every NNN_*.json capture file, sorted.
inline std::vector<std::filesystem::path> CaptureFiles() {
  std::vector<std::filesystem::path> out;
  auto dir = CapturesDir();
  if (dir.empty()) return out;
  for (auto& sub : std::filesystem::directory_iterator(dir)) {
    if (!sub.is_directory()) continue;
    for (auto& f : std::filesystem::directory_iterator(sub.path())) {
      auto name = f.path().filename().string();
      if (f.path().extension() == ".json" && !name.empty() && name[0] >= '0' && name[0] <= '9') out.push_back(f.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace loom::wire::testing
