// The only translation unit that includes Boost.Beast (about 30 s to compile).
#include <utility>  // before asio: Boost 1.74's awaitable.hpp misses it

#include "http/server.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "common/log.h"

namespace loom::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

namespace {
constexpr auto kTuple = asio::as_tuple(asio::use_awaitable);
}

struct HttpServer::Impl {
  Router& router;
  service::FutureTable& futures;
  ServerOptions options;
  asio::io_context ioc;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::vector<std::thread> threads;
  std::atomic<bool> stopping{false};
  uint16_t bound_port = 0;

  // Parked polls, so Stop() can wake them.
  std::mutex parked_mu;
  std::set<std::shared_ptr<asio::steady_timer>> parked;

  Impl(Router& r, service::FutureTable& f, ServerOptions o) : router(r), futures(f), options(std::move(o)) {}

  asio::awaitable<void> Accept() {
    while (!stopping) {
      auto [ec, socket] = co_await acceptor->async_accept(asio::make_strand(ioc), kTuple);
      if (ec) {
        if (stopping || ec == asio::error::operation_aborted) break;
        continue;
      }
      socket.set_option(tcp::no_delay(true));
      auto exec = socket.get_executor();
      asio::co_spawn(exec, Serve(std::move(socket)), asio::detached);
    }
  }

  static HttpRequest Convert(const bhttp::request<bhttp::string_body>& req) {
    HttpRequest r;
    r.method = std::string(req.method_string());
    r.target = std::string(req.target());
    for (const auto& field : req) {
      std::string name(field.name_string());
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      r.headers[name] = std::string(field.value());
    }
    r.body = req.body();
    return r;
  }

  // Waits for the future, the hold, or shutdown, whichever comes first.
  asio::awaitable<void> Park(const std::string& request_id) {
    auto exec = co_await asio::this_coro::executor;
    auto timer = std::make_shared<asio::steady_timer>(exec, options.poll_hold);
    // Completion runs on the engine thread: hop to this connection's strand
    // and cancel the timer there (timers are not thread-safe).
    const uint64_t watch = futures.Watch(request_id, [timer, exec] {
      asio::post(exec, [timer] { timer->cancel(); });
    });
    if (watch == 0) co_return;  // finished meanwhile
    {
      std::lock_guard<std::mutex> lock(parked_mu);
      parked.insert(timer);
    }
    if (!stopping) co_await timer->async_wait(kTuple);
    {
      std::lock_guard<std::mutex> lock(parked_mu);
      parked.erase(timer);
    }
    futures.Unwatch(request_id, watch);
  }

  asio::awaitable<void> Write(beast::tcp_stream& stream, const HttpResponse& answer, unsigned version,
                              bool keep_alive, bool* ok) {
    bhttp::response<bhttp::string_body> res{static_cast<bhttp::status>(answer.status), version};
    res.set(bhttp::field::server, "loom");
    res.set(bhttp::field::content_type, answer.content_type);
    for (const auto& [k, v] : answer.headers) res.set(k, v);
    res.keep_alive(keep_alive);
    res.body() = answer.body;
    res.prepare_payload();
    stream.expires_after(std::chrono::seconds(60));
    auto [ec, n] = co_await bhttp::async_write(stream, res, kTuple);
    *ok = !ec;
  }

  asio::awaitable<void> Serve(tcp::socket socket) {
    beast::tcp_stream stream(std::move(socket));
    beast::flat_buffer buffer;
    while (!stopping) {
      bhttp::request_parser<bhttp::string_body> parser;
      parser.body_limit(options.max_body_bytes);
      parser.header_limit(64 * 1024);
      stream.expires_after(options.idle_timeout);
      auto [ec, n] = co_await bhttp::async_read(stream, buffer, parser, kTuple);
      if (ec == bhttp::error::body_limit) {
        HttpResponse too_big = Router::Error(Status(
            Code::kPayloadTooLarge,
            "body: larger than the server's limit of " + std::to_string(options.max_body_bytes) +
                " bytes (--max-body-bytes)"));
        bool ok = false;
        co_await Write(stream, too_big, 11, /*keep_alive=*/false, &ok);
        break;
      }
      if (ec == bhttp::error::header_limit || ec == bhttp::error::bad_target || ec == bhttp::error::bad_method ||
          ec == bhttp::error::bad_version || ec == bhttp::error::bad_field || ec == bhttp::error::bad_value ||
          ec == bhttp::error::bad_content_length || ec == bhttp::error::bad_chunk) {
        bool ok = false;
        co_await Write(stream, Router::Error(Status::Invalid("malformed HTTP request: " + ec.message())), 11, false,
                       &ok);
        break;
      }
      if (ec) break;  // closed, timed out
      const auto& req = parser.get();
      const bool keep_alive = req.keep_alive();
      const unsigned version = req.version();
      HttpRequest request = Convert(req);
      const auto t0 = std::chrono::steady_clock::now();
      RouteOutcome outcome = router.Handle(request);
      if (!outcome.park_request_id.empty()) {
        co_await Park(outcome.park_request_id);
        outcome.response = router.AnswerPoll(request);
      }
      const auto ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
      if (outcome.response.status >= 500 && outcome.response.status != 501) {
        log::Warn("http method={} target={} status={} ms={}", request.method, request.target,
                  outcome.response.status, ms);
      } else {
        log::Debug("http method={} target={} status={} ms={}", request.method, request.target,
                   outcome.response.status, ms);
      }
      bool ok = false;
      co_await Write(stream, outcome.response, version, keep_alive && !stopping, &ok);
      if (!ok || !keep_alive) break;
    }
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }
};

HttpServer::HttpServer(Router& router, service::FutureTable& futures, ServerOptions options)
    : impl_(std::make_unique<Impl>(router, futures, std::move(options))) {}

HttpServer::~HttpServer() { Stop(std::chrono::milliseconds(0)); }

Status HttpServer::Start() {
  Impl& s = *impl_;
  try {
    tcp::resolver resolver(s.ioc);
    auto endpoints = resolver.resolve(s.options.host, std::to_string(s.options.port));
    if (endpoints.empty()) return Status::Invalid("--host: cannot resolve '" + s.options.host + "'");
    tcp::endpoint ep = endpoints.begin()->endpoint();
    s.acceptor = std::make_unique<tcp::acceptor>(s.ioc);
    s.acceptor->open(ep.protocol());
    s.acceptor->set_option(asio::socket_base::reuse_address(true));
    s.acceptor->bind(ep);
    s.acceptor->listen(asio::socket_base::max_listen_connections);
    s.bound_port = s.acceptor->local_endpoint().port();
  } catch (const std::exception& e) {
    return Status::Invalid("--host/--port: cannot listen on " + s.options.host + ":" +
                           std::to_string(s.options.port) + ": " + e.what());
  }
  asio::co_spawn(s.ioc, s.Accept(), asio::detached);
  for (int i = 0; i < std::max(1, s.options.io_threads); ++i) {
    s.threads.emplace_back([&s] {
      while (true) {
        try {
          s.ioc.run();
          break;
        } catch (const std::exception& e) {
          log::Error("io_thread_exception what={}", e.what());
        }
      }
    });
  }
  return Status::Ok();
}

uint16_t HttpServer::port() const { return impl_->bound_port; }

void HttpServer::Stop(std::chrono::milliseconds grace) {
  Impl& s = *impl_;
  if (s.threads.empty()) return;
  s.stopping = true;
  asio::post(s.ioc, [&s] {
    beast::error_code ignored;
    if (s.acceptor) s.acceptor->close(ignored);
  });
  {
    std::lock_guard<std::mutex> lock(s.parked_mu);
    for (const auto& timer : s.parked) {
      asio::post(timer->get_executor(), [timer] { timer->cancel(); });
    }
  }
  std::this_thread::sleep_for(grace);  // let answers in flight go out
  s.ioc.stop();
  for (auto& t : s.threads) t.join();
  s.threads.clear();
}

}  // namespace loom::http
