// Directory names of training runs; see dir_names.h.
#include "store/dir_names.h"

#include <cstdio>

namespace loom::store {

std::string SanitizeForPath(const std::string& model_id) {
  std::string out;
  for (unsigned char c : model_id) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-') {
      out += static_cast<char>(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof buf, "_%02X", c);
      out += buf;
    }
  }
  return out;
}

}  // namespace loom::store
