#include "http/router.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <string_view>

#include "common/log.h"
#include "http/dashboard.h"
#include "wire/errors.h"
#include "wire/forward_backward.h"
#include "wire/future_result.h"
#include "wire/json_api.h"
#include "wire/sample.h"
#include "wire/zstd.h"

namespace loom::http {

namespace {

using Json = nlohmann::json;
constexpr std::string_view kApi = "/api/v1/";

HttpResponse JsonAnswer(const Json& j, int status = 200) {
  HttpResponse r;
  r.status = status;
  r.body = wire::DumpJson(j);
  return r;
}

std::string PercentDecode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
      out.push_back(static_cast<char>(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16)));
      i += 2;
    } else if (s[i] == '+') {
      out.push_back(' ');
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

std::vector<std::string> Split(std::string_view s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    parts.emplace_back(s.substr(start, pos == std::string_view::npos ? std::string_view::npos : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return parts;
}

std::string Join(const std::vector<std::string>& parts, size_t from, size_t to, char sep) {
  std::string out;
  for (size_t i = from; i < to; ++i) {
    if (i > from) out.push_back(sep);
    out += parts[i];
  }
  return out;
}

// The decoded path of a target (without the query).
std::string PathOf(const std::string& target) {
  return PercentDecode(std::string_view(target).substr(0, target.find('?')));
}

// The route after /api/v1/ without trailing slashes; nullopt outside the API.
std::optional<std::string> RouteOf(const std::string& path) {
  const size_t api = path.find(kApi);
  if (api == std::string::npos) return std::nullopt;
  std::string route = path.substr(api + kApi.size());
  while (!route.empty() && route.back() == '/') route.pop_back();
  return route;
}

// "x-api-key" -> "X-API-Key", as clients spell the header.
std::string HeaderName(std::string_view lower) {
  if (lower == "x-api-key") return "X-API-Key";
  std::string out(lower);
  bool start = true;
  for (char& c : out) {
    if (start) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    start = c == '-';
  }
  return out;
}

// 405 with the Allow header (RFC 9110 §15.5.6).
HttpResponse MethodNotAllowed(const std::string& method, const std::string& path, const std::string& allow) {
  HttpResponse r = Router::Error(Status::Invalid(
      fmt::format("method: {} is not allowed on {} (allowed: {})", method, path, allow)));
  r.status = 405;
  r.headers.emplace_back("Allow", allow);
  return r;
}

// Equality in time that does not depend on where the keys differ (the
// length is not the secret).
bool SameKey(const std::string& given, const std::string& secret) {
  if (secret.empty() || given.size() != secret.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < secret.size(); ++i) diff |= static_cast<unsigned char>(given[i] ^ secret[i]);
  return diff == 0;
}

}  // namespace

// What one request carries through dispatch.
struct Router::Context {
  const HttpRequest& request;
  std::string path;                          // without query
  std::map<std::string, std::string> query;  // decoded
  std::string route;                         // the part after /api/v1/
  std::string body;                          // zstd-decoded
  service::Caller caller;
  std::string park_request_id;               // set by a retrieve_future that found its future pending

  std::string q(const std::string& key) const {
    auto it = query.find(key);
    return it == query.end() ? std::string() : it->second;
  }
};

int Router::HttpStatusOf(Code code) {
  switch (code) {
    case Code::kOk: return 200;
    case Code::kInvalidArgument: return 400;
    case Code::kNotFound: return 404;
    case Code::kAlreadyExists: return 400;  // 409 would make the SDK retry for minutes
    case Code::kResourceExhausted: return 429;
    case Code::kFailedPrecondition: return 400;
    case Code::kUnauthenticated: return 401;
    case Code::kPayloadTooLarge: return 413;
    case Code::kInternal: return 500;
    case Code::kUnavailable: return 503;
  }
  return 500;
}

HttpResponse Router::Error(const Status& status) {
  HttpResponse r;
  r.status = HttpStatusOf(status.code());
  r.body = wire::ErrorBody(status);
  if (status.code() == Code::kResourceExhausted) r.headers.emplace_back("Retry-After", "1");
  if (status.code() == Code::kUnauthenticated || status.code() == Code::kNotFound ||
      status.code() == Code::kInvalidArgument) {
    r.headers.emplace_back("x-should-retry", "false");
  }
  return r;
}

Router::Router(service::Service& service, const ApiKeys& keys, RouterOptions options)
    : service_(service), keys_(keys), options_(options), routes_(MakeRoutes()) {}

RouteOutcome Router::Handle(const HttpRequest& request) {
  Context ctx{request, {}, {}, {}, {}, {}, {}};
  const std::string& target = request.target;
  const size_t qpos = target.find('?');
  ctx.path = PathOf(target);
  if (qpos != std::string::npos) {
    for (const std::string& kv : Split(std::string_view(target).substr(qpos + 1), '&')) {
      if (kv.empty()) continue;
      const size_t eq = kv.find('=');
      ctx.query[PercentDecode(kv.substr(0, eq))] = eq == std::string::npos ? "" : PercentDecode(kv.substr(eq + 1));
    }
  }
  RouteOutcome out;
  // Every answer counts by status code for /metrics (a parked poll when it is answered).
  struct CountResponse {
    service::Metrics& metrics;
    const RouteOutcome& outcome;
    ~CountResponse() {
      if (outcome.park_request_id.empty()) metrics.CountResponse(outcome.response.status);
    }
  } count_response{service_.metrics(), out};
  // A header that decides who is calling or how to read the body must be
  // unambiguous: with two, which one wins would be the parser's choice.
  for (const char* name : {"x-api-key", "x-idempotency-key", "content-encoding"}) {
    if (std::find(request.repeated_headers.begin(), request.repeated_headers.end(), name) !=
        request.repeated_headers.end()) {
      out.response = Error(Status::Invalid(fmt::format("{}: header sent more than once; send exactly one",
                                                       HeaderName(name))));
      return out;
    }
  }
  // Prometheus scrape: aggregates for anyone, a model's series for its tenant.
  if (ctx.path == "/metrics") {
    out.response = request.method == "GET" ? Scrape(request) : MethodNotAllowed(request.method, ctx.path, "GET");
    return out;
  }
  // The dashboard page holds no data: it reads /api/v1/dashboard with the key.
  if (ctx.path == "/dashboard") {
    out.response = request.method == "GET" ? DashboardPage() : MethodNotAllowed(request.method, ctx.path, "GET");
    return out;
  }
  auto route = RouteOf(ctx.path);
  if (!route) {
    out.response = Error(Status::NotFound("no such route: " + request.method + " " + ctx.path +
                                          " (the Tinker API lives under /api/v1/)"));
    return out;
  }
  ctx.route = std::move(*route);

  // Unauthenticated routes: health and archive downloads (the token is the credential).
  if (ctx.route == "healthz") {
    out.response = JsonAnswer(wire::HealthzJson());
    return out;
  }
  if (ctx.route.rfind("archives/", 0) == 0) {
    if (request.method != "GET") {
      out.response = MethodNotAllowed(request.method, ctx.path, "GET");
      return out;
    }
    auto tar = service_.checkpoints().ReadArchive(ctx.route.substr(9));
    if (!tar.ok()) {
      out.response = Error(tar.status());
    } else {
      out.response.content_type = "application/x-tar";
      out.response.body = std::move(*tar);
    }
    return out;
  }

  // The admin key reads every tenant's usage (it is no tenant's key).
  if (ctx.route == "usage" && request.method == "GET" && IsAdmin(request)) {
    out.response = JsonAnswer(wire::UsageListJson(service_.AllUsage()));
    return out;
  }
  if (ctx.route == "dashboard" && request.method == "GET" && IsAdmin(request)) {
    out.response = JsonAnswer(AdminDashboardJson(service_));
    return out;
  }
  auto tenant = keys_.Authenticate(request.header("x-api-key"));
  if (!tenant.ok()) {
    out.response = Error(tenant.status());
    return out;
  }
  ctx.caller.tenant = *tenant;
  ctx.caller.idempotency_key = request.header("x-idempotency-key");
  ctx.caller.route = request.method + " " + ctx.route;

  ctx.body = request.body;
  const std::string encoding = request.header("content-encoding");
  if (encoding == "zstd") {
    auto raw = wire::ZstdDecompress(request.body, options_.max_body_bytes);
    if (!raw.ok()) {
      out.response = Error(raw.status().code() == Code::kPayloadTooLarge
                               ? Status(Code::kPayloadTooLarge,
                                        fmt::format("body: decompressed size exceeds --max-body-bytes {}",
                                                    options_.max_body_bytes))
                               : raw.status());
      return out;
    }
    ctx.body = std::move(*raw);
  } else if (!encoding.empty() && encoding != "identity") {
    out.response = Error(Status::Invalid("Content-Encoding: '" + encoding + "' is not supported (zstd is)"));
    return out;
  }

  ctx.caller.body_digest = service::BodyDigest(ctx.body);
  try {
    out.response = Dispatch(ctx);
    out.park_request_id = ctx.park_request_id;
  } catch (const std::exception& e) {  // a bug; never take the server down
    log::Error("route_exception route={} what={}", ctx.route, e.what());
    out.response = Error(Status::Internal(std::string("internal error: ") + e.what()));
  }
  return out;
}

bool Router::IsAdmin(const HttpRequest& request) const {
  return !options_.admin_key.empty() && SameKey(request.header("x-api-key"), options_.admin_key);
}

HttpResponse Router::Scrape(const HttpRequest& request) {
  HttpResponse r;
  r.content_type = "text/plain; version=0.0.4; charset=utf-8";
  if (IsAdmin(request)) {
    r.body = service_.MetricsText(/*with_usage=*/true);
    return r;
  }
  const std::string key = request.header("x-api-key");
  // With an admin key configured, /metrics is the operator's: tenants read
  // their own figures at /api/v1/usage.
  if (!options_.admin_key.empty()) {
    if (key.empty()) {
      return Error(Status(Code::kUnauthenticated, "/metrics: needs the admin key (--admin-key) in X-API-Key"));
    }
    auto t = keys_.Authenticate(key);
    if (!t.ok()) return Error(t.status());
    HttpResponse denied = Error(Status(Code::kUnauthenticated,
                                       "/metrics: only the admin key (--admin-key) may read it; a tenant's key reads "
                                       "its own usage at GET /api/v1/usage"));
    denied.status = 403;
    return denied;
  }
  r.body = service_.MetricsText();
  // Without a key: the aggregates only. With one: also that tenant's models.
  std::string tenant;
  if (!key.empty()) {
    auto t = keys_.Authenticate(key);
    if (!t.ok()) return Error(t.status());
    tenant = *t;
  }
  const service::Caller caller{tenant, ""};
  r.body = service::Metrics::KeepModelSeries(r.body, [&](const std::string& model_id) {
    // Live models, then the registry's runs (a model's series outlive its unload).
    return !tenant.empty() &&
           (service_.GetInfo(caller, model_id).ok() || service_.checkpoints().GetTrainingRun(caller, model_id).ok());
  });
  return r;
}

std::string Router::HeavyFor(const HttpRequest& request) const {
  const std::string encoding = request.header("content-encoding");
  const bool encoded = !encoding.empty() && encoding != "identity";
  const std::string path = PathOf(request.target);
  const auto route = RouteOf(path);
  // Routes that never read the body are bounded whatever it holds.
  if (path == "/metrics" || !route || *route == "healthz" || route->rfind("archives/", 0) == 0) return "";
  if (!encoded && request.body.size() <= kInlineBodyBytes && *route != "forward_backward") return "";
  auto tenant = keys_.Authenticate(request.header("x-api-key"));
  return tenant.ok() ? *tenant : "";
}

HttpResponse Router::AnswerPoll(const HttpRequest& request, const std::string& request_id) {
  Context ctx{request, {}, {}, "retrieve_future", {}, {}, {}};
  auto tenant = keys_.Authenticate(request.header("x-api-key"));
  if (!tenant.ok()) return Error(tenant.status());
  ctx.caller.tenant = *tenant;
  HttpResponse answer = RetrieveFuture(ctx, request_id, /*final_answer=*/true);
  service_.metrics().CountResponse(answer.status);
  return answer;
}

HttpResponse Router::RetrieveFuture(Context& ctx, const std::string& request_id, bool final_answer) {
  auto view = service_.futures().Get(ctx.caller.tenant, request_id);
  if (!view.ok()) {
    if (service_.futures().IsFromEarlierInstance(request_id)) {
      HttpResponse r = JsonAnswer(
          {{"error", "request_id '" + request_id + "' belongs to an earlier run of this server; resubmit"},
           {"category", "server"}},
          410);
      return r;
    }
    return Error(view.status());
  }
  switch (view->state) {
    case service::FutureState::kPending:
      if (!final_answer) {
        HttpResponse park;
        park.status = 0;
        return park;
      }
      return JsonAnswer(wire::TryAgainJson(request_id,
                                           view->queue_state == service::QueueState::kPausedCapacity
                                               ? wire::QueueState::kPausedCapacity
                                               : wire::QueueState::kActive,
                                           view->queue_reason));
    case service::FutureState::kFailed:
      return JsonAnswer(wire::FutureErrorJson(view->error));
    case service::FutureState::kDone:
      break;
  }
  const service::FutureResult& result = *view->result;
  // forward_backward and asample: protobuf when the SDK accepts it, else
  // their legacy JSON shapes; every other result is JSON.
  if (wire::HasProtobufForm(result) &&
      ctx.request.header("accept").find("application/x-protobuf") != std::string::npos) {
    auto bytes = wire::FutureResultProtobuf(result);
    if (!bytes.ok()) return JsonAnswer(wire::FutureErrorJson(bytes.status()));
    HttpResponse r;
    r.content_type = "application/x-protobuf";
    r.body = std::move(*bytes);
    return r;
  }
  return JsonAnswer(wire::FutureResultJson(result));
}

// ------------------------------------------------------------ the routes

bool Router::Route::Matches(const std::string& route, std::vector<std::string>* args) const {
  args->clear();
  const std::string_view p = pattern;
  if (p.ends_with("/**")) {  // the rest of the route, at least one character
    const std::string_view prefix = p.substr(0, p.size() - 2);
    if (route.size() <= prefix.size() || route.compare(0, prefix.size(), prefix) != 0) return false;
    args->push_back(route.substr(prefix.size()));
    return true;
  }
  const std::vector<std::string> want = Split(p, '/');
  const std::vector<std::string> parts = Split(route, '/');
  if (want.size() != parts.size()) return false;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == "{}") {
      args->push_back(parts[i]);
    } else if (want[i] != parts[i]) {
      return false;
    }
  }
  return true;
}

std::string Router::AllowedMethods(const std::string& route) const {
  std::string allow;
  std::vector<std::string> args;
  for (const Route& r : routes_) {
    if (!r.Matches(route, &args)) continue;
    if (!allow.empty()) allow += ", ";
    allow += r.method;
  }
  return allow;
}

HttpResponse Router::Dispatch(Context& ctx) {
  std::vector<std::string> args;
  for (const Route& r : routes_) {
    if ((r.method == std::string_view("*") || r.method == ctx.request.method) && r.Matches(ctx.route, &args)) {
      return r.handle(ctx, args);
    }
  }
  // A route that exists under another method is 405, anything else 404.
  const std::string allow = AllowedMethods(ctx.route);
  if (allow.empty()) {
    return Error(Status::NotFound("no such route: " + ctx.request.method + " /api/v1/" + ctx.route));
  }
  return MethodNotAllowed(ctx.request.method, "/api/v1/" + ctx.route, allow);
}

std::vector<Router::Route> Router::MakeRoutes() {
  using Args = std::vector<std::string>;
  auto future_answer = [](const Result<service::Submitted>& sub) {
    if (!sub.ok()) return Error(sub.status());
    return JsonAnswer(wire::UntypedFutureJson(sub.value().request_id, sub.value().model_id));
  };
  auto empty_or_error = [](const Status& st) { return st.ok() ? JsonAnswer(Json::object()) : Error(st); };
  // A typed answer in its JSON form (wire/), or its error.
  auto encoded = [](const auto& answer, auto encode) {
    return answer.ok() ? JsonAnswer(encode(answer.value())) : Error(answer.status());
  };
  auto page = [](const Context& ctx, int64_t default_limit) {
    return wire::ParsePageParams(ctx.q("limit"), ctx.q("offset"), default_limit);
  };
  // The JSON body of a POST/PUT parsed by `parser`, or the error answer.
#define LOOM_PARSE(var, endpoint, parser)                          \
  auto var##_json = wire::ParseJsonObject(ctx.body, endpoint);     \
  if (!var##_json.ok()) return Error(var##_json.status());         \
  auto var = parser(*var##_json);                                  \
  if (!var.ok()) return Error(var.status());
  // A checkpoint route's "<kind>/<name>" (the id is not URL-encoded).
  auto checkpoint_id = [](const Args& a) { return a[1] + "/" + a[2]; };
  // The route of an asynchronous request: its body parsed into the request
  // the Service method submits, answered with the future's id.
  auto submit = [=, this](const char* endpoint, auto parser, auto method) {
    return [=, this](Context& ctx, const Args&) {
      LOOM_PARSE(req, endpoint, parser);
      return future_answer((service_.*method)(ctx.caller, *req));
    };
  };
  // The route of a direct answer: the Service method's typed result, encoded.
  auto answer = [=, this](const char* endpoint, auto parser, auto method, auto encode) {
    return [=, this](Context& ctx, const Args&) {
      LOOM_PARSE(req, endpoint, parser);
      return encoded((service_.*method)(ctx.caller, *req), encode);
    };
  };

  std::vector<Route> routes = {
      {"POST", "client/config",
       [](Context& ctx, const Args&) {
         LOOM_PARSE(req, "client/config", wire::ParseClientConfigRequest);
         return JsonAnswer(wire::ClientConfigJson());
       }},
      {"POST", "client/dynamic_config",
       [](Context& ctx, const Args&) {
         LOOM_PARSE(req, "client/dynamic_config", wire::ParseClientConfigRequest);
         return JsonAnswer(wire::DynamicConfigJson());
       }},
      {"POST", "create_session",
       answer("create_session", wire::ParseCreateSessionRequest, &service::Service::CreateSession, wire::CreateSessionJson)},
      {"POST", "session_heartbeat",
       [=, this](Context& ctx, const Args&) {
         LOOM_PARSE(req, "session_heartbeat", wire::ParseSessionHeartbeatRequest);
         Status st = service_.Heartbeat(ctx.caller, req->session_id);
         return st.ok() ? JsonAnswer(wire::SessionHeartbeatJson()) : Error(st);
       }},
      {"POST", "telemetry",
       [](Context& ctx, const Args&) {
         LOOM_PARSE(req, "telemetry", wire::ParseTelemetryRequest);
         return JsonAnswer(wire::TelemetryAcceptedJson());
       }},
      {"POST", "create_model", submit("create_model", wire::ParseCreateModelRequest, &service::Service::CreateModel)},
      {"POST", "get_info",
       [=, this](Context& ctx, const Args&) {
         LOOM_PARSE(req, "get_info", wire::ParseGetInfoRequest);
         return encoded(service_.GetInfo(ctx.caller, req->model_id), wire::GetInfoJson);
       }},
      {"POST", "unload_model",
       [=, this](Context& ctx, const Args&) {
         LOOM_PARSE(req, "unload_model", wire::ParseUnloadModelRequest);
         return future_answer(service_.UnloadModel(ctx.caller, req->model_id));
       }},
      {"POST", "weights_info",
       [=, this](Context& ctx, const Args&) {
         LOOM_PARSE(req, "weights_info", wire::ParseWeightsInfoRequest);
         return encoded(service_.checkpoints().WeightsInfo(ctx.caller, req->path), wire::WeightsInfoJson);
       }},
      {"POST", "forward_backward",
       [=, this](Context& ctx, const Args&) {
         const std::string type = ctx.request.header("content-type");
         if (type.find("json") != std::string::npos) {
           return Error(Status::Invalid(
               "forward_backward: body must be protobuf tinker_public.ForwardBackwardRequest "
               "(Content-Type: application/x-protobuf), as tinker>=0.25 sends it"));
         }
         wire::ForwardBackwardDecodeOptions opts;
         opts.max_decoded_bytes = options_.max_body_bytes;
         auto req = wire::DecodeForwardBackwardRequest(ctx.body, opts);
         if (!req.ok()) return Error(req.status());
         return future_answer(service_.ForwardBackward(ctx.caller, std::move(*req)));
       }},
      {"POST", "optim_step", submit("optim_step", wire::ParseOptimStepRequest, &service::Service::OptimStep)},
      {"POST", "save_weights", submit("save_weights", wire::ParseSaveWeightsRequest, &service::Service::SaveWeights)},
      {"POST", "load_weights", submit("load_weights", wire::ParseLoadWeightsRequest, &service::Service::LoadWeights)},
      {"POST", "save_weights_for_sampler", submit("save_weights_for_sampler", wire::ParseSaveWeightsForSamplerRequest, &service::Service::SaveWeightsForSampler)},
      {"POST", "create_sampling_session",
       answer("create_sampling_session", wire::ParseCreateSamplingSessionRequest, &service::Service::CreateSamplingSession, wire::CreateSamplingSessionJson)},
      {"POST", "asample",
       [=, this](Context& ctx, const Args&) {
         LOOM_PARSE(req, "asample", wire::ParseSampleRequest);
         auto sub = service_.Sample(ctx.caller, *req);
         if (!sub.ok()) return Error(sub.status());
         return JsonAnswer(wire::UntypedFutureJson(sub->request_id, std::nullopt, sub->sample_sequence_ids));
       }},
      {"POST", "auth/token",
       [](Context&, const Args&) {
         return JsonAnswer({{"error", "auth/token: JWT exchange is not offered (client/config says "
                                      "pjwt_auth_enabled=false); send the API key in X-API-Key"},
                            {"category", "user"}},
                           501);
       }},
      {"POST", "retrieve_future",
       [=, this](Context& ctx, const Args&) {
         LOOM_PARSE(req, "retrieve_future", wire::ParseRetrieveFutureRequest);
         HttpResponse answer = RetrieveFuture(ctx, req->request_id, /*final_answer=*/false);
         if (answer.status == 0) ctx.park_request_id = req->request_id;  // pending: park
         return answer;
       }},
      {"GET", "samplers/**",
       [=, this](Context& ctx, const Args& a) {
         return encoded(service_.GetSampler(ctx.caller, a[0]), wire::GetSamplerJson);
       }},
      {"GET", "get_server_capabilities",
       [=, this](Context&, const Args&) {
         std::vector<wire::SupportedModel> models;
         for (const auto& base : service_.bases()) models.push_back({base->name, base->engine->info().context_window});
         return JsonAnswer(wire::ServerCapabilitiesJson(models));
       }},
      // ---- REST (§8.8)
      {"GET", "training_runs",
       [=, this](Context& ctx, const Args&) {
         auto p = page(ctx, 20);
         if (!p.ok()) return Error(p.status());
         return encoded(service_.checkpoints().ListTrainingRuns(ctx.caller, *p), wire::TrainingRunsJson);
       }},
      {"GET", "training_runs/{}",
       [=, this](Context& ctx, const Args& a) {
         return encoded(service_.checkpoints().GetTrainingRun(ctx.caller, a[0]), wire::TrainingRunJson);
       }},
      {"GET", "training_runs/{}/checkpoints",
       [=, this](Context& ctx, const Args& a) {
         return encoded(service_.checkpoints().ListRunCheckpoints(ctx.caller, a[0]), wire::CheckpointsListJson);
       }},
      {"DELETE", "training_runs/{}/checkpoints/{}/{}",
       [=, this](Context& ctx, const Args& a) {
         return empty_or_error(service_.checkpoints().DeleteCheckpoint(ctx.caller, a[0], checkpoint_id(a)));
       }},
      // A bare checkpoint id (the hosted service's error for it: the kind is
      // part of the id) is a 400 that says so, not "no such route".
      {"*", "training_runs/{}/checkpoints/{}",
       [](Context&, const Args& a) {
         return Error(Status::Invalid("checkpoint id '" + a[1] + "' lacks its kind: use 'weights/" + a[1] +
                                      "' or 'sampler_weights/" + a[1] + "' (as in its tinker:// path)"));
       }},
      {"GET", "training_runs/{}/checkpoints/{}/{}/archive",
       [=, this](Context& ctx, const Args& a) {
         int64_t expires = 0;
         auto token = service_.checkpoints().CreateArchiveToken(ctx.caller, a[0], checkpoint_id(a), &expires);
         if (!token.ok()) return Error(token.status());
         std::string host = ctx.request.header("host");
         if (host.empty()) host = "127.0.0.1";
         return JsonAnswer(wire::CheckpointArchiveUrlJson("http://" + host + "/api/v1/archives/" + *token, expires));
       }},
      {"POST", "training_runs/{}/checkpoints/{}/{}/publish",
       [=, this](Context& ctx, const Args& a) {
         return empty_or_error(service_.checkpoints().SetCheckpointPublic(ctx.caller, a[0], checkpoint_id(a), true));
       }},
      {"DELETE", "training_runs/{}/checkpoints/{}/{}/publish",
       [=, this](Context& ctx, const Args& a) {
         return empty_or_error(service_.checkpoints().SetCheckpointPublic(ctx.caller, a[0], checkpoint_id(a), false));
       }},
      {"PUT", "training_runs/{}/checkpoints/{}/{}/ttl",
       [=, this](Context& ctx, const Args& a) {
         LOOM_PARSE(req, "checkpoint ttl", wire::ParseCheckpointTtlRequest);
         return empty_or_error(service_.checkpoints().SetCheckpointTtl(ctx.caller, a[0], checkpoint_id(a), req->ttl_seconds));
       }},
      {"GET", "checkpoints",
       [=, this](Context& ctx, const Args&) {
         auto p = page(ctx, 100);
         if (!p.ok()) return Error(p.status());
         return encoded(service_.checkpoints().ListUserCheckpoints(ctx.caller, *p), wire::CheckpointsListJson);
       }},
      {"GET", "sessions",
       [=, this](Context& ctx, const Args&) {
         auto p = page(ctx, 20);
         if (!p.ok()) return Error(p.status());
         return encoded(service_.ListSessions(ctx.caller, *p), wire::SessionsListJson);
       }},
      {"GET", "sessions/{}",
       [=, this](Context& ctx, const Args& a) {
         return encoded(service_.GetSession(ctx.caller, a[0]), wire::SessionJson);
       }},
      // loom's own (docs/usage.md): the caller's usage; the admin key's
      // view of every tenant is answered before authentication (Handle).
      {"GET", "usage",
       [=, this](Context& ctx, const Args&) { return JsonAnswer(wire::UsageJson(service_.UsageOf(ctx.caller.tenant))); }},
      // loom's own (docs/dashboard.md): the caller's models and losses; the
      // admin key's view is answered before authentication (Handle).
      {"GET", "dashboard",
       [=, this](Context& ctx, const Args&) { return JsonAnswer(TenantDashboardJson(service_, ctx.caller.tenant)); }},
      {"PUT", "sessions/{}/project",
       [=, this](Context& ctx, const Args& a) {
         auto s = service_.GetSession(ctx.caller, a[0]);
         return s.ok() ? JsonAnswer(Json::object()) : Error(s.status());
       }},
      {"*", "sessions/{}/trace_export",
       [](Context&, const Args&) {
         return JsonAnswer({{"status", "failed"}, {"error", "trace export is not offered by loom"}});
       }},
  };
#undef LOOM_PARSE
  return routes;
}

}  // namespace loom::http
