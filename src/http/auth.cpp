#include "http/auth.h"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace loom::http {

Result<ApiKeys> ApiKeys::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::Invalid("--api-keys: cannot read '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return Parse(ss.str());
}

Result<ApiKeys> ApiKeys::Parse(const std::string& text) {
  ApiKeys keys;
  keys.open_ = false;
  std::istringstream lines(text);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    ++n;
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string key, tenant, extra;
    if (!(words >> key)) continue;  // blank
    if (!(words >> tenant) || (words >> extra)) {
      return Status::Invalid("--api-keys line " + std::to_string(n) + ": expected 'key tenant'");
    }
    if (keys.tenants_.count(key)) {
      return Status::Invalid("--api-keys line " + std::to_string(n) + ": key listed twice");
    }
    keys.tenants_[key] = tenant;
  }
  if (keys.tenants_.empty()) return Status::Invalid("--api-keys: the file lists no keys");
  return keys;
}

Result<std::string> ApiKeys::Authenticate(const std::string& api_key) const {
  if (api_key.empty()) return Status(Code::kUnauthenticated, "X-API-Key: header is missing");
  if (open_) {
    if (api_key.rfind("tml-", 0) != 0 || api_key.size() < 5 || api_key.size() > 512) {
      return Status(Code::kUnauthenticated, "X-API-Key: must start with 'tml-' (open mode, no --api-keys)");
    }
    // The tenant is a digest of the key, so logs and listings never show it.
    uint64_t h = 1469598103934665603ull;  // FNV-1a 64
    for (unsigned char c : api_key) h = (h ^ c) * 1099511628211ull;
    char buf[32];
    std::snprintf(buf, sizeof buf, "user-%016llx", static_cast<unsigned long long>(h));
    return std::string(buf);
  }
  auto it = tenants_.find(api_key);
  if (it == tenants_.end()) return Status(Code::kUnauthenticated, "X-API-Key: unknown key");
  return it->second;
}

bool IsLoopbackHost(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host == "[::1]" ||
         host.rfind("127.", 0) == 0;
}

Status ApiKeys::AllowedOn(const std::string& host) const {
  if (!open_ || IsLoopbackHost(host)) return Status::Ok();
  return Status::Invalid("--host " + host +
                         ": without --api-keys any 'tml-' key is accepted, which is only allowed on a loopback "
                         "address; pass --api-keys FILE or bind 127.0.0.1");
}

}  // namespace loom::http
