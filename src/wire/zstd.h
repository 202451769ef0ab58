// Zstandard decoding of request bodies (the SDK's `Content-Encoding: zstd`
// on forward_backward), with a hard cap on the decoded size so that a small
// compressed body cannot expand into gigabytes (a "zstd bomb").
//
// Pure functions; any thread may call them.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

#include "common/status.h"

namespace loom::wire {

// Decodes one or more concatenated zstd frames. Errors: kPayloadTooLarge when
// the decoded bytes would exceed max_output_bytes; kInvalidArgument for
// corrupt or truncated input (the message starts with "zstd:").
Result<std::string> ZstdDecompress(std::string_view compressed, size_t max_output_bytes);

// Encodes one frame (level 3). For tests and for clients written in C++.
std::string ZstdCompress(std::string_view raw, int level = 3);

}  // namespace loom::wire
