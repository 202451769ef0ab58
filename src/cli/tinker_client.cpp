// The blocking Tinker HTTP client of tinker_client.h (Boost.Beast).
#include <utility>  // before asio (Boost 1.74)

#include "cli/tinker_client.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "wire/forward_backward.h"
#include "wire/sample.h"

namespace loom::cli {

using Json = nlohmann::json;

TinkerClient::TinkerClient(std::string host, uint16_t port, std::string api_key)
    : host_(std::move(host)), port_(port), key_(std::move(api_key)) {}

Result<HttpReply> TinkerClient::Call(const std::string& method, const std::string& target, const std::string& body,
                                     const std::string& content_type, const std::string& accept) {
  namespace beast = boost::beast;
  namespace http = boost::beast::http;
  using tcp = boost::asio::ip::tcp;
  try {
    boost::asio::io_context ioc;
    tcp::resolver resolver(ioc);
    beast::tcp_stream stream(ioc);
    stream.expires_after(std::chrono::seconds(120));
    stream.connect(resolver.resolve(host_, std::to_string(port_)));
    http::request<http::string_body> req{http::string_to_verb(method), target, 11};
    req.set(http::field::host, host_ + ":" + std::to_string(port_));
    req.set("X-API-Key", key_);
    if (!body.empty()) req.set(http::field::content_type, content_type);
    if (!accept.empty()) req.set(http::field::accept, accept);
    req.body() = body;
    req.prepare_payload();
    http::write(stream, req);
    beast::flat_buffer buffer;
    http::response_parser<http::string_body> parser;
    parser.body_limit(size_t{1} << 30);
    http::read(stream, buffer, parser);
    auto& res = parser.get();
    HttpReply reply;
    reply.status = static_cast<int>(res.result_int());
    reply.content_type = std::string(res[http::field::content_type]);
    reply.body = res.body();
    beast::error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_both, ec);
    return reply;
  } catch (const std::exception& e) {
    return Status::Unavailable(method + " " + target + ": " + e.what());
  }
}

namespace {
// The server's message of an error answer, or the raw body.
std::string ErrorText(const HttpReply& r) {
  Json j = Json::parse(r.body, nullptr, false);
  if (j.is_object()) {
    if (j.contains("error") && j["error"].is_string()) return j["error"].get<std::string>();
    if (j.contains("detail")) return j["detail"].dump();
  }
  return r.body;
}
}  // namespace

Result<Json> TinkerClient::PostJson(const std::string& route, const Json& body) {
  auto r = Call("POST", "/api/v1/" + route, body.dump());
  if (!r.ok()) return r.status();
  if (r->status / 100 != 2) {
    return Status::Invalid(route + ": HTTP " + std::to_string(r->status) + ": " + ErrorText(*r));
  }
  Json j = Json::parse(r->body, nullptr, false);
  if (j.is_discarded()) return Status::Internal(route + ": answer is not JSON");
  return j;
}

Result<HttpReply> TinkerClient::Retrieve(const std::string& request_id, bool protobuf) {
  const std::string body = Json{{"request_id", request_id}}.dump();
  while (true) {
    auto r = Call("POST", "/api/v1/retrieve_future", body, "application/json",
                  protobuf ? "application/x-protobuf" : "");
    if (!r.ok()) return r.status();
    if (r->status / 100 != 2) return Status::Invalid("retrieve_future: HTTP " + std::to_string(r->status) + ": " + ErrorText(*r));
    if (r->content_type.find("json") != std::string::npos) {
      Json j = Json::parse(r->body, nullptr, false);
      if (j.is_object() && j.value("type", "") == "try_again") continue;
      if (j.is_object() && j.contains("error")) return Status::Invalid(ErrorText(*r));
    }
    return *r;
  }
}

Result<Json> TinkerClient::AwaitJson(const std::string& request_id) {
  auto r = Retrieve(request_id, false);
  if (!r.ok()) return r.status();
  Json j = Json::parse(r->body, nullptr, false);
  if (j.is_discarded()) return Status::Internal("retrieve_future: answer is not JSON");
  return j;
}

Status TinkerClient::CreateModel(const std::string& base_model, int rank, uint64_t seed) {
  auto s = PostJson("create_session", {{"tags", Json::array()}, {"user_metadata", Json::object()},
                                       {"sdk_version", "0.26.2"}, {"type", "create_session"}});
  if (!s.ok()) return s.status();
  session_id_ = s->value("session_id", "");
  auto sub = PostJson("create_model", {{"session_id", session_id_},
                                       {"model_seq_id", 0},
                                       {"base_model", base_model},
                                       {"lora_config", {{"rank", rank}, {"seed", seed}, {"train_unembed", true},
                                                        {"train_mlp", true}, {"train_attn", true}}},
                                       {"type", "create_model"}});
  if (!sub.ok()) return sub.status();
  auto done = AwaitJson(sub->value("request_id", ""));
  if (!done.ok()) return done.status();
  model_id_ = done->value("model_id", "");
  return model_id_.empty() ? Status::Internal("create_model answered without a model_id") : Status::Ok();
}

Result<std::string> TinkerClient::SubmitForwardBackward(const engine::ForwardBackwardCall& call) {
  tinker::ForwardBackwardRequest req;
  req.model_id = model_id_;
  req.seq_id = static_cast<int32_t>(seq_++);
  req.call = call;
  const std::string route = "forward_backward";  // forward_only travels in the protobuf
  auto r = Call("POST", "/api/v1/" + route, wire::EncodeForwardBackwardRequest(req), "application/x-protobuf");
  if (!r.ok()) return r.status();
  if (r->status / 100 != 2) return Status::Invalid(route + ": HTTP " + std::to_string(r->status) + ": " + ErrorText(*r));
  Json j = Json::parse(r->body, nullptr, false);
  if (!j.is_object() || !j.contains("request_id")) return Status::Internal(route + ": no request_id in " + r->body);
  return j["request_id"].get<std::string>();
}

Result<engine::ForwardBackwardOutput> TinkerClient::AwaitForwardBackward(const std::string& request_id) {
  auto r = Retrieve(request_id, true);
  if (!r.ok()) return r.status();
  return wire::DecodeForwardBackwardOutput(r->body);
}

Result<std::string> TinkerClient::SubmitOptimStep(const engine::AdamParams& a) {
  auto sub = PostJson("optim_step", {{"model_id", model_id_},
                                     {"seq_id", seq_++},
                                     {"adam_params", {{"learning_rate", a.learning_rate}, {"beta1", a.beta1},
                                                      {"beta2", a.beta2}, {"eps", a.eps},
                                                      {"weight_decay", a.weight_decay},
                                                      {"grad_clip_norm", a.grad_clip_norm}}},
                                     {"type", "optim_step"}});
  if (!sub.ok()) return sub.status();
  return sub->value("request_id", "");
}

Result<std::vector<int32_t>> TinkerClient::Greedy(const std::vector<int32_t>& prompt, int max_tokens,
                                                  const std::string& snapshot, const std::string& base_model) {
  Json session = {{"session_id", session_id_}, {"sampling_session_seq_id", sampling_seq_++},
                  {"type", "create_sampling_session"}};
  if (snapshot.empty()) {
    session["base_model"] = base_model;
  } else {
    auto sub = PostJson("save_weights_for_sampler", {{"model_id", model_id_}, {"path", snapshot},
                                                     {"seq_id", seq_++}, {"type", "save_weights_for_sampler"}});
    if (!sub.ok()) return sub.status();
    auto saved = AwaitJson(sub->value("request_id", ""));
    if (!saved.ok()) return saved.status();
    session["model_path"] = saved->value("path", "");
  }
  auto created = PostJson("create_sampling_session", session);
  if (!created.ok()) return created.status();
  Json body = {{"sampling_session_id", created->value("sampling_session_id", "")},
               {"seq_id", 0},
               {"num_samples", 1},
               {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", prompt}}}}}},
               {"sampling_params", {{"max_tokens", max_tokens}, {"temperature", 0.0}}},
               {"prompt_logprobs", false},
               {"topk_prompt_logprobs", 0},
               {"type", "sample"}};
  auto sub = PostJson("asample", body);
  if (!sub.ok()) return sub.status();
  auto r = Retrieve(sub->value("request_id", ""), true);
  if (!r.ok()) return r.status();
  auto out = wire::DecodeSampleResponse(r->body);
  if (!out.ok()) return out.status();
  if (out->sequences.empty()) return Status::Internal("asample answered without a sequence");
  return out->sequences[0].tokens;
}

}  // namespace loom::cli
