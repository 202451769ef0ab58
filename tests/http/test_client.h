// A minimal blocking HTTP/1.1 client for tests (Boost.Beast): one connection
// per call, or a KeepAlive object for several calls on one connection.
// Any thread; each call owns its socket.
#pragma once
#include <utility>  // before asio (Boost 1.74)

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <map>
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

}  // namespace loom::testing
