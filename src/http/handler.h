// What HttpServer serves: one parsed request in, one answer out. Router (the
// Tinker API) is one handler; a sampler replica's internal API
// (replica/replica_handler.h) is another. Both park pending futures the same
// way: Handle() names the future, the server waits for it without a thread,
// then asks AnswerPoll().
//
// Thread-safe: any I/O or decode-pool thread may call any method concurrently.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace loom::http {

struct HttpRequest {
  std::string method;                          // "GET", "POST", ...
  std::string target;                          // path + "?" + query, as received
  std::map<std::string, std::string> headers;  // names lower-cased; a repeated one keeps its last value
  std::vector<std::string> repeated_headers;   // lower-cased names that came more than once
  std::string body;

  std::string header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? std::string() : it->second;
  }
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers
};

struct RouteOutcome {
  HttpResponse response;
  // Non-empty: a pending future. Wait for it (up to the poll hold, in the
  // server's FutureTable), then answer with AnswerPoll(request).
  std::string park_request_id;
};

class RequestHandler {
 public:
  virtual ~RequestHandler() = default;
  virtual RouteOutcome Handle(const HttpRequest& request) = 0;
  // The answer of a parked request once its future finished or the hold ran out.
  virtual HttpResponse AnswerPoll(const HttpRequest& request, const std::string& request_id) = 0;
  // Non-empty (the tenant) when Handle() may take time that grows with the
  // body: the server runs it on its decode pool. Cheap.
  virtual std::string HeavyFor(const HttpRequest& request) const = 0;
};

}  // namespace loom::http
