#include "common/durable.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

namespace loom::durable {
namespace {

namespace fs = std::filesystem;

std::string ErrnoText(int err) { return std::strerror(err); }

std::string ParentDir(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace

Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::Internal("write " + path + ": " + ErrnoText(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status Sync(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_DIRECTORY : 0) | O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Internal("open " + path + ": " + ErrnoText(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::Internal("fsync " + path + ": " + ErrnoText(err));
  return Status::Ok();
}

Result<int64_t> SyncTree(const std::string& dir) {
  std::error_code ec;
  int64_t bytes = 0;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it); it.increment(ec)) {
    const fs::file_status st = it->symlink_status(ec);
    if (ec) break;
    if (fs::is_regular_file(st)) {
      bytes += static_cast<int64_t>(it->file_size(ec));
      if (Status s = Sync(it->path().string(), false); !s.ok()) return s;
    } else if (fs::is_directory(st)) {
      if (Status s = Sync(it->path().string(), true); !s.ok()) return s;
    }
  }
  if (ec) return Status::Internal("list " + dir + ": " + ec.message());
  if (Status s = Sync(dir, true); !s.ok()) return s;
  return bytes;
}

Status WriteSynced(const std::string& path, const FillFile& fill) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::Internal("create " + path + ": " + ErrnoText(errno));
  Status s = fill(fd, path);
  if (s.ok() && ::fsync(fd) != 0) s = Status::Internal("fsync " + path + ": " + ErrnoText(errno));
  ::close(fd);
  return s;
}

Status ReplaceFile(const std::string& path, const FillFile& fill) {
  const std::string tmp = path + ".tmp";
  if (Status s = WriteSynced(tmp, fill); !s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    Status s = Status::Internal("rename " + tmp + " -> " + path + ": " + ErrnoText(errno));
    ::unlink(tmp.c_str());
    return s;
  }
  return Sync(ParentDir(path), true);
}

Status ReplaceFile(const std::string& path, const std::string& contents) {
  return ReplaceFile(path, [&](int fd, const std::string& tmp) {
    return WriteAll(fd, contents.data(), contents.size(), tmp);
  });
}

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
  if (::mkdtemp(buf.data()) == nullptr) return Status::Internal("mkdtemp " + templ + ": " + ErrnoText(errno));
  const std::string tmp(buf.data());
  auto fail = [&](Status s) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    return s;
  };
  if (Status s = fill(tmp); !s.ok()) return fail(s);
  if (Result<int64_t> synced = SyncTree(tmp); !synced.ok()) return fail(synced.status());
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    if (err == EEXIST || err == ENOTEMPTY) return fail(Status::Exists(target.string() + " already exists"));
    return fail(Status::Internal("rename " + tmp + " → " + target.string() + ": " + ErrnoText(err)));
  }
  return Sync(parent.string(), true);
}

}  // namespace loom::durable
