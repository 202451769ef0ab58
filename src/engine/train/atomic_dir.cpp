#include "engine/train/atomic_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

namespace loom::engine::train {
namespace {

namespace fs = std::filesystem;

Status SyncPath(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_DIRECTORY : 0) | O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Internal("open " + path + ": " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::Internal("fsync " + path + ": " + std::strerror(err));
  return Status::Ok();
}

}  // namespace

Status PublishDirectory(const std::string& dir, const std::function<Status(const std::string& tmp_dir)>& fill) {
  std::error_code ec;
  fs::path target = fs::path(dir);
  if (target.has_filename() == false) target = target.parent_path();  // "a/b/" → "a/b"
  if (fs::exists(target, ec)) return Status::Exists(target.string() + " already exists");
  const fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  fs::create_directories(parent, ec);
  if (ec) return Status::Internal("create " + parent.string() + ": " + ec.message());
  std::string templ = target.string() + ".tmp-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) return Status::Internal("mkdtemp " + templ + ": " + std::strerror(errno));
  const std::string tmp(buf.data());
  auto fail = [&](Status s) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    return s;
  };
  Status s = fill(tmp);
  if (!s.ok()) return fail(s);
  // Flush every regular file, then the directory's own entries.
  for (const auto& entry : fs::recursive_directory_iterator(tmp, ec)) {
    if (entry.is_regular_file()) {
      if (Status st = SyncPath(entry.path().string(), false); !st.ok()) return fail(st);
    } else if (entry.is_directory()) {
      if (Status st = SyncPath(entry.path().string(), true); !st.ok()) return fail(st);
    }
  }
  if (ec) return fail(Status::Internal("list " + tmp + ": " + ec.message()));
  if (Status st = SyncPath(tmp, true); !st.ok()) return fail(st);
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    if (err == EEXIST || err == ENOTEMPTY) return fail(Status::Exists(target.string() + " already exists"));
    return fail(Status::Internal("rename " + tmp + " → " + target.string() + ": " + std::strerror(err)));
  }
  return SyncPath(parent.string(), true);
}

}  // namespace loom::engine::train
