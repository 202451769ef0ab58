#include <cstdio>

#include "cli/commands.h"

namespace loom::cli {
int Serve(int, char**) {
  std::fprintf(stderr, "loom: 'serve' is not implemented yet\n");
  return 2;
}
}  // namespace loom::cli
