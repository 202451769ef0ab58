// POSIX ustar writer for checkpoint archives; see archive.h.
#include "store/archive.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>

namespace loom::store {

namespace fs = std::filesystem;

namespace {

constexpr size_t kBlock = 512;
constexpr const char* kCompleteMarker = "checkpoint_complete";

struct Entry {
  std::string name;     // path inside the archive ('/'-separated; dirs end in '/')
  fs::path source;      // empty for the synthesised marker and the prefix dir
  int64_t size = 0;     // bytes of content (0 for dirs)
  bool directory = false;
};

// Writes `value` as zero-padded octal into field[0, width-1) plus a NUL.
void PutOctal(char* field, size_t width, uint64_t value) {
  std::snprintf(field, width, "%0*llo", static_cast<int>(width - 1),
                static_cast<unsigned long long>(value));
}

// Splits `name` into ustar's prefix (<= 155) and name (<= 100) fields.
bool SplitName(const std::string& name, std::string* prefix, std::string* rest) {
  if (name.size() <= 100) {
    prefix->clear();
    *rest = name;
    return true;
  }
  // The split must be at a '/', leaving a non-empty name part.
  const std::string trimmed = name.back() == '/' ? name.substr(0, name.size() - 1) : name;
  for (size_t pos = trimmed.find('/'); pos != std::string::npos; pos = trimmed.find('/', pos + 1)) {
    if (pos <= 155 && name.size() - pos - 1 <= 100) {
      *prefix = name.substr(0, pos);
      *rest = name.substr(pos + 1);
      return true;
    }
  }
  return false;
}

Status AppendHeader(std::string& out, const Entry& e, int64_t mtime) {
  std::string prefix, rest;
  if (!SplitName(e.name, &prefix, &rest)) {
    return Status::Invalid("archive: path too long for ustar: " + e.name);
  }
  char h[kBlock];
  std::memset(h, 0, sizeof h);
  std::memcpy(h, rest.data(), rest.size());
  PutOctal(h + 100, 8, e.directory ? 0755 : 0644);
  PutOctal(h + 108, 8, 0);                       // uid
  PutOctal(h + 116, 8, 0);                       // gid
  PutOctal(h + 124, 12, static_cast<uint64_t>(e.size));
  PutOctal(h + 136, 12, static_cast<uint64_t>(mtime));
  h[156] = e.directory ? '5' : '0';
  std::memcpy(h + 257, "ustar", 6);              // magic incl. NUL
  std::memcpy(h + 263, "00", 2);                 // version
  PutOctal(h + 329, 8, 0);                       // devmajor
  PutOctal(h + 337, 8, 0);                       // devminor
  std::memcpy(h + 345, prefix.data(), prefix.size());
  std::memset(h + 148, ' ', 8);                  // checksum is computed over spaces
  unsigned sum = 0;
  for (unsigned char c : h) sum += c;
  std::snprintf(h + 148, 8, "%06o", sum);        // 6 digits, NUL, then the space left
  h[155] = ' ';
  out.append(h, sizeof h);
  return Status::Ok();
}

}  // namespace

Result<std::string> TarDirectory(const std::string& dir, const TarOptions& options) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return Status::NotFound("archive: no directory " + dir);
  std::string prefix = options.prefix;
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  if (prefix.find("..") != std::string::npos || (!prefix.empty() && prefix.front() == '/')) {
    return Status::Invalid("archive prefix: must be a relative path without \"..\"");
  }
  const std::string base = prefix.empty() ? "" : prefix + "/";

  std::vector<Entry> entries;
  bool has_marker = false;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it); it.increment(ec)) {
    const fs::file_status st = it->symlink_status(ec);
    if (ec) break;
    const std::string rel = it->path().lexically_relative(dir).generic_string();
    Entry e;
    e.source = it->path();
    if (fs::is_directory(st)) {
      e.name = base + rel + "/";
      e.directory = true;
    } else if (fs::is_regular_file(st)) {
      e.name = base + rel;
      e.size = static_cast<int64_t>(it->file_size(ec));
      if (rel == kCompleteMarker) has_marker = true;
    } else {
      return Status::Invalid("archive: " + rel + " is not a regular file or folder");
    }
    entries.push_back(std::move(e));
  }
  if (ec) return Status::Internal("archive: cannot read " + dir + ": " + ec.message());
  if (!has_marker) entries.push_back(Entry{base + kCompleteMarker, {}, 0, false});
  if (!prefix.empty()) entries.push_back(Entry{base, {}, 0, true});
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.name < b.name; });

  int64_t total = 2 * kBlock;
  for (const Entry& e : entries) {
    if (e.size >= (int64_t{1} << 33)) return Status::Invalid("archive: " + e.name + " is over 8 GiB");
    total += kBlock + (e.size + kBlock - 1) / kBlock * kBlock;
  }
  if (total > options.max_bytes) {
    return Status(Code::kPayloadTooLarge, "archive: " + std::to_string(total) +
                                              " bytes exceeds the limit of " +
                                              std::to_string(options.max_bytes));
  }

  std::string out;
  out.reserve(static_cast<size_t>(total));
  for (const Entry& e : entries) {
    if (Status s = AppendHeader(out, e, options.mtime); !s.ok()) return s;
    if (e.directory || e.size == 0) continue;
    std::ifstream in(e.source, std::ios::binary);
    const size_t start = out.size();
    out.resize(start + static_cast<size_t>(e.size));
    if (!in.read(out.data() + start, e.size)) {
      return Status::Internal("archive: cannot read " + e.source.string() + " (changed while archiving?)");
    }
    out.resize(start + (static_cast<size_t>(e.size) + kBlock - 1) / kBlock * kBlock, '\0');
  }
  out.append(2 * kBlock, '\0');
  return out;
}

}  // namespace loom::store
