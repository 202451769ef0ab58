// Who calls the Service and what an asynchronous request answers first.
// Plain data.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace loom::service {

// Who is calling, as http/ authenticated it.
struct Caller {
  std::string tenant;
  std::string idempotency_key;  // X-Idempotency-Key, "" when absent
  std::string route;            // "<METHOD> <route under /api/v1/>", "" when not from http/
  uint64_t body_digest = 0;     // BodyDigest() of the decoded body
};

// The digest of a request body that scopes its X-Idempotency-Key (FNV-1a 64:
// it only tells one tenant's own requests apart, so it need not resist attacks).
uint64_t BodyDigest(std::string_view body);

// The answer to a submitted asynchronous request.
struct Submitted {
  std::string request_id;
  std::string model_id;
};

}  // namespace loom::service
