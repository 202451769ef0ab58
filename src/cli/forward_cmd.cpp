#include <cstdio>

#include "cli/commands.h"

namespace loom::cli {
int Forward(int, char**) {
  std::fprintf(stderr, "loom: 'forward' is not implemented yet\n");
  return 2;
}
}  // namespace loom::cli
