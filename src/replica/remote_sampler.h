// RemoteSampler: the gateway's Sampler when sampling runs on replicas
// (`loom serve --sampler-replicas HOST:PORT,...`), each its own `loom serve
// --role sampler` process on its own GPU. The Service sees the same
// engine::Sampler face as in the colocated mode; behind it every call goes
// to one replica over the internal API (replica_api.h).
//
// Routing: a call goes to a live replica that was last sent its snapshot
// (an LRU per replica as long as the replica's adapter cache), so the
// version is warm there; among those, and when none has it, to the one with
// the fewest sample rows in flight. A warm replica is passed over when it has
// more than one full batch (max_num_samples rows) beyond the least loaded.
//
// Failure: a replica is down when a call to it fails at the transport
// (refused, reset, EOF: a killed process) or when its health check (every
// health_period) has no answer within health_timeout (a hung process).
// Marking it down closes every connection to it; each call that was in
// flight there is submitted again to another live replica, so no call is
// lost while one replica lives. A down replica is checked again each
// period and takes calls as soon as it answers (a restart loses nothing
// but its cache). With no live replica a call waits up to no_replica_wait,
// then fails Unavailable (the SDK retries it).
//
// Snapshots: replicas read the committed PEFT directories from the shared
// snapshot store (the gateway's data dir, on a shared filesystem across
// machines); Offer() is a no-op.
//
// Threading: every method may be called from any thread. One I/O thread
// runs every exchange and completes the callbacks.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/sample_api.h"

namespace loom::replica {

struct RemoteOptions {
  std::vector<std::string> replicas;  // HOST:PORT each
  std::string key;                    // X-Replica-Key; "" = none
  std::chrono::milliseconds health_period{500};
  std::chrono::milliseconds health_timeout{2000};
  // A retrieve long-poll answers within the replica's poll hold (30 s by
  // default); past this the exchange counts as a transport failure.
  std::chrono::milliseconds poll_timeout{60000};
  std::chrono::milliseconds no_replica_wait{30000};
  // Open() waits this long for the first replica to answer its info.
  std::chrono::milliseconds open_wait{60000};
};

// One replica as the gateway sees it (for logs, tests and /metrics).
struct ReplicaView {
  std::string address;
  bool up = false;
  int64_t rows_in_flight = 0;
  int64_t routed = 0;     // calls sent to it
  int64_t warm_hits = 0;  // of those, to a replica that had the snapshot warm
  int64_t downs = 0;      // times it was marked down
};

struct RoutingStats {
  std::vector<ReplicaView> replicas;
  int64_t resubmitted = 0;  // calls submitted again after their replica failed
};

class RemoteSampler final : public engine::Sampler {
 public:
  // Reads every reachable replica's info (at least one within open_wait):
  // their vocabularies and context windows must agree; the limits the
  // gateway validates against are the smallest of them.
  static Result<std::unique_ptr<RemoteSampler>> Open(const RemoteOptions& options);
  ~RemoteSampler() override;

  const engine::SamplerInfo& info() const override;
  Status Validate(const engine::SampleCall& call) const override;
  void Submit(engine::SampleCall call, engine::SampleCallback done) override;
  void Cancel(const std::string& session, const Status& why) override;
  void Offer(const std::string&, std::shared_ptr<const engine::SlotSnapshot>) override {}
  // The replicas' counters, summed as of their last health answers, with
  // the routing's own (replicas, replicas_live, resubmitted).
  engine::SamplerStats stats() const override;

  RoutingStats routing() const;

  struct Impl;

 private:
  explicit RemoteSampler(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::replica
