// TempDir: a fresh directory under the system temp folder for one test,
// removed with everything in it when the object goes away. Header-only, shared
// by every test layer.
#pragma once
#include <stdlib.h>

#include <filesystem>
#include <string>

namespace loom::test {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "loom-test") {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    path_ = ::mkdtemp(pattern.data());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (std::filesystem::path(path_) / name).string(); }

 private:
  std::string path_;
};

}  // namespace loom::test
