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
#include "engine/device_reserve.h"
#include "tinker/types.h"

namespace loom::engine {

class Transformer;  // engine/model/transformer.h; opaque here (no tensors above engine/)

// Tinker's nouns (tinker/types.h), under the names the engine has always used.
using tinker::AdamParams;
using tinker::Array;
using tinker::Datum;
using tinker::ForwardBackwardOutput;
using tinker::LoraConfig;

// One request's input on one adapter slot.
struct ForwardBackwardCall : tinker::ForwardBackwardInput {
  int slot = -1;
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
  int max_slots = 8;              // N adapter slots; 0 = planned from memory (kAutoSlot*)
  int max_rank = 32;              // R, the largest rank a slot may take; 0 = kAutoDenseRank or kAutoMoeRank
  int64_t context_window = 0;     // 0 = from the model config
  int threads = 0;                // CPU intra-op threads; 0 = all cores
  // LoRA arithmetic in fp32 (activations cast up, as PEFT does) instead of
  // the model dtype (the fp32 factors cast down): the reference precision.
  bool lora_fp32 = false;
  // On a GPU, the grouped LoRA form over a pass whose slots' rows differ in
  // count runs over the rows as they are, each slot its own length
  // (LoraGroups::ragged: grouped GEMMs), not gathered into a padded order of
  // U x the longest. false: the padded order (bench --lora-order padded).
  bool lora_ragged = true;
  // Decoder layers whose activations are recomputed in the backward instead
  // of kept (from the first layer): 0 keeps all; more trade one forward of
  // those layers for memory. -1 (auto): on a GPU, per pass, the fewest that
  // fit the device memory free at that moment (train/memory_plan.h); none on
  // the CPU.
  int recompute_layers = -1;
  // A forward_backward call's datums that begin with the same rows (an RL
  // group's prompt: the same tokens and loss inputs) train those rows once
  // (train/shared_prefix.h), on models whose layers allow it
  // (ModelConfig::SharesPrefixes). false: every datum whole.
  bool share_prefixes = true;
  // On a GPU, forward_backward passes of at most this many tokens once
  // padded to the uniform layout (train/uniform_pass.h) run as CUDA graphs
  // (train/pass_graphs.h): a small step costs its GPU time, not its ~10,000
  // launches. 0 = never. No effect on the CPU.
  int64_t graph_max_tokens = 2048;
  // Where the slots' AdamW moments live: "device" (beside the weights: 16
  // bytes per LoRA parameter on the device), "host" (pinned host memory,
  // staged through a bounded device buffer at each optim_step: 8 bytes per
  // parameter on the device, 8 on the host), or "auto": the device when
  // max_slots fit there, else the host when they fit that way.
  std::string moments = "auto";
  // Tensor and expert parallel (engine/model/parallel.h) over one group of
  // max(tp_size, ep_size) ranks, each 1 or the group's size: this process
  // is rank group_rank, meeting the others at the rendezvous file
  // group_store (a fresh path on a filesystem every rank sees). Every rank
  // makes the same engine calls in the same order (`loom serve --tp N`
  // replays rank 0's calls on its workers); every rank's results are the
  // same; rank 0's checkpoints and snapshots are the whole adapter (the
  // others write none).
  int group_rank = 0;
  int tp_size = 1;
  int ep_size = 1;
  std::string group_store;
  // The share of the memory admitted for slots (see kAutoSlotShare) this
  // engine plans and checks its slots against, in (0, 1]: `loom serve` with
  // N base models gives each 1/N, so that together they fit.
  double memory_share = 1.0;
};

// The plan when EngineOptions leaves max_rank or max_slots at 0: rank 128
// for dense models (the cookbook's distillation recipes use it), 32 for
// mixture-of-experts ones (a slot grows with the experts); as many slots at
// that rank as fit in kAutoSlotShare of the memory Engine::Open admits for
// slots (so passes, the sampler's KV cache and its adapters keep the rest),
// at least 1, at most kAutoSlotCap.
inline constexpr int kAutoDenseRank = 128;
inline constexpr int kAutoMoeRank = 32;
inline constexpr double kAutoSlotShare = 0.5;
inline constexpr int kAutoSlotCap = 32;

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
  int64_t active_parameters = 0;  // those one token runs through: an MoE layer's experts count k of E
  // One adapter slot at max_rank: fp32 weights, gradient and two AdamW
  // moments, of which slot_host_bytes (the moments, when moments_on_host)
  // are in host memory and the rest, slot_bytes, on the model's device.
  int64_t slot_bytes = 0;
  int64_t slot_host_bytes = 0;
  bool moments_on_host = false;
  // What the slot plan saw: the device bytes Engine::Open admits for slots
  // (80% of the memory beside the base weights), and which of max_slots /
  // max_rank it chose itself (EngineOptions 0).
  int64_t slot_room_bytes = 0;
  bool auto_slots = false;
  bool auto_rank = false;
};

// The device allocator's bytes (libtorch's caching allocator, not what the
// driver reports); all 0 on the CPU.
struct DeviceMemory {
  int64_t allocated = 0;       // held by live tensors now
  int64_t peak_allocated = 0;  // the most since the last ResetPeakMemory()
  int64_t reserved = 0;        // held by the allocator's cache
  int64_t device_mallocs = 0;  // segments the allocator has taken from the driver (cudaMalloc calls)
  int64_t alloc_retries = 0;   // cudaMallocs that failed and were retried after freeing the cache (each
                               // waits for all the device's queued work)
};

// What a saved training state says about the adapter it holds.
struct StateInfo {
  LoraConfig lora;
  int64_t step = 0;
  bool has_optimizer = false;
};

// An immutable copy of one adapter slot, taken by Engine::SnapshotForSampler
// on the engine thread: later calls on the slot (forward_backward,
// optim_step, release, rebinding) leave it as it is. Holding it holds its
// memory (the factors at the slot's rank, on the engine's device). The
// service writes it to disk on a thread of its own and hands it to the
// Sampler (Sampler::Offer), so a publish costs the engine thread one copy.
//
// Threading: any thread, any number at once (it is never modified).
class SlotSnapshot {
 public:
  virtual ~SlotSnapshot() = default;
  // Writes it as a PEFT directory (adapter_config.json +
  // adapter_model.safetensors) that appears whole or not at all
  // (durable::PublishDirectory: an existing dir is AlreadyExists).
  virtual Status WritePeft(const std::string& dir, const std::string& base_model_name) const = 0;
  // The memory it holds.
  virtual int64_t bytes() const = 0;
};

class Engine {
 public:
  // Rank 0's engine (or the only one). Over a group (tp or ep > 1), every
  // call that changes state is sent to the other ranks first
  // (engine/group_engine.h).
  static Result<std::unique_ptr<Engine>> Open(const EngineOptions& options);
  // Rank group_rank >= 1 of a group: opens its part of the model and makes
  // rank 0's calls on it, in order, until rank 0's engine is destroyed (Ok)
  // or the group breaks.
  static Status RunGroupWorker(const EngineOptions& options);
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

  // A copy of the bound slot's adapter for the sampler (a device-to-device
  // copy of its factors; no host sync, no disk).
  virtual Result<std::shared_ptr<const SlotSnapshot>> SnapshotForSampler(int slot) = 0;
  // With --publish-staging ahead, run once on each thread that will write
  // snapshots (SlotSnapshot::WritePeft), before its first write: on CUDA it
  // takes the pinned host memory a write stages the largest snapshot
  // through, kept by the thread for every later write. Taken at the first
  // write instead (the default: each write's own), it pins
  // hundreds of MB while the trainer and the sampler run (cudaHostAlloc):
  // in bench rl's traced loop on the H100, two saves' CUDA calls on the
  // engine thread waited 242 and 298 ms, both in the first round, while the
  // two writers made their first writes (docs/benchmarks.md, session 41).
  virtual void PrepareSnapshotWriter() const {}
  // Gives back what PrepareSnapshotWriter took; the same thread calls it
  // before it ends (not left to the thread's exit, where CUDA's own
  // per-thread state may already be gone).
  virtual void ReleaseSnapshotWriter() const {}
  // SnapshotForSampler, written at once: an immutable PEFT directory.
  Status SaveForSampler(int slot, const std::string& dir, const std::string& base_model_name) {
    auto snapshot = SnapshotForSampler(slot);
    return snapshot.ok() ? (*snapshot)->WritePeft(dir, base_model_name) : snapshot.status();
  }

  virtual DeviceMemory Memory() const { return {}; }
  // The most tokens one training pass can hold in the device memory free
  // now, with every layer recomputed (train/memory_plan.h), beside what a
  // pass of the slots bound now holds besides (their casts, the gradient
  // marks of those mid-request); 0 where memory sets no limit the engine
  // knows of (the CPU). On the engine's thread, or before it runs (it reads
  // the slots' state).
  virtual int64_t MaxPassTokens() const { return 0; }
  // The same with every layer's activations kept: the most tokens a pass
  // holds now without recomputing a layer in its backward (which costs a
  // second forward of the layer). Never above MaxPassTokens; 0 likewise.
  virtual int64_t KeptPassTokens() const { return 0; }
  // One line on how the pass limit was measured (empty where none was).
  virtual std::string MemoryPlanReport() const { return {}; }
  // Another user of this device (a sampler on the shared base) whose
  // reserve MaxPassTokens and the passes' plans leave free from now on.
  // Before the engine's first pass; not safe beside one.
  virtual void ShareDevice(std::shared_ptr<const DeviceReserve> neighbour) { (void)neighbour; }
  // The training graphs so far (EngineOptions::graph_max_tokens): passes run
  // in the uniform layout, keys captured, passes replayed, the pool's bytes.
  struct GraphStats {
    int64_t passes = 0, captures = 0, replays = 0, pool_bytes = 0;
  };
  virtual GraphStats TrainGraphStats() const { return {}; }
  // The forward_backward passes the memory plan has sized so far, the
  // decoder layers they recomputed in all (train/memory_plan.h), and the
  // rows they were sized for: their datums' tokens less the shared
  // prefixes' repeats (train/shared_prefix.h). Any thread.
  struct RecomputeStats {
    int64_t passes = 0, layers = 0, rows = 0;
  };
  virtual RecomputeStats TrainRecomputeStats() const { return {}; }
  virtual void ResetPeakMemory() {}

  // The frozen base model, for a Sampler to share (so it is held once).
  // Read-only; safe to use from another thread. nullptr for test doubles.
  virtual std::shared_ptr<const Transformer> SharedModel() const { return nullptr; }
};

}  // namespace loom::engine
