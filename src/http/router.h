// Router: maps one parsed HTTP request of the Tinker API onto the Service and
// back to an HTTP answer (status, content type, body). It authenticates,
// decodes JSON / protobuf / zstd, and maps every error onto a JSON body that
// names the field or limit (never an empty 4xx).
//
// It knows nothing of sockets or Beast, so it is testable without a server
// and compiles quickly. retrieve_future on a pending future does not block:
// Handle() returns a `park_request_id`, the server waits for the future
// (without blocking a thread) and then calls AnswerPoll().
//
// Thread-safe: any I/O thread may call any method concurrently.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "http/auth.h"
#include "service/service.h"

namespace loom::http {

struct HttpRequest {
  std::string method;                          // "GET", "POST", ...
  std::string target;                          // path + "?" + query, as received
  std::map<std::string, std::string> headers;  // names lower-cased
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
  // Non-empty: a pending retrieve_future. Wait for this future (up to the
  // poll hold), then answer with AnswerPoll(request).
  std::string park_request_id;
};

struct RouterOptions {
  size_t max_body_bytes = size_t{512} << 20;  // after zstd decoding too
};

class Router {
 public:
  Router(service::Service& service, const ApiKeys& keys, RouterOptions options);

  RouteOutcome Handle(const HttpRequest& request);
  // The final answer of a parked retrieve_future: the result if done by now,
  // else {"type":"try_again"}.
  HttpResponse AnswerPoll(const HttpRequest& request);

  // JSON error answer for a Status (also used by the server for 413 etc.).
  static HttpResponse Error(const Status& status);
  static int HttpStatusOf(Code code);

 private:
  struct Context;
  HttpResponse Dispatch(Context& ctx);
  HttpResponse Rest(Context& ctx);
  HttpResponse RetrieveFuture(Context& ctx, bool final_answer);

  service::Service& service_;
  const ApiKeys& keys_;
  const RouterOptions options_;
};

}  // namespace loom::http
