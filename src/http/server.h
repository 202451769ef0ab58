// HttpServer: HTTP/1.1 (keep-alive) on Boost.Beast + Asio with C++20
// coroutines, serving a Router on a few I/O threads. A pending
// retrieve_future is parked on a timer that the future's completion cancels,
// so thousands of held polls cost no threads and I/O threads never wait on
// the engine.
//
// Beast stays inside server.cpp; this header is cheap to include.
// Threading: Start/Stop from one controlling thread; requests are served on
// the server's own I/O threads.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "http/router.h"

namespace loom::http {

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;                  // 0 = pick a free port (see port())
  int io_threads = 2;
  size_t max_body_bytes = size_t{512} << 20;
  std::chrono::milliseconds poll_hold{std::chrono::seconds(30)};  // < the SDK's 45 s timeout
  std::chrono::seconds idle_timeout{std::chrono::seconds(120)};   // keep-alive connections
};

class HttpServer {
 public:
  HttpServer(Router& router, service::FutureTable& futures, ServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and starts the I/O threads. Invalid when the address can't be bound.
  Status Start();
  // The bound port (after Start).
  uint16_t port() const;
  // Stops accepting; answers parked polls with try_again; closes within grace.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(500));

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::http
