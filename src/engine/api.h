// The engine's public face: plain C++ types, no tensors. This is the only
// engine header that service/ and above may include (so they compile without
// libtorch's 20 s headers and start without its runtime cost).
//
// Threading: an Engine is owned by one engine thread. Every method except
// info() and Validate*() must be called from that thread only. Validate*()
// are pure and may run on I/O threads.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace loom::engine {

class Transformer;  // engine/model/transformer.h; opaque here (no tensors above engine/)

// A dense row-major array, as carried by Tinker's TensorData (loss_fn_inputs
// and per-datum outputs). Exactly one of f32 / i64 holds numel() values.
struct Array {
  enum class DType { kFloat32, kInt64 };
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<float> f32;
  std::vector<int64_t> i64;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  static Array Floats(std::vector<float> v) {
    Array a;
    a.shape = {static_cast<int64_t>(v.size())};
    a.f32 = std::move(v);
    return a;
  }
  static Array Ints(std::vector<int64_t> v) {
    Array a;
    a.dtype = DType::kInt64;
    a.shape = {static_cast<int64_t>(v.size())};
    a.i64 = std::move(v);
    return a;
  }
};

// One training example: the model input tokens and the loss inputs, each with
// leading dimension tokens.size() (position t predicts target_tokens[t]).
struct Datum {
  std::vector<int32_t> tokens;
  std::map<std::string, Array> loss_fn_inputs;
};

// Tinker's LoraConfig plus loom's per-slot alpha. Scale = alpha / rank.
struct LoraConfig {
  int rank = 32;
  double alpha = 32.0;
  uint64_t seed = 0;
  bool train_attn = true;     // q, k, v, o
  bool train_mlp = true;      // gate, up, down
  bool train_unembed = true;  // lm_head
};

struct ForwardBackwardCall {
  int slot = -1;
  std::vector<Datum> data;
  std::string loss_fn = "cross_entropy";
  std::map<std::string, double> loss_fn_config;
  bool forward_only = false;
};

struct ForwardBackwardOutput {
  // One map per datum, in datum order: "logprobs" always, "elementwise_loss".
  std::vector<std::map<std::string, Array>> outputs;
  // "name:reduction" keys, exactly one colon each (e.g. "loss:sum").
  std::map<std::string, double> metrics;
};

// Tinker's AdamParams; weight decay is decoupled (AdamW), grad_clip_norm 0 = off.
struct AdamParams {
  double learning_rate = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-12;
  double weight_decay = 0.0;
  double grad_clip_norm = 0.0;
};

struct OptimStepCall {
  int slot = -1;
  AdamParams params;
};

struct OptimStepOutput {
  std::map<std::string, double> metrics;  // e.g. "grad_norm", "step"
  bool skipped = false;                   // non-finite gradient: step skipped, grads zeroed
};

struct EngineOptions {
  std::string model_dir;          // HF layout: config.json + safetensors
  std::string device = "auto";    // auto | cpu | cuda
  std::string dtype = "auto";     // auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32
  int max_slots = 8;              // N adapter slots
  int max_rank = 32;              // R, the largest rank a slot may take
  int64_t context_window = 0;     // 0 = from the model config
  int threads = 0;                // CPU intra-op threads; 0 = all cores
};

struct ModelInfo {
  std::string model_type;   // "qwen2", "qwen3", ...
  std::string device;       // "cpu" or "cuda"
  std::string dtype;        // "float32" or "bfloat16"
  int64_t vocab_size = 0;
  int64_t context_window = 0;
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int max_slots = 0;
  int max_rank = 0;
  int64_t base_parameters = 0;  // the frozen weights' element count (a tied embedding once)
};

// The device allocator's bytes (libtorch's caching allocator, not what the
// driver reports); all 0 on the CPU.
struct DeviceMemory {
  int64_t allocated = 0;       // held by live tensors now
  int64_t peak_allocated = 0;  // the most since the last ResetPeakMemory()
  int64_t reserved = 0;        // held by the allocator's cache
};

// What a saved training state says about the adapter it holds.
struct StateInfo {
  LoraConfig lora;
  int64_t step = 0;
  bool has_optimizer = false;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Open(const EngineOptions& options);
  virtual ~Engine() = default;

  virtual const ModelInfo& info() const = 0;

  // Input checks that need no tensors: lengths, vocabulary, loss name and
  // config keys, context window. The message names the datum and the field.
  virtual Status ValidateForwardBackward(const ForwardBackwardCall& call) const = 0;

  // Binds a free slot to a fresh adapter (A random from seed, B zero).
  virtual Status BindSlot(int slot, const LoraConfig& config) = 0;
  // Wipes the slot's weights, gradients and optimizer state.
  virtual void ReleaseSlot(int slot) = 0;

  // Runs the calls as one packed pass (they must share loss_fn, config and
  // forward_only). Each call gets its own result; a failure in one call's
  // data fails that call only. Gradients accumulate per slot.
  virtual std::vector<Result<ForwardBackwardOutput>> ForwardBackward(
      const std::vector<ForwardBackwardCall>& calls) = 0;

  // A ForwardBackward call takes effect whole or not at all: a pass that
  // fails half-way (an exception in its backward) leaves every slot's
  // gradient as it was before the pass. For a request split over several
  // passes the caller brackets its pieces: MarkGrad(slot) before the first,
  // RollbackGrad(slot) when any piece fails (the gradient returns to the
  // mark), ForgetGradMark(slot) after the last. One mark per slot; a new
  // MarkGrad replaces it; ReleaseSlot forgets it.
  virtual void MarkGrad(int slot) = 0;
  virtual void RollbackGrad(int slot) = 0;
  virtual void ForgetGradMark(int slot) = 0;

  // Steps every listed slot (AdamW, FP32 moments) in one engine call. A step
  // that would make a slot's weights or moments non-finite fails that call
  // only and leaves the slot as it was.
  virtual std::vector<Result<OptimStepOutput>> OptimStep(const std::vector<OptimStepCall>& calls) = 0;

  // Training state: adapter weights at the slot's own rank, optimizer moments
  // and step counters. Written atomically (temp dir, fsync, rename).
  virtual Status SaveState(int slot, const std::string& dir) = 0;
  virtual Status LoadState(int slot, const std::string& dir, bool with_optimizer) = 0;
  static Result<StateInfo> ReadStateInfo(const std::string& dir);

  // Immutable PEFT snapshot (adapter_config.json + adapter_model.safetensors).
  virtual Status SaveForSampler(int slot, const std::string& dir, const std::string& base_model_name) = 0;

  virtual DeviceMemory Memory() const { return {}; }
  virtual void ResetPeakMemory() {}

  // The frozen base model, for a Sampler to share (so it is held once).
  // Read-only; safe to use from another thread. nullptr for test doubles.
  virtual std::shared_ptr<const Transformer> SharedModel() const { return nullptr; }
};

}  // namespace loom::engine
