#include <cstdio>

#include "cli/commands.h"

namespace loom::cli {
int Bench(int, char**) {
  std::fprintf(stderr, "loom: 'bench' is not implemented yet\n");
  return 2;
}
}  // namespace loom::cli
