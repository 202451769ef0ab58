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
// Handle() of a request that HeavyFor() names takes time that grows with its
// body (zstd, protobuf, a large JSON body); the server runs those on a
// decode pool so that the I/O threads only ever do bounded work.
//
// GET /metrics: without RouterOptions::admin_key, the aggregate series are
// public and series labelled with a model_id are shown only to that model's
// tenant (its X-API-Key). With an admin key it answers only that key (401
// without a key or with an unknown one, 403 for a tenant's key), with every
// series and every tenant's usage (loom_tenant_*). GET /api/v1/usage answers
// a tenant its own usage, and the admin key every tenant's.
//
// GET /dashboard is the static page (http/dashboard.h); GET /api/v1/dashboard
// answers a tenant its own models and losses, and the admin key the
// operator's view.
//
// Thread-safe: any I/O thread may call any method concurrently.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "http/auth.h"
#include "http/handler.h"
#include "service/service.h"

namespace loom::http {

struct RouterOptions {
  size_t max_body_bytes = size_t{512} << 20;  // after zstd decoding too
  std::string admin_key;                      // --admin-key: /metrics and every tenant's usage; "" = none
};

// Bodies up to this size without a Content-Encoding decode in microseconds:
// the I/O thread handles them itself.
constexpr size_t kInlineBodyBytes = 64 * 1024;

class Router final : public RequestHandler {
 public:
  Router(service::Service& service, const ApiKeys& keys, RouterOptions options);

  RouteOutcome Handle(const HttpRequest& request) override;
  // The final answer of a parked retrieve_future (request_id is the
  // outcome's park_request_id; the body is not decoded again): the result if
  // done by now, else {"type":"try_again"}.
  HttpResponse AnswerPoll(const HttpRequest& request, const std::string& request_id) override;
  // The tenant when Handle(request) may take time that grows with the body
  // (a Content-Encoding, forward_backward's protobuf, a body over
  // kInlineBodyBytes); "" when it is bounded (including every request that
  // does not authenticate: Handle answers 401 before decoding anything).
  // Cheap: no decoding.
  std::string HeavyFor(const HttpRequest& request) const override;

  // JSON error answer for a Status (also used by the server for 413 etc.).
  static HttpResponse Error(const Status& status);
  static int HttpStatusOf(Code code);

 private:
  struct Context;
  // One route of the API under /api/v1/: a method ("*" = any) and a pattern
  // of '/'-separated segments, where "{}" is any one segment and a final
  // "**" the rest of the route (one character at least). The matched parts
  // are the handler's arguments, in order. The table is both what Dispatch()
  // serves and what a 405's Allow header lists.
  struct Route {
    const char* method;
    const char* pattern;
    std::function<HttpResponse(Context&, const std::vector<std::string>&)> handle;
    bool Matches(const std::string& route, std::vector<std::string>* args) const;
  };
  std::vector<Route> MakeRoutes();
  // The first route matching the request's method and route, else 405 (the
  // route exists under other methods) or 404.
  HttpResponse Dispatch(Context& ctx);
  // The methods the table serves on a route, in table order ("" = none).
  std::string AllowedMethods(const std::string& route) const;
  HttpResponse RetrieveFuture(Context& ctx, const std::string& request_id, bool final_answer);
  HttpResponse Scrape(const HttpRequest& request);  // GET /metrics
  bool IsAdmin(const HttpRequest& request) const;   // X-API-Key is RouterOptions::admin_key

  service::Service& service_;
  const ApiKeys& keys_;
  const RouterOptions options_;
  const std::vector<Route> routes_;  // after the members its handlers use
};

}  // namespace loom::http
