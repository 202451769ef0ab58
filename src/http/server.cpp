// The only translation unit that includes Boost.Beast (about 30 s to compile).
#include <utility>  // before asio: Boost 1.74's awaitable.hpp misses it

#include "http/server.h"

#include <sys/resource.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "common/log.h"
#include "common/tenant_gate.h"
#include "http/router.h"
#include "service/future_table.h"

namespace loom::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

namespace {
constexpr auto kTuple = asio::as_tuple(asio::use_awaitable);
// A failed accept (EMFILE, ENFILE, ENOBUFS) fails again at once: pause this
// long before the next one instead of spinning a core.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(50);

// Counts one thing (a request in flight) while alive.
class Counted {
 public:
  explicit Counted(std::atomic<int>& n) : n_(n) { ++n_; }
  ~Counted() { --n_; }
  Counted(const Counted&) = delete;
  Counted& operator=(const Counted&) = delete;

 private:
  std::atomic<int>& n_;
};

bhttp::response<bhttp::string_body> ToBeast(const HttpResponse& answer, unsigned version, bool keep_alive) {
  bhttp::response<bhttp::string_body> res{static_cast<bhttp::status>(answer.status), version};
  res.set(bhttp::field::server, "loom");
  res.set(bhttp::field::content_type, answer.content_type);
  for (const auto& [k, v] : answer.headers) res.set(k, v);
  res.keep_alive(keep_alive);
  res.body() = answer.body;
  res.prepare_payload();
  return res;
}

// The answer to a read that failed by the client's fault (malformed, too
// large); nullopt when the connection closed or timed out (nobody to answer).
std::optional<HttpResponse> ReadErrorAnswer(const beast::error_code& ec, size_t max_body_bytes) {
  if (ec == bhttp::error::body_limit) {
    return Router::Error(Status(Code::kPayloadTooLarge, "body: larger than the server's limit of " +
                                                            std::to_string(max_body_bytes) +
                                                            " bytes (--max-body-bytes)"));
  }
  if (ec.category() != bhttp::make_error_code(bhttp::error::bad_method).category()) return std::nullopt;
  if (ec == bhttp::error::end_of_stream || ec == bhttp::error::partial_message || ec == bhttp::error::short_read ||
      ec == bhttp::error::need_more || ec == bhttp::error::need_buffer || ec == bhttp::error::stale_parser) {
    return std::nullopt;
  }
  // Both framings at once is request smuggling's tool (RFC 9112 §6.1): refuse, never guess.
  std::string why = "malformed HTTP request: " + ec.message();
  if (ec == bhttp::error::bad_transfer_encoding) {
    why = "Transfer-Encoding: not allowed together with Content-Length, or sent twice (RFC 9112 section 6.1)";
  } else if (ec == bhttp::error::bad_content_length) {
    why = "Content-Length: not a valid length, or sent together with Transfer-Encoding: chunked "
          "(RFC 9112 section 6.1)";
  } else if (ec == bhttp::error::multiple_content_length) {
    why = "Content-Length: sent more than once with different values";
  }
  return Router::Error(Status::Invalid(why));
}

// The connection cap that leaves kReservedFds of RLIMIT_NOFILE to the rest
// of the process; raises the soft limit toward the hard one first.
int FitConnectionCap(int wanted) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return wanted;
  const rlim_t need = static_cast<rlim_t>(wanted) + kReservedFds;
  if (rl.rlim_cur < need) {
    rlimit raised = rl;
    raised.rlim_cur = rl.rlim_max == RLIM_INFINITY ? need : std::min(need, rl.rlim_max);
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) rl = raised;
  }
  const int64_t soft = static_cast<int64_t>(rl.rlim_cur);
  const int fit = ConnectionCapWithin(wanted, soft);
  if (fit < wanted) {
    log::Warn("http_connection_cap max_connections={} asked={} open_files_limit={} reserved_fds={} "
              "(RLIMIT_NOFILE is too low for --max-connections; raise ulimit -n)",
              fit, wanted, soft, kReservedFds);
  }
  return fit;
}
}  // namespace

int ConnectionCapWithin(int wanted, int64_t open_files_limit) {
  const int64_t fit = open_files_limit > 2 * kReservedFds ? open_files_limit - kReservedFds
                                                          : std::max<int64_t>(1, open_files_limit / 2);
  return static_cast<int>(std::min<int64_t>(wanted, fit));
}

struct HttpServer::Impl {
  RequestHandler& router;
  service::FutureTable& futures;
  ServerOptions options;
  asio::io_context ioc;
  std::unique_ptr<asio::thread_pool> decode_pool;
  // Keeps ioc.run() going while every coroutine is away on the decode pool.
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> keep_running;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::vector<std::thread> threads;
  std::atomic<bool> stopping{false};
  uint16_t bound_port = 0;
  int max_connections = 0;          // in force (FitConnectionCap)
  std::atomic<int> connections{0};  // open, served by Serve()
  std::atomic<int> in_flight{0};    // requests whose header was read, until answered

  // Heavy requests on the decode pool, in all and by tenant.
  TenantGate decode_gate;

  // Parked polls, so Stop() can wake them.
  std::mutex parked_mu;
  std::set<std::shared_ptr<asio::steady_timer>> parked;

  Impl(RequestHandler& r, service::FutureTable& f, ServerOptions o)
      : router(r), futures(f), options(std::move(o)), decode_gate(options.decode_queue) {}

  asio::awaitable<void> Accept() {
    asio::steady_timer backoff(co_await asio::this_coro::executor);
    bool accept_failing = false, at_cap = false;  // log each episode once
    while (!stopping) {
      auto [ec, socket] = co_await acceptor->async_accept(asio::make_strand(ioc), kTuple);
      if (ec) {
        if (stopping || ec == asio::error::operation_aborted) break;
        if (ec == asio::error::connection_aborted) continue;  // that client gave up; the next accept is fine
        if (!accept_failing) {
          log::Warn("http_accept_failing error={} open_connections={} (pausing {} ms between accepts until one "
                    "succeeds)",
                    ec.message(), connections.load(), kAcceptBackoff.count());
          accept_failing = true;
        }
        backoff.expires_after(kAcceptBackoff);
        co_await backoff.async_wait(kTuple);
        continue;
      }
      if (accept_failing) {
        log::Info("http_accept_recovered open_connections={}", connections.load());
        accept_failing = false;
      }
      if (connections >= max_connections) {
        if (!at_cap) log::Warn("http_connection_cap_reached max_connections={} (answering 503)", max_connections);
        at_cap = true;
        Refuse(socket);
        continue;
      }
      at_cap = false;
      beast::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      ++connections;  // Serve() counts it down
      auto exec = socket.get_executor();
      asio::co_spawn(exec, Serve(std::move(socket)), asio::detached);
    }
  }

  // Answers a connection over the cap with 503 at once and closes it; it
  // never waits, so a flood of them costs the accept loop nothing.
  void Refuse(auto& socket) {
    HttpResponse busy = Router::Error(Status::Unavailable(
        "server busy: " + std::to_string(max_connections) +
        " connections are open, the most it serves (--max-connections); retry shortly"));
    busy.headers.emplace_back("Retry-After", "1");
    auto res = ToBeast(busy, 11, /*keep_alive=*/false);
    beast::error_code ec;
    socket.non_blocking(true, ec);
    bhttp::write(socket, res, ec);  // a few hundred bytes into an empty send buffer
    // Discard what the client already sent, so that close() sends FIN, not RST.
    char sink[4096];
    for (int i = 0; i < 16 && !ec; ++i) socket.read_some(asio::buffer(sink), ec);
    socket.shutdown(tcp::socket::shutdown_both, ec);
    socket.close(ec);
  }

  static HttpRequest Convert(bhttp::request<bhttp::string_body>&& req) {
    HttpRequest r;
    r.method = std::string(req.method_string());
    r.target = std::string(req.target());
    for (const auto& field : req) {
      std::string name(field.name_string());
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      const bool inserted = r.headers.insert_or_assign(name, std::string(field.value())).second;
      if (!inserted && std::find(r.repeated_headers.begin(), r.repeated_headers.end(), name) == r.repeated_headers.end()) {
        r.repeated_headers.push_back(name);
      }
    }
    r.body = std::move(req.body());
    return r;
  }

  // Takes a place on the decode pool for one heavy request of `tenant`, or
  // says why not (both answers are retryable).
  Status AdmitDecode(const std::string& tenant) {
    int held = 0;
    switch (decode_gate.Enter(tenant, &held)) {
      case TenantGate::Verdict::kEntered:
        return Status::Ok();
      case TenantGate::Verdict::kFull:
        return Status::Unavailable("server busy: " + std::to_string(held) +
                                   " request bodies are being decoded, the most it queues (--decode-queue " +
                                   std::to_string(options.decode_queue) + "); retry shortly");
      case TenantGate::Verdict::kTenantFull:  // one tenant may hold half, so another's requests still get in
        return Status::Exhausted("body: this key already has " + std::to_string(held) +
                                 " request bodies being decoded, the most one tenant may (half of --decode-queue " +
                                 std::to_string(options.decode_queue) + "); retry when one is answered");
    }
    return Status::Internal("unreachable");
  }
  void ReleaseDecode(const std::string& tenant) { decode_gate.Leave(tenant); }

  // Runs the router on the decode pool: the coroutine hops onto a pool
  // thread and back onto its connection's strand. The I/O thread serves
  // others meanwhile; nothing else touches this connection until it is back.
  asio::awaitable<RouteOutcome> HandleOnPool(const HttpRequest& request) {
    auto exec = co_await asio::this_coro::executor;
    co_await asio::post(asio::bind_executor(decode_pool->get_executor(), asio::use_awaitable));
    RouteOutcome out;
    try {
      out = router.Handle(request);
    } catch (const std::exception& e) {  // e.g. bad_alloc: answer it, keep the pool thread
      log::Error("decode_exception target={} what={}", request.target, e.what());
      out.response = Router::Error(Status::Internal(std::string("internal error: ") + e.what()));
    }
    co_await asio::post(exec, asio::use_awaitable);
    co_return out;
  }

  // Handle(), inline when it is bounded, else on the decode pool.
  asio::awaitable<RouteOutcome> Route(const HttpRequest& request) {
    const std::string tenant = router.HeavyFor(request);
    if (tenant.empty()) co_return router.Handle(request);
    if (Status admitted = AdmitDecode(tenant); !admitted.ok()) {
      RouteOutcome busy;
      busy.response = Router::Error(admitted);
      if (admitted.code() == Code::kUnavailable) busy.response.headers.emplace_back("Retry-After", "1");
      co_return busy;
    }
    RouteOutcome out = co_await HandleOnPool(request);
    ReleaseDecode(tenant);
    co_return out;
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
    auto res = ToBeast(answer, version, keep_alive);
    stream.expires_after(std::chrono::seconds(60));
    auto [ec, n] = co_await bhttp::async_write(stream, res, kTuple);
    *ok = !ec;
  }

  asio::awaitable<void> Serve(tcp::socket socket) {
    struct Leave {
      std::atomic<int>& n;
      ~Leave() { --n; }
    } leave{connections};  // counted up by Accept()
    beast::tcp_stream stream(std::move(socket));
    beast::flat_buffer buffer;
    // Reads even while stopping: a request already sent on a kept-alive
    // connection gets "shutting down", not a silent close.
    while (true) {
      bhttp::request_parser<bhttp::string_body> parser;
      parser.body_limit(options.max_body_bytes);
      parser.header_limit(64 * 1024);
      stream.expires_after(options.idle_timeout);
      auto [ec, n] = co_await bhttp::async_read_header(stream, buffer, parser, kTuple);
      std::optional<Counted> answering;  // from the header on, Stop() waits for this answer
      if (!ec) {
        answering.emplace(in_flight);
        std::tie(ec, n) = co_await bhttp::async_read(stream, buffer, parser, kTuple);
      }
      if (ec) {
        if (auto answer = ReadErrorAnswer(ec, options.max_body_bytes)) {
          bool ok = false;
          co_await Write(stream, *answer, 11, /*keep_alive=*/false, &ok);
        }
        break;  // else closed, timed out
      }
      const bool keep_alive = parser.get().keep_alive();
      const unsigned version = parser.get().version();
      const bool late = stopping;  // read after Stop() began
      HttpRequest request = Convert(parser.release());
      const auto t0 = std::chrono::steady_clock::now();
      RouteOutcome outcome;
      if (late) {
        outcome.response = Router::Error(Status::Unavailable("server shutting down; retry on its next start"));
      } else {
        outcome = co_await Route(request);
      }
      if (!outcome.park_request_id.empty()) {
        co_await Park(outcome.park_request_id);
        outcome.response = router.AnswerPoll(request, outcome.park_request_id);
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
      const bool keep = keep_alive && !stopping;
      co_await Write(stream, outcome.response, version, keep, &ok);
      if (!ok || !keep) break;
    }
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }
};

HttpServer::HttpServer(RequestHandler& router, service::FutureTable& futures, ServerOptions options)
    : impl_(std::make_unique<Impl>(router, futures, std::move(options))) {}

HttpServer::~HttpServer() { Stop(std::chrono::milliseconds(0)); }

Status HttpServer::Start() {
  Impl& s = *impl_;
  if (s.options.max_connections < 1) return Status::Invalid("--max-connections: must be >= 1");
  if (s.options.decode_threads < 1) return Status::Invalid("--decode-threads: must be >= 1");
  if (s.options.decode_queue < 1) return Status::Invalid("--decode-queue: must be >= 1");
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
  s.max_connections = FitConnectionCap(s.options.max_connections);
  s.decode_pool = std::make_unique<asio::thread_pool>(static_cast<size_t>(s.options.decode_threads));
  s.keep_running.emplace(asio::make_work_guard(s.ioc));
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

int HttpServer::max_connections() const { return impl_->max_connections; }

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
  // Every request already read gets its answer; then `grace` without a new
  // one lets requests still on the wire of kept-alive connections in.
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + s.options.shutdown_drain;
  auto quiet_since = Clock::now();
  while (Clock::now() < deadline) {
    if (s.in_flight > 0) {
      quiet_since = Clock::now();
    } else if (Clock::now() - quiet_since >= grace) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (s.in_flight > 0) {
    log::Warn("http_shutdown_drain_timeout unanswered_requests={} drain_ms={}", s.in_flight.load(),
              s.options.shutdown_drain.count());
  }
  s.keep_running.reset();
  s.ioc.stop();
  for (auto& t : s.threads) t.join();
  s.threads.clear();
  // Decodes not started are dropped with their connections; a running one finishes first.
  if (s.decode_pool) {
    s.decode_pool->stop();
    s.decode_pool->join();
  }
}

}  // namespace loom::http
