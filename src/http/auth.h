// ApiKeys: who a request's X-API-Key belongs to.
//
// With a keys file (`--api-keys FILE`, lines "key tenant", '#' comments),
// only listed keys are accepted. Without one ("open mode"), any key of the
// SDK's shape (starting "tml-") is accepted and is its own tenant; that mode
// is only allowed on a loopback address (AllowedOn()).
//
// Immutable after construction; any thread may read it.
#pragma once
#include <map>
#include <string>

#include "common/status.h"

namespace loom::http {

class ApiKeys {
 public:
  ApiKeys() = default;  // open mode
  // Parses the file; a malformed line is Invalid naming the line number.
  static Result<ApiKeys> Load(const std::string& path);
  static Result<ApiKeys> Parse(const std::string& text);

  bool open_mode() const { return open_; }
  // The tenant for a key; Unauthenticated (with a message saying why) if none.
  Result<std::string> Authenticate(const std::string& api_key) const;
  // Open mode is refused on non-loopback hosts.
  Status AllowedOn(const std::string& host) const;

 private:
  bool open_ = true;
  std::map<std::string, std::string> tenants_;  // key -> tenant
};

bool IsLoopbackHost(const std::string& host);

}  // namespace loom::http
