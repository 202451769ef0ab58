#include "cli/serve_replica.h"

#include <csignal>
#include <cstdio>
#include <pthread.h>

#include "common/log.h"
#include "http/server.h"
#include "replica/replica_handler.h"
#include "service/future_table.h"

namespace loom::cli {

int ServeSamplerReplica(const std::string& model_dir, const std::string& device, engine::SamplerOptions options,
                        const SamplerReplicaServing& serving) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  options.model_dir = model_dir;
  auto sampler = engine::Sampler::OpenStandalone(device, "auto", options);
  if (!sampler.ok()) {
    std::fprintf(stderr, "loom serve: --role sampler: %s\n", sampler.status().message().c_str());
    return 2;
  }
  // Ten minutes: a gateway retrieves an answer within its poll hold; only
  // an answer lost in transit is asked for again.
  service::FutureTable futures("replica-" + std::to_string(::getpid()), std::chrono::minutes(10));
  replica::ReplicaHandler handler(**sampler, futures, serving.key, model_dir);
  http::ServerOptions hopt;
  hopt.host = serving.host;
  hopt.port = static_cast<uint16_t>(serving.port);
  hopt.io_threads = serving.io_threads;
  hopt.decode_threads = serving.decode_threads;
  hopt.decode_queue = serving.decode_queue;
  hopt.max_connections = serving.max_connections;
  if (serving.max_body_bytes > 0) hopt.max_body_bytes = serving.max_body_bytes;
  hopt.poll_hold = serving.poll_hold;
  http::HttpServer server(handler, futures, hopt);
  if (Status st = server.Start(); !st.ok()) {
    std::fprintf(stderr, "loom serve: %s\n", st.message().c_str());
    return 2;
  }
  const engine::SamplerInfo& info = (*sampler)->info();
  std::printf("loom serve: listening on http://%s:%u role=sampler model=%s kv_tokens=%lld sampler_adapters=%d "
              "max_rank=%d context_window=%lld%s\n",
              serving.host.c_str(), server.port(), model_dir.c_str(), static_cast<long long>(info.kv_tokens),
              info.sampler_adapters, info.max_rank, static_cast<long long>(info.context_window),
              serving.key.empty() ? " auth=loopback" : " auth=replica-key");
  std::fflush(stdout);
  int sig = 0;
  sigwait(&signals, &sig);
  log::Info("shutdown signal={}", sig);
  server.Stop();   // parked polls answer try_again; the gateway polls again or fails over
  sampler->reset();  // queued and running samples fail "shutting down": the gateway resubmits them elsewhere
  log::Info("shutdown complete");
  return 0;
}

}  // namespace loom::cli
