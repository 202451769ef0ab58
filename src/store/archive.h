// TarDirectory: packs one checkpoint directory into a POSIX ustar archive held
// in memory, for the REST `archive` endpoint. Pure function of the files; any
// thread (it only reads the directory).
//
// The archive is deterministic: entries sorted by path, mtime/uid/gid fixed,
// modes 0644 (files) / 0755 (dirs), no owner names. It always contains an empty
// `checkpoint_complete` file (added when the directory lacks one), which
// Tinker's CLI requires next to adapter_config.json and
// adapter_model.safetensors.
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"

namespace loom::store {

struct TarOptions {
  // Folder name that every entry is placed under ("" = archive root).
  std::string prefix;
  // The archive may not exceed this many bytes (PayloadTooLarge otherwise).
  int64_t max_bytes = int64_t{8} << 30;
  int64_t mtime = 0;  // seconds since epoch, written into every header
};

// Regular files and subdirectories are archived recursively; symlinks and
// other special files are refused (Invalid). A path longer than ustar allows
// (100-byte name + 155-byte prefix) is Invalid.
Result<std::string> TarDirectory(const std::string& dir, const TarOptions& options = {});

}  // namespace loom::store
