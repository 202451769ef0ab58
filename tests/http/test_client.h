// A minimal blocking HTTP/1.1 client for tests (Boost.Beast): one connection
// per call, or a KeepAlive object for several calls on one connection.
// Any thread; each call owns its socket.
#pragma once
#include <utility>  // before asio (Boost 1.74)

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <gtest/gtest.h>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace loom::testing {

struct Reply {
  int status = 0;
  std::string content_type;
  std::string body;
  std::map<std::string, std::string> headers;
  bool connection_failed = false;
};

class HttpClient {
 public:
  HttpClient(std::string host, uint16_t port) : host_(std::move(host)), port_(port) {}

  Reply Call(const std::string& method, const std::string& target, const std::string& body = "",
             std::vector<std::pair<std::string, std::string>> headers = {}) {
    namespace beast = boost::beast;
    namespace http = boost::beast::http;
    using tcp = boost::asio::ip::tcp;
    Reply reply;
    try {
      boost::asio::io_context ioc;
      tcp::resolver resolver(ioc);
      beast::tcp_stream stream(ioc);
      stream.expires_after(std::chrono::seconds(60));
      stream.connect(resolver.resolve(host_, std::to_string(port_)));
      http::request<http::string_body> req{http::string_to_verb(method), target, 11};
      req.set(http::field::host, host_ + ":" + std::to_string(port_));
      bool has_type = false;
      for (auto& [k, v] : headers) {
        req.set(k, v);
        if (beast::iequals(k, "content-type")) has_type = true;
      }
      if (!body.empty() && !has_type) req.set(http::field::content_type, "application/json");
      req.body() = body;
      req.prepare_payload();
      http::write(stream, req);
      beast::flat_buffer buffer;
      http::response_parser<http::string_body> parser;
      parser.body_limit(size_t{1} << 30);
      http::read(stream, buffer, parser);
      auto& res = parser.get();
      reply.status = static_cast<int>(res.result_int());
      reply.content_type = std::string(res[http::field::content_type]);
      for (const auto& f : res) reply.headers[std::string(f.name_string())] = std::string(f.value());
      reply.body = res.body();
      beast::error_code ec;
      stream.socket().shutdown(tcp::socket::shutdown_both, ec);
    } catch (const std::exception&) {
      reply.connection_failed = true;
    }
    return reply;
  }

 private:
  std::string host_;
  uint16_t port_;
};

// POSTs retrieve_future for request_id as `key` until the answer is not
// try_again: at most `attempts` polls, a test failure if it never finishes.
// proto asks for protobuf results; allow_metadata_only is sent when true.
inline Reply RetrieveFuture(HttpClient& client, const std::string& key, const std::string& request_id, bool proto,
                            int attempts, bool allow_metadata_only = false) {
  nlohmann::json body{{"request_id", request_id}};
  if (allow_metadata_only) body["allow_metadata_only"] = true;
  for (int i = 0; i < attempts; ++i) {
    std::vector<std::pair<std::string, std::string>> h{{"X-API-Key", key}};
    if (proto) h.emplace_back("Accept", "application/x-protobuf");
    Reply r = client.Call("POST", "/api/v1/retrieve_future", body.dump(), h);
    if (r.content_type.find("json") != std::string::npos) {
      const nlohmann::json j = nlohmann::json::parse(r.body, nullptr, false);
      if (j.is_object() && j.value("type", "") == "try_again") continue;
    }
    return r;
  }
  ADD_FAILURE() << "future " << request_id << " never finished";
  return {};
}

}  // namespace loom::testing
