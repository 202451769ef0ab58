// ReplicaHandler: the internal API of a sampler replica (`loom serve --role
// sampler`, replica_api.h) over one Sampler. A gateway (remote_sampler.h)
// submits samples here and long-polls their answers; this process holds no
// sessions, tenants or registry: the gateway has checked those, and the
// snapshot directories it names are read from the shared snapshot store.
//
// Invariants: a sample is a future of this replica's FutureTable from
// submit until it is retrieved or swept (10 minutes after it finished); a
// replica answers only its key's calls (X-Replica-Key), or any loopback
// call when it has no key.
//
// Thread-safe: the server's I/O threads call it; the sampler's decode
// thread completes the futures.
#pragma once
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>

#include "engine/sample_api.h"
#include "http/handler.h"
#include "service/future_table.h"

namespace loom::replica {

class ReplicaHandler final : public http::RequestHandler {
 public:
  // sampler and futures outlive the handler; key "" = none.
  ReplicaHandler(engine::Sampler& sampler, service::FutureTable& futures, std::string key, std::string model_dir);

  http::RouteOutcome Handle(const http::HttpRequest& request) override;
  http::HttpResponse AnswerPoll(const http::HttpRequest& request, const std::string& request_id) override;
  std::string HeavyFor(const http::HttpRequest& request) const override;

  // Samples submitted and not yet answered by the sampler.
  int in_flight() const { return in_flight_.load(); }

 private:
  http::HttpResponse Submit(const http::HttpRequest& request);
  http::RouteOutcome Retrieve(const http::HttpRequest& request);
  http::HttpResponse Cancel(const http::HttpRequest& request);
  // The finished future's answer (protobuf SampleResponse or its error), or
  // nothing while it is pending.
  std::optional<http::HttpResponse> Answer(const std::string& request_id);

  engine::Sampler& sampler_;
  service::FutureTable& futures_;
  const std::string key_;
  const std::string model_dir_;
  std::atomic<int> in_flight_{0};
  std::mutex sweep_mu_;
  std::chrono::steady_clock::time_point last_sweep_{};
};

}  // namespace loom::replica
