// What the Service answers (spec §5, §8.8): one typed result per operation.
// Asynchronous operations complete their future with a FutureResult; direct
// answers and REST listings return their own type. wire/ encodes all of them.
//
// Plain data; no thread rules.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "tinker/path.h"
#include "tinker/requests.h"
#include "tinker/types.h"

namespace loom::tinker {

// ---------------------------------------------------- future results (§6)

struct CreateModelResult {
  std::string model_id;
};
struct UnloadModelResult {
  std::string model_id;
};
struct OptimStepResult {
  std::map<std::string, double> metrics;  // "skipped" = 1 when a non-finite gradient skipped the step
};
struct SaveWeightsResult {
  TinkerPath path;
};
// load_weights, and create_model_via_load_weights (model_id = the new model).
struct LoadWeightsResult {
  TinkerPath path;
  std::string model_id;
};
struct SaveWeightsForSamplerResult {
  std::optional<TinkerPath> path;
  std::optional<std::string> sampling_session_id;  // unnamed saves: the sampler made for it
};

// What a finished request produced (forward / forward_backward: the
// ForwardBackwardOutput; asample: the SampleOutput).
using FutureResult = std::variant<CreateModelResult, UnloadModelResult, ForwardBackwardOutput, OptimStepResult,
                                  SaveWeightsResult, LoadWeightsResult, SaveWeightsForSamplerResult, SampleOutput>;

// ------------------------------------------------------- direct answers

struct ModelData {
  std::string arch;                     // e.g. "qwen3"
  std::string model_name;               // HF repo id the tokenizer loads from
  std::string tokenizer_id;
};
struct GetInfoResult {                  // POST /api/v1/get_info
  std::string model_id;
  ModelData model_data;
  std::optional<int64_t> lora_rank;
};
struct WeightsInfoResult {              // POST /api/v1/weights_info
  std::string base_model;
  LoraConfig lora;
};
struct SamplingSessionInfo {            // GET /api/v1/samplers/{id}
  std::string sampler_id;
  std::string base_model;
  std::optional<TinkerPath> model_path;
};

// ----------------------------------------------------------- REST (§8.8)

struct Cursor {
  int64_t offset = 0;
  int64_t limit = 0;
  int64_t total_count = 0;
};

struct Checkpoint {
  TinkerPath path;                      // gives checkpoint_id, checkpoint_type, tinker_path
  int64_t time = 0;                     // unix seconds
  std::optional<int64_t> size_bytes;
  bool is_public = false;
  std::optional<int64_t> expires_at;    // unix seconds
};

struct TrainingRun {
  std::string training_run_id;
  std::string base_model;
  std::string model_owner;
  bool is_lora = true;
  int64_t last_request_time = 0;        // unix seconds
  bool corrupted = false;
  std::optional<int64_t> lora_rank;
  std::optional<Checkpoint> last_checkpoint;
  std::optional<Checkpoint> last_sampler_checkpoint;
  UserMetadata user_metadata;
};

struct TrainingRunsPage {
  std::vector<TrainingRun> runs;
  Cursor cursor;
};
struct CheckpointsPage {
  std::vector<Checkpoint> checkpoints;
  std::optional<Cursor> cursor;
};
struct SessionsPage {
  std::vector<std::string> session_ids;
};
struct SessionInfo {                    // GET /api/v1/sessions/{id}
  std::vector<std::string> training_run_ids;
  std::vector<std::string> sampler_ids;
};

}  // namespace loom::tinker
