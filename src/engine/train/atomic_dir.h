// PublishDirectory: makes a directory appear complete or not at all. The
// contents are written into a fresh sibling "<dir>.tmp-XXXXXX", every file
// there is fsynced, the temp directory is renamed onto dir, and the parent is
// fsynced. A crash leaves either no dir or a complete one (plus, at worst, a
// stray temp directory). An existing dir is never replaced: AlreadyExists.
// Torch-free; any thread.
#pragma once
#include <functional>
#include <string>

#include "common/status.h"

namespace loom::engine::train {

// fill(tmp_dir) writes the files; its error aborts and removes the temp dir.
Status PublishDirectory(const std::string& dir, const std::function<Status(const std::string& tmp_dir)>& fill);

}  // namespace loom::engine::train
