// `loom serve --role sampler`: a sampler replica. It loads the base model
// and a Sampler of its own, and serves only the internal replica API
// (replica/replica_api.h) to a gateway (`loom serve --sampler-replicas`).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "engine/sample_api.h"

namespace loom::cli {

struct SamplerReplicaServing {
  std::string host;
  int port = 0;
  int io_threads = 2;
  int decode_threads = 2;
  int decode_queue = 16;
  int max_connections = 1024;
  size_t max_body_bytes = 0;
  std::chrono::milliseconds poll_hold{30000};
  std::string key;  // X-Replica-Key; "" = loopback only
};

// Runs until SIGTERM / SIGINT (blocked by the caller); the exit code.
int ServeSamplerReplica(const std::string& model_dir, const std::string& device, engine::SamplerOptions options,
                        const SamplerReplicaServing& serving);

}  // namespace loom::cli
