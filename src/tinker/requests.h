// The requests the Service takes (spec §5), already parsed and range-checked
// by wire/ (or built by a C++ caller). Field comments give the wire names
// where they differ.
//
// Plain data; no thread rules.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tinker/path.h"
#include "tinker/types.h"

namespace loom::tinker {

using UserMetadata = std::map<std::string, std::string>;  // non-string values kept as JSON text

struct CreateSessionRequest {           // POST /api/v1/create_session
  std::vector<std::string> tags;
  UserMetadata user_metadata;
  std::optional<std::string> sdk_version;
  std::optional<std::string> project_id;
};

struct CreateModelRequest {             // POST /api/v1/create_model
  std::string session_id;
  int64_t model_seq_id = 0;
  std::string base_model;
  UserMetadata user_metadata;
  LoraConfig lora;                      // rank, seed, train_*; alpha left at the engine default
  bool seed_given = false;              // lora_config.seed present (else the service picks one)
};

// A forward_backward submit (forward_only included).
struct ForwardBackwardRequest {
  std::string model_id;
  int32_t seq_id = 0;
  ForwardBackwardInput call;
};

struct OptimStepRequest {               // POST /api/v1/optim_step
  std::string model_id;
  int64_t seq_id = 0;
  AdamParams adam_params;
};

struct SaveWeightsRequest {             // POST /api/v1/save_weights (save_state)
  std::string model_id;
  int64_t seq_id = 0;
  std::optional<std::string> name;      // `path`: a checkpoint name, not a URI
  std::optional<int64_t> ttl_seconds;   // absent = never expires
  bool overwrite = false;
};

struct LoadWeightsRequest {             // POST /api/v1/load_weights
  enum class Mode { kTrainingClient, kCreateModel };
  Mode mode = Mode::kTrainingClient;
  // kTrainingClient: model_id + seq_id.
  std::string model_id;
  int64_t seq_id = 0;
  // kCreateModel (create_model_via_load_weights): session_id + model_seq_id.
  std::string session_id;
  int64_t model_seq_id = 0;
  std::optional<std::string> base_model;
  UserMetadata user_metadata;
  // Both modes.
  TinkerPath path;                      // must be a /weights/ checkpoint
  bool optimizer = false;
  std::optional<std::string> weights_access_token;
};

struct SaveWeightsForSamplerRequest {   // POST /api/v1/save_weights_for_sampler
  std::string model_id;
  int64_t seq_id = 0;
  std::optional<std::string> name;                  // named: `path`
  std::optional<int64_t> ttl_seconds;
  std::optional<int64_t> sampling_session_seq_id;   // unnamed: the server makes a sampler
  bool named() const { return name.has_value(); }
};

struct CreateSamplingSessionRequest {   // POST /api/v1/create_sampling_session
  std::string session_id;
  int64_t sampling_session_seq_id = 0;
  std::optional<std::string> base_model;
  std::optional<std::string> model_path;  // starts with tinker:// (the wire checks no more, as the SDK)
};

struct SampleRequest {                  // POST /api/v1/asample
  std::string sampling_session_id;
  int64_t seq_id = 0;                 // may exceed 2^31
  int32_t num_samples = 1;
  std::vector<int32_t> prompt;        // encoded_text chunks concatenated
  SamplingParams sampling_params;
  bool prompt_logprobs = false;
  int32_t topk_prompt_logprobs = 0;   // 0 = off
  std::optional<std::string> base_model;   // in the model, unused by the high-level SDK
  std::optional<std::string> model_path;
};

// Limit/offset of a REST listing, with the SDK's defaults.
struct PageParams {
  int64_t limit = 20;
  int64_t offset = 0;
};

}  // namespace loom::tinker
