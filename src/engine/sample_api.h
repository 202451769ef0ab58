// The sampler's public face: plain C++ types, no tensors (like engine/api.h).
// service/ submits SampleCalls and gets SampleOutputs back through a
// callback; everything with tensors lives behind Sampler in engine/sample/.
//
// Threading: Submit(), Cancel(), Validate(), info() and the destructor may be called
// from any thread. Callbacks run on the sampler's own decode thread: they
// must be quick (post the result to the caller's executor and return).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/device_reserve.h"
#include "tinker/types.h"

namespace loom::engine {

class Transformer;
class SlotSnapshot;  // engine/api.h

// Tinker's nouns (tinker/types.h), under the names the sampler has always used.
using tinker::SampledSequence;
using tinker::SampleOutput;
using tinker::SamplingParams;
using SampleStopReason = tinker::StopReason;

struct SampleCall {
  std::string adapter_dir;         // PEFT snapshot directory; empty = the base model
  // Set: the adapter's weights in memory (an ephemeral sampler's snapshot,
  // not yet or never on disk), installed from here when adapter_dir, then
  // only its key, is not cached; where Sampler::SamplesFromMemory.
  std::shared_ptr<const SlotSnapshot> snapshot;
  std::vector<int32_t> prompt;
  int32_t num_samples = 1;
  SamplingParams params;
  bool prompt_logprobs = false;
  int32_t topk_prompt_logprobs = 0;  // 0 = off
  // Who asked: the sampler shares its batch fairly by tokens across tenants
  // and, within a tenant, across sampling sessions (engine/sample/fair_queue.h),
  // and Cancel() drops a session's calls. Empty names are one flow.
  std::string tenant;
  std::string session;
};

// Switches of the sampler's CUDA decode fast path (engine/sample/fast_decode.h),
// set from `loom serve` and `loom bench sample` flags. Where there is no
// fast path (CPU builds, CPU devices) they change nothing.
struct DecodeOptions {
  bool cuda_graphs = true;   // --cuda-graphs off: every decode step runs eager libtorch
  bool gemv = true;          // --decode-gemv off: cuBLAS for every projection, also of <= 4 rows
  bool split_shrink = true;  // --decode-split off: a LoRA shrink's long input on one block per output tile
  bool profile = false;      // --decode-profile: log each stage's GPU time (stages serialized, slower)
  // --fast-prefill: a prefill step of at most this many new tokens (and no
  // prompt logprobs) replays the decode graphs instead of the eager forward,
  // each new token one row (engine/sample/model_runner.h); 0 = eager always.
  // 2048: 64 prompts of 32 tokens in one step (on the H200, qwen3-4b: 53 ms
  // for the base against 262 eager, 68 ms with 8 adapters against 200;
  // docs/benchmarks.md, session 14).
  int64_t fast_prefill_tokens = 2048;
  // --sampler-lora-math model (the default) | fp32: the LoRA arithmetic of
  // the sampler's ATen paths (eager steps, an MoE model's expert LoRA on the
  // graphs): the model's dtype, as the trainer's default (bf16 GEMMs on
  // tensor cores), so that a prompt's logprobs are the trainer's forward's
  // (the same on a bf16 CPU model; fp32 math was 0.03 apart there), or fp32,
  // as PEFT does (activations cast up). On an H100 a 2,048-token eager
  // prefill with one adapter takes 1.43x the base's time in the model's
  // dtype and 2.0x in fp32; the fused decode kernels (which accumulate in
  // fp32) are within the same bounds of either (docs/benchmarks.md,
  // session 38). An fp32 model is the same either way.
  bool lora_fp32 = false;
  // --decode-stream priority: the decode thread launches on a high-priority
  // CUDA stream of its own, so that the device schedules a decode step's
  // kernels ahead of a training pass's already queued ones (shared: both
  // threads launch on the default stream, in launch order). Off by
  // default: in bench rl on the H200 (16 tenants, issue 18) it gave 2.21x
  // aggregate against shared's 2.42x, and no better busy share.
  bool priority_stream = false;
  // --moe-decode-graphs on (the default): an MoE model's decode steps on the
  // graphs too (qwen3_moe, bf16: the experts' block as ATen ops that read
  // nothing on the host, its expert LoRA in the pair form, engine/model/moe.h).
  // On the H200 at Qwen3-30B-A3B's widths it made a batch-1 step 5x faster
  // than the eager one, and 8 adapters at batch 64 2.4x (docs/benchmarks.md).
  // Off: MoE models decode eager.
  bool moe_graphs = true;
  // --moe-decode-gemv on (the default): on those graphs, a step of at most
  // 32 (token, expert) pairs (4 rows at top-8) runs each pair's expert
  // projections as matrix-vector products over its own expert's rows
  // (MoeForward's pair_gemv); off: the sorted pairs' grouped GEMMs.
  bool moe_gemv = true;
  // --decode-attention tokens (the default): on the decode graphs, bf16
  // models with head_dim 128 attend with each half warp on a token
  // (cuda::AttentionForm::kTokens) where a step has rows enough to fill the
  // device; dims: each warp's lanes split a head's dims. On the H100
  // (qwen3-4b shapes) tokens took 112 µs a layer for 256 rows over 192
  // tokens of context against 190, and a 256-row step of 16 adapters
  // 12.3 ms against 14.3 (docs/benchmarks.md, session 26).
  bool attention_tokens = true;
  // --chunk-attention on (the default): on the decode graphs, the rows of a
  // prefill chunk (a prompt's new tokens, each one row: FastPrefill and
  // mixed steps) attend in tiles, every K/V row loaded once for up to 16
  // queries, on the tensor cores (engine/sample/chunk_tiles.h,
  // cuda::ChunkAttention; bf16, head_dim 32/64/128, a grouped-query group
  // dividing 16), where a chunk's context reaches 1,024 tokens. Off: each
  // row reads its whole context alone. On the H100 (qwen3-4b) a cached
  // 80-token turn over 4,500 tokens of history took 24 ms against 30
  // (docs/benchmarks.md, session 33).
  bool chunk_attention = true;
  // --decode-gemm tuned: on the decode graphs of a bf16 model, the base
  // projections of more rows than the matrix-vector kernel takes run through
  // cuBLASLt with each shape's algorithm chosen by timing its candidates
  // once, before the first graph of that row count is captured
  // (engine/sample/cuda/lt_gemm.h); cublas (the default): at::linear's
  // cuBLAS call, the algorithm its heuristic picks. Off until measured on
  // a GPU.
  bool gemm_tuned = false;
};

struct SamplerOptions {
  std::string model_dir;          // for tokenizer.json and generation_config.json (may be empty)
  // Adapter cache slots (--sampler-adapters). 0 = auto: one per trainer
  // slot (trainer_slots, at least 4), so that every live model's newest
  // version stays resident while its tenant samples it, but no more than
  // kAutoAdapterShare of the device's memory (host RAM on the CPU) holds
  // at max_rank. SamplerInfo::sampler_adapters says what was chosen.
  int sampler_adapters = 0;
  int trainer_slots = 0;          // the trainer's adapter slots (--max-adapters), for auto
  int max_rank = 32;              // the largest LoRA rank a snapshot may have
  int64_t kv_budget_tokens = 0;   // KV cache size in tokens; 0 = from kv_budget_bytes
  // Used when kv_budget_tokens is 0; both 0: 512 tokens per batch row on a
  // CUDA device (131072 at 256 rows, 19 GB for qwen3-4b in bf16), 65536
  // tokens on the CPU.
  int64_t kv_budget_bytes = 0;
  int block_size = 16;            // tokens per KV block
  // Decode rows (sequences) per step: 16 tenants x an RL group of 16 in one
  // batch (the CUDA fast decode path takes up to 512, in power-of-two buckets).
  int max_batch_rows = 256;
  int64_t max_prefill_tokens = 8192;  // prompt tokens prefilled per step; longer prompts in chunks
  // While tenants contend (engine/sample/step_plan.h), a step carries at
  // most this many prompt tokens of the tenants over their share and at
  // most contended_decode_rows of their running rows (0 = all), after the
  // work of the tenants within their share. Prompt tokens: 0 = by device:
  // 32 on the CPU (so that such a step costs a few decode steps there), and
  // max_prefill_tokens on a CUDA device, where the measured H200 sweep found
  // every smaller cap slower for both tenants (the rule's order still holds).
  int64_t contended_prefill_tokens = 0;
  int contended_decode_rows = 0;
  // While tenants contend, a decode step also carries the over-share
  // tenants' capped prompt chunks in the same forward (StepLimits::
  // mixed_steps; CUDA decode graphs with fast_prefill_tokens > 0 only). Off
  // by default: on the H200 it moved the flood only a little at a small cap
  // (cap 64: 75 against 42-78 tokens/s) and, with the GPU's default cap
  // (max_prefill_tokens), put whole chunks behind every light decode step
  // (docs/benchmarks.md, session 14).
  bool mixed_steps = false;
  // A light (within-share) tenant's prefill step also carries the capped
  // over-share chunks (StepLimits::prefill_riders); off: its prompt is
  // prefilled alone and the others' chunks wait for their own steps.
  bool contended_prefill_riders = true;
  // Keep full KV blocks of finished work for later requests with the same
  // (snapshot, token prefix) (engine/sample/block_manager.h); off: every
  // prompt is prefilled whole.
  bool prefix_cache = true;
  int64_t context_window = 0;     // 0 = the model's max_position_embeddings
  int32_t max_num_samples = 128;
  int threads = 0;                // CPU intra-op threads of the decode thread; 0 = leave as is
  // When the sampler is idle, a request's arrival opens a window: it waits
  // this long after the newest arrival (at most 10 windows) before the first
  // step, so requests sent together share one prefill. 0 = start at once.
  std::chrono::microseconds admission_window{0};
  DecodeOptions decode;
  // How the sampler's steps share a CUDA device with the trainer's passes
  // (engine/device_reserve.h): 0 = interleaved, both launching on the
  // stream in launch order; > 0 = in turns (DeviceTurns, first come first
  // served), the sampler keeping its turn for consecutive steps until it
  // is idle or, while a pass waits, this long has passed.
  std::chrono::milliseconds device_turn{0};
  // At start-up, run the largest steps once (Scheduler::Probe) and keep
  // their working memory in reserve (Sampler::device_reserve, which the
  // trainer leaves free). Unset: on a CUDA device only; true: also on the
  // CPU, where nothing is measured (tests of the probe's traces).
  std::optional<bool> probe_steps;
};

// The most of the device's memory the auto --sampler-adapters takes.
inline constexpr double kAutoAdapterShare = 0.10;

struct SamplerInfo {
  int64_t vocab_size = 0;
  int64_t context_window = 0;
  int64_t kv_tokens = 0;          // KV cache capacity in tokens
  int64_t kv_blocks = 0;
  int block_size = 0;
  int sampler_adapters = 0;
  bool has_tokenizer = false;
  std::vector<int32_t> eos_token_ids;
  int32_t max_num_samples = 0;    // num_samples a call may ask for (max_num_samples, at most max_batch_rows)
  int max_rank = 0;               // the largest LoRA rank of a snapshot it samples
  // Device memory its steps take beyond its live tensors, measured at
  // start-up (SamplerOptions::probe_steps; 0 where not probed): the largest
  // step's working memory and the decode graphs' idle pool.
  int64_t step_reserve_bytes = 0;
  int64_t probe_prefill_tokens = 0;  // the probe's prefill (0: none ran)
  int64_t probe_decode_rows = 0;     // and its decode step's rows
};

// Blocks of block_size tokens one call needs at most: every sample holds
// prompt + max_tokens - 1 positions (the last token is never fed back); the
// prompt's full blocks are shared by all samples.
int64_t KvBlocksWorstCase(int64_t block_size, int64_t prompt_len, int64_t max_tokens, int64_t num_samples);

// Sampler::Validate's checks against what `info` says of a sampler: the same
// answer for the in-process sampler and for a gateway in front of replicas
// (replica/remote_sampler.h). Status::Invalid naming the field and the
// limit; NotFound for a snapshot directory without adapter_config.json.
Status ValidateSampleCall(const SamplerInfo& info, const SampleCall& call);

// Counters for tests, metrics and the bench. Read with stats().
struct SamplerStats {
  int64_t requests_done = 0;
  int64_t decode_steps = 0;
  int64_t prefill_steps = 0;
  int64_t tokens_generated = 0;
  int64_t decode_rows = 0;        // sequences summed over decode steps (rows a step: decode_rows / decode_steps)
  int64_t adapter_loads = 0;      // snapshot loads from disk (first loads + reloads after eviction)
  int64_t adapter_installs = 0;   // snapshots installed from memory (Offer), no disk read
  int64_t adapter_evictions = 0;
  int64_t max_rows_in_step = 0;   // the most sequences one decode step carried
  int64_t max_adapters_in_step = 0;  // the most distinct adapters one decode step carried
  int64_t admission_waits = 0;    // times the first request in fair order waited for room (KV, rows, a slot)
  int64_t requests_cancelled = 0; // completed by Cancel(), queued or running
  int64_t requests_waiting = 0;   // queued, not yet admitted (after the last step)
  int64_t kv_blocks_free = 0;     // no one holds them (plain free + idle cached)
  int64_t kv_blocks_cached = 0;   // of those, kept by the prefix cache for reuse
  int64_t kv_cache_evictions = 0; // cached blocks taken back for new work
  int64_t prefill_tokens = 0;     // prompt tokens the prefill steps computed
  int64_t fast_prefill_steps = 0; // of the prefill steps, those run on the decode graphs (DecodeOptions)
  int64_t prompt_cache_hit_tokens = 0;  // prompt tokens reused from the prefix cache instead
  int64_t contended_steps = 0;    // steps run under the contended rule (a tenant over its share capped)
  int64_t mixed_steps = 0;        // decode steps that carried prompt chunks in the same forward (counted in both)
  // CUDA graphs the fast decode path captured (one per new shape: row bucket x
  // block-table bucket x adapters or not), and the time the captures took;
  // a capture waits for the whole device, so it lands in the step that needed it.
  int64_t decode_graphs_captured = 0;
  double decode_graph_capture_seconds = 0;
  // Wall time of the prefill and decode steps, sampling included (each step
  // ends by copying its chosen tokens to the host, so this is device time).
  double prefill_seconds = 0;
  double decode_seconds = 0;
  // A gateway's RemoteSampler (replica/remote_sampler.h) only; 0 in process:
  int64_t replicas = 0;         // the sampler replicas it routes to
  int64_t replicas_live = 0;    // of those, taking calls now
  int64_t resubmitted = 0;      // calls submitted again after their replica failed
};

using SampleCallback = std::function<void(Result<SampleOutput>)>;

// Sampler: a continuous-batching decoder over one frozen base model with an
// LRU cache of LoRA snapshots. Invariant: a call's tokens depend only on
// (model, snapshot, prompt, params, seed), never on the other calls sharing
// its decode steps (to float tolerance of the logits).
class Sampler {
 public:
  // model: the shared frozen base (the trainer's copy, held once). The
  // decode thread starts here and stops in the destructor; calls still
  // queued or running then complete with Status::Unavailable.
  static Result<std::unique_ptr<Sampler>> Open(std::shared_ptr<const Transformer> model,
                                               const SamplerOptions& options);
  // A sampler with a base of its own, loaded from options.model_dir on
  // `device` (auto | cpu | cuda) in `dtype` (auto | bf16 | fp32): a sampler
  // replica (`loom serve --role sampler`), which has no trainer to share
  // the base with. options.max_rank 0 = the trainer's default for the
  // model (kAutoDenseRank, or kAutoMoeRank for mixture-of-experts).
  static Result<std::unique_ptr<Sampler>> OpenStandalone(const std::string& device, const std::string& dtype,
                                                         SamplerOptions options);
  virtual ~Sampler() = default;

  virtual const SamplerInfo& info() const = 0;

  // Tensor-free checks: prompt non-empty and in the vocabulary, num_samples,
  // parameter ranges, prompt + max_tokens <= the context window, stop strings
  // only with a tokenizer.json, the request fits the KV budget at all.
  // Status::Invalid naming the field and the limit.
  virtual Status Validate(const SampleCall& call) const = 0;

  // Validates, queues and returns; done(result) runs later on the decode
  // thread (or at once, with the error, when validation fails).
  virtual void Submit(SampleCall call, SampleCallback done) = 0;

  // Drops every call of a sampling session (SampleCall::session, non-empty):
  // queued ones and running ones, before the next step; their KV blocks and
  // adapter slots are freed and their callbacks get `why`. Sticky: a later
  // Submit for the session gets `why` at once.
  virtual void Cancel(const std::string& session, const Status& why) = 0;

  // The trainer's snapshot of what the PEFT directory adapter_dir holds:
  // the first call naming adapter_dir installs it from memory instead of
  // reading the files (SamplerStats::adapter_installs). The sampler keeps at
  // most sampler_adapters offers not yet used (the oldest is dropped; its
  // directory loads from disk as before); a snapshot of another engine's
  // kind is ignored. Any thread; never waits for a step.
  virtual void Offer(const std::string& adapter_dir, std::shared_ptr<const SlotSnapshot> snapshot) = 0;

  // Whether Submit takes a call's in-memory snapshot (SampleCall::snapshot);
  // a sampler that reads only directories (a replica's gateway) does not.
  virtual bool SamplesFromMemory() const { return false; }

  // What this sampler keeps in reserve on the device it shares with a
  // trainer (Engine::ShareDevice); null for one that holds no device.
  virtual std::shared_ptr<const DeviceReserve> device_reserve() const { return nullptr; }

  virtual SamplerStats stats() const = 0;
};

}  // namespace loom::engine
