// Require: a fuzz target's check of what a decoder's header promises. A failed
// check prints the promise and aborts, which libFuzzer reports as a crash and
// keeps the input of.
#pragma once
#include <cstdio>
#include <cstdlib>

namespace loom::fuzz {

inline void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz check failed: %s\n", what);
    std::abort();
  }
}

}  // namespace loom::fuzz
