// Small helpers of the service layer: wall-clock time and random ids.
// Any thread.
#pragma once
#include <cstdint>
#include <string>

namespace loom::service {

int64_t NowMs();                 // unix epoch milliseconds
std::string RandomHex(int bytes);  // 2*bytes lowercase hex digits from a CSPRNG-seeded generator
std::string RandomUuid();        // 8-4-4-4-12 hex, version-4 shaped
uint64_t RandomU64();

}  // namespace loom::service
