// file_text: the small text helpers io/'s readers share: a whole file as a
// string, and a tensor shape as it appears in their error messages.
// Pure functions; any thread.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace loom::engine {

// The file's bytes; NotFound "cannot read <path>" when it cannot be opened.
Result<std::string> ReadTextFile(const std::string& path);

// {2, 3} -> "[2, 3]".
std::string ShapeText(const std::vector<int64_t>& shape);

}  // namespace loom::engine
