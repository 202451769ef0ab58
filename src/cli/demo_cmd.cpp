#include <cstdio>

#include "cli/commands.h"

namespace loom::cli {
int Demo(int, char**) {
  std::fprintf(stderr, "loom: 'demo' is not implemented yet\n");
  return 2;
}
}  // namespace loom::cli
