#include <cstdio>

#include "cli/commands.h"

namespace loom::cli {
int MakeModel(int, char**) {
  std::fprintf(stderr, "loom: 'make_model' is not implemented yet\n");
  return 2;
}
}  // namespace loom::cli
