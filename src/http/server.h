// HttpServer: HTTP/1.1 (keep-alive) on Boost.Beast + Asio with C++20
// coroutines, serving a RequestHandler (the Tinker API's Router, or a sampler
// replica's API) on a few I/O threads. A pending
// retrieve_future is parked on a timer that the future's completion cancels,
// so thousands of held polls cost no threads and I/O threads never wait on
// the engine.
//
// Invariants:
//  - I/O threads do only bounded work: they read and write, and handle a
//    request inline only when HeavyFor() says it is cheap. Heavy
//    requests (zstd, protobuf, large bodies) run on a decode pool of
//    decode_threads, at most decode_queue queued or running (then 503), at
//    most half of that for one tenant (then 429); both are retryable.
//  - at most max_connections are open; one more is answered 503 and closed.
//    The cap stays below RLIMIT_NOFILE minus kReservedFds, so the store and
//    the engine always have descriptors; when accept fails anyway (EMFILE),
//    accepting pauses briefly instead of spinning.
//  - on Stop, every request whose header was read gets an answer: its real
//    one, or 503 "shutting down" when it arrived after Stop began.
//
// Beast stays inside server.cpp; this header is cheap to include.
// Threading: Start/Stop from one controlling thread; requests are served on
// the server's own I/O threads and decode pool.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "http/handler.h"

namespace loom::service {
class FutureTable;
}

namespace loom::http {

// Descriptors kept free for the store, the engine and logs (see max_connections).
constexpr int kReservedFds = 128;
// The most connections (at most `wanted`, at least 1) that leave kReservedFds
// of open_files_limit (RLIMIT_NOFILE) free; half of it when it is tiny.
int ConnectionCapWithin(int wanted, int64_t open_files_limit);

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;                  // 0 = pick a free port (see port())
  int io_threads = 2;
  int decode_threads = 2;             // --decode-threads: pool for heavy requests
  int decode_queue = 16;              // --decode-queue: heavy requests queued or running
  int max_connections = 1024;         // --max-connections (lowered to fit RLIMIT_NOFILE)
  size_t max_body_bytes = size_t{512} << 20;
  std::chrono::milliseconds poll_hold{std::chrono::seconds(30)};  // < the SDK's 45 s timeout
  std::chrono::seconds idle_timeout{std::chrono::seconds(120)};   // keep-alive connections
  // Stop waits this long at most for requests already read to be answered.
  std::chrono::milliseconds shutdown_drain{std::chrono::seconds(10)};
};

class HttpServer {
 public:
  // handler: the Tinker API (Router) or a replica's API; futures: where its
  // parked requests' futures complete.
  HttpServer(RequestHandler& handler, service::FutureTable& futures, ServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and starts the I/O threads. Invalid when the address can't be bound.
  // Raises the soft RLIMIT_NOFILE toward max_connections + kReservedFds when
  // the hard limit allows, else lowers the connection cap (and logs it).
  Status Start();
  // The bound port (after Start).
  uint16_t port() const;
  // The connection cap in force (after Start).
  int max_connections() const;
  // Stops accepting; answers parked polls with try_again; waits (up to
  // shutdown_drain) until every request already read has its answer and no
  // new one arrived for `grace`; then closes the connections.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(500));

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::http
