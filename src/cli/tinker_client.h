// TinkerClient: loom's own blocking client of the Tinker HTTP API, for the
// demo and tools: JSON routes, protobuf forward_backward and asample answers,
// retrieve_future long-polls (repeated on try_again). One client = one API
// key = one tenant, with at most one training model and its seq_id counter.
//
// Invariant: the model's requests carry seq_ids 1, 2, 3, ... in submit order.
// Threading: one thread per client object; each call opens its own
// loopback connection, so many clients may run in parallel.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "engine/api.h"

namespace loom::cli {

struct HttpReply {
  int status = 0;
  std::string content_type;
  std::string body;
};

class TinkerClient {
 public:
  TinkerClient(std::string host, uint16_t port, std::string api_key);

  // One HTTP exchange (Unavailable when the connection fails).
  Result<HttpReply> Call(const std::string& method, const std::string& target, const std::string& body,
                         const std::string& content_type = "application/json", const std::string& accept = "");
  // POST /api/v1/<route> with a JSON body; a non-2xx answer becomes a Status
  // carrying the server's message.
  Result<nlohmann::json> PostJson(const std::string& route, const nlohmann::json& body);
  // retrieve_future until the answer is final; a failed future is its error.
  Result<HttpReply> Retrieve(const std::string& request_id, bool protobuf);
  Result<nlohmann::json> AwaitJson(const std::string& request_id);

  // ---- one training model ----
  Status CreateModel(const std::string& base_model, int rank, uint64_t seed);
  Result<std::string> SubmitForwardBackward(const engine::ForwardBackwardCall& call);
  Result<engine::ForwardBackwardOutput> AwaitForwardBackward(const std::string& request_id);
  Result<std::string> SubmitOptimStep(const engine::AdamParams& adam);
  // Greedy (temperature 0) continuation of prompt: from the model's weights
  // saved now for the sampler under `snapshot`, or from base_model when
  // snapshot is "".
  Result<std::vector<int32_t>> Greedy(const std::vector<int32_t>& prompt, int max_tokens,
                                      const std::string& snapshot, const std::string& base_model);

  const std::string& model_id() const { return model_id_; }

 private:
  std::string host_;
  uint16_t port_;
  std::string key_;
  std::string session_id_;
  std::string model_id_;
  int64_t seq_ = 1;
  int64_t sampling_seq_ = 0;
};

}  // namespace loom::cli
