#include "replica/replica_handler.h"

#include <fmt/format.h>

#include <optional>

#include "common/log.h"
#include "http/router.h"
#include "replica/replica_api.h"
#include "wire/sample.h"

namespace loom::replica {

using Json = nlohmann::json;
using http::HttpResponse;
using http::RouteOutcome;
using http::Router;

namespace {

// Futures live for the gateway's polls: only an answer lost in transit is
// retrieved twice.
constexpr auto kOwner = "gateway";

HttpResponse JsonAnswer(const Json& body) {
  HttpResponse r;
  r.body = body.dump();
  return r;
}

std::string PathOf(const std::string& target) { return target.substr(0, target.find('?')); }

Result<Json> ParseBody(const std::string& body, const char* what) {
  Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Invalid(std::string(what) + ": the body must be a JSON object");
  return j;
}

}  // namespace

ReplicaHandler::ReplicaHandler(engine::Sampler& sampler, service::FutureTable& futures, std::string key,
                               std::string model_dir)
    : sampler_(sampler), futures_(futures), key_(std::move(key)), model_dir_(std::move(model_dir)) {}

std::string ReplicaHandler::HeavyFor(const http::HttpRequest& request) const {
  return request.body.size() > http::kInlineBodyBytes ? kOwner : "";
}

RouteOutcome ReplicaHandler::Handle(const http::HttpRequest& request) {
  RouteOutcome out;
  if (!key_.empty() && request.header(kKeyHeader) != key_) {
    out.response = Router::Error(Status(Code::kUnauthenticated, "X-Replica-Key: missing or not this replica's key"));
    return out;
  }
  const std::string path = PathOf(request.target);
  const bool get = request.method == "GET", post = request.method == "POST";
  if (get && path == "/replica/v1/info") {
    Json j = SamplerInfoJson(sampler_.info());
    j["model_dir"] = model_dir_;
    out.response = JsonAnswer(j);
  } else if (get && path == "/replica/v1/health") {
    out.response = JsonAnswer({{"stats", SamplerStatsJson(sampler_.stats())}, {"in_flight", in_flight()}});
  } else if (post && path == "/replica/v1/sample") {
    out.response = Submit(request);
  } else if (post && path == "/replica/v1/retrieve") {
    out = Retrieve(request);
  } else if (post && path == "/replica/v1/cancel") {
    out.response = Cancel(request);
  } else if (path == "/replica/v1/info" || path == "/replica/v1/health" || path == "/replica/v1/sample" ||
              path == "/replica/v1/retrieve" || path == "/replica/v1/cancel") {
    out.response = Router::Error(Status::Invalid(request.method + " " + path + ": method not allowed"));
    out.response.status = 405;
  } else {
    out.response = Router::Error(Status::NotFound(path + ": not a route of a sampler replica (/replica/v1/...)"));
  }
  return out;
}

HttpResponse ReplicaHandler::Submit(const http::HttpRequest& request) {
  auto body = ParseBody(request.body, "replica sample");
  if (!body.ok()) return Router::Error(body.status());
  auto call = ParseSampleCall(*body);
  if (!call.ok()) return Router::Error(call.status());
  if (Status st = sampler_.Validate(*call); !st.ok()) return Router::Error(Status(st.code(), "asample." + st.message()));
  {
    std::lock_guard<std::mutex> lock(sweep_mu_);
    const auto now = std::chrono::steady_clock::now();
    if (now - last_sweep_ > std::chrono::minutes(1)) {
      futures_.Sweep(now);
      last_sweep_ = now;
    }
  }
  const std::string id = futures_.Create(kOwner, "Sample");
  ++in_flight_;
  service::FutureTable* futures = &futures_;
  std::atomic<int>* in_flight = &in_flight_;
  sampler_.Submit(std::move(*call), [futures, in_flight, id](Result<engine::SampleOutput> result) {
    --*in_flight;
    if (!result.ok()) return futures->Fail(id, result.status());
    futures->Complete(id, std::move(*result));
  });
  return JsonAnswer({{"request_id", id}});
}

std::optional<HttpResponse> ReplicaHandler::Answer(const std::string& request_id) {
  auto view = futures_.Get(kOwner, request_id);
  if (!view.ok()) return Router::Error(view.status());
  if (view->state == service::FutureState::kFailed) return Router::Error(view->error);
  if (view->state == service::FutureState::kPending) return std::nullopt;
  const auto* output = view->result ? std::get_if<tinker::SampleOutput>(view->result.get()) : nullptr;
  if (output == nullptr) return Router::Error(Status::Internal("replica future " + request_id + " holds no sample"));
  auto bytes = wire::EncodeSampleResponse(wire::SampleResultOf(*output));
  if (!bytes.ok()) return Router::Error(bytes.status());
  HttpResponse r;
  r.content_type = "application/x-protobuf";
  r.body = std::move(*bytes);
  return r;
}

RouteOutcome ReplicaHandler::Retrieve(const http::HttpRequest& request) {
  RouteOutcome out;
  auto body = ParseBody(request.body, "replica retrieve");
  if (!body.ok()) {
    out.response = Router::Error(body.status());
    return out;
  }
  auto id = body->find("request_id");
  if (id == body->end() || !id->is_string()) {
    out.response = Router::Error(Status::Invalid("replica retrieve.request_id: missing"));
    return out;
  }
  if (auto answer = Answer(id->get<std::string>())) {
    out.response = std::move(*answer);
  } else {
    out.park_request_id = id->get<std::string>();
  }
  return out;
}

HttpResponse ReplicaHandler::AnswerPoll(const http::HttpRequest&, const std::string& request_id) {
  if (auto answer = Answer(request_id)) return std::move(*answer);
  return JsonAnswer({{"type", "try_again"}});
}

HttpResponse ReplicaHandler::Cancel(const http::HttpRequest& request) {
  auto body = ParseBody(request.body, "replica cancel");
  if (!body.ok()) return Router::Error(body.status());
  auto session = body->find("session");
  auto message = body->find("message");
  if (session == body->end() || !session->is_string() || session->get<std::string>().empty())
    return Router::Error(Status::Invalid("replica cancel.session: missing"));
  const std::string why = message != body->end() && message->is_string() ? message->get<std::string>() : "cancelled";
  sampler_.Cancel(session->get<std::string>(), Status::Precondition(why));
  log::Info("replica_cancel session={}", session->get<std::string>());
  return JsonAnswer(Json::object());
}

}  // namespace loom::replica
