// SamplerImpl: the Sampler of sample_api.h. It owns the decode thread, the
// inbox that Submit() fills from any thread, and the Scheduler that only
// the decode thread touches.
#include <ATen/Parallel.h>
#if LOOM_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#endif
#include <unistd.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/batch_window.h"
#include "common/log.h"
#include "engine/io/peft_snapshot.h"
#include "engine/api.h"
#include "engine/model/device.h"
#include "engine/model/transformer.h"
#include "engine/sample/scheduler.h"
#include "engine/sample_api.h"

namespace loom::engine {
namespace {

namespace fs = std::filesystem;
using sample::Detokenizer;
using sample::SampleRequest;
using sample::Scheduler;

// eos_token_id of generation_config.json (int or list), else of the config.
std::vector<int32_t> EosTokens(const std::string& model_dir, const ModelConfig& config) {
  std::vector<int32_t> eos;
  std::ifstream in(fs::path(model_dir) / "generation_config.json");
  if (!model_dir.empty() && in) {
    std::stringstream ss;
    ss << in.rdbuf();
    const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("eos_token_id")) {
      const auto& e = j["eos_token_id"];
      if (e.is_number_integer()) eos.push_back(e.get<int32_t>());
      if (e.is_array())
        for (const auto& x : e)
          if (x.is_number_integer()) eos.push_back(x.get<int32_t>());
    }
  }
  if (config.eos_token_id >= 0 && std::find(eos.begin(), eos.end(), config.eos_token_id) == eos.end())
    eos.push_back(static_cast<int32_t>(config.eos_token_id));
  return eos;
}

// SamplerOptions::sampler_adapters = 0: one slot per trainer slot (at least
// 4), capped at kAutoAdapterShare of the device's memory (host RAM on the
// CPU). A slot costs its fp32 factors at max_rank, and on CUDA their bf16
// mirror for the fused decode kernels.
int64_t AdapterSlotBytes(const Transformer& model, int max_rank) {
  int64_t elems = 0;
  for (const LoraTargetSpec& t : model.LoraTargets()) elems += t.AElems(max_rank) + t.BElems(max_rank);
  return elems * (model.device().is_cuda() ? 4 + 2 : 4);
}

int AutoAdapters(const Transformer& model, const SamplerOptions& options) {
  const int64_t per_slot = AdapterSlotBytes(model, options.max_rank);
  const bool cuda = model.device().is_cuda();
  double memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGE_SIZE));
#if LOOM_CUDA_KERNELS
  if (cuda) {
    const int index = model.device().index() < 0 ? 0 : model.device().index();
    memory = static_cast<double>(at::cuda::getDeviceProperties(index)->totalGlobalMem);
  }
#endif
  const double fit = kAutoAdapterShare * memory / static_cast<double>(std::max<int64_t>(1, per_slot));
  return std::max(1, static_cast<int>(std::min<double>(std::max(4, options.trainer_slots), fit)));
}

// What the sampler allocates at Open (the KV cache, one
// Gated DeltaNet state a batch row, the adapter slots) must fit in what the
// device has free (DeviceFreeBytes: on CUDA beside the base weights and the
// trainer's slots), with
// kSamplerSlack of it left for training passes and the allocator: a limit
// found up front, naming the flags, never by running out of memory.
constexpr double kSamplerSlack = 0.10;

Status CheckDeviceRoom(const Transformer& model, const SamplerOptions& options, const SamplerInfo& info) {
  const double free_now = DeviceFreeBytes(model.device());
  const double kv = static_cast<double>((info.kv_blocks + 1) * info.block_size) *
                    static_cast<double>(sample::ModelRunner::KvBytesPerToken(model));
  const double states = static_cast<double>(sample::ModelRunner::StateBytesPerRow(model)) * options.max_batch_rows;
  const double adapters = static_cast<double>(AdapterSlotBytes(model, options.max_rank)) * info.sampler_adapters;
  const double room = (1.0 - kSamplerSlack) * free_now;
  if (kv + states + adapters <= room) return Status::Ok();
  constexpr double kMiB = 1024.0 * 1024.0;
  const auto mib = [&](double b) { return std::to_string(static_cast<int64_t>(b / kMiB)); };
  std::string parts = "a KV cache of " + std::to_string(info.kv_tokens) + " tokens (--kv-budget-tokens): " + mib(kv) +
                      " MiB";
  if (states > 0)
    parts += "; recurrent states of " + std::to_string(options.max_batch_rows) + " batch rows (--max-batch-rows): " +
             mib(states) + " MiB";
  parts += "; " + std::to_string(info.sampler_adapters) + " adapter slots at max_rank " +
           std::to_string(options.max_rank) + " (--sampler-adapters): " + mib(adapters) + " MiB";
  return Status::Invalid("the sampler needs " + mib(kv + states + adapters) + " MiB on " + model.device().str() + " (" +
                         parts + "); " + mib(room) + " MiB are left for it (" +
                         std::to_string(static_cast<int>(100 * (1.0 - kSamplerSlack))) + "% of what is free " +
                         (model.device().is_cuda() ? "beside the base weights and the trainer's slots"
                                                   : "in host memory") +
                         "): lower those flags, or --max-adapters");
}

class SamplerImpl final : public Sampler {
 private:
  // Scheduler::Probe on this device, measured by the caching allocator:
  // the reserve is the peak above the live tensors after it (the largest
  // step's working memory) plus what the probe left reserved and unused
  // (the decode graphs' pool, which no other allocation can take). Before
  // the decode thread starts; the trainer runs nothing yet.
  Status ProbeSteps() {
    c10::NoGradGuard no_grad;
    const int64_t tokens = std::max<int64_t>(1, std::min(options_.max_prefill_tokens, info_.context_window - 1));
    try {
      ReleaseAllocatorCache(device_);
      const AllocatorCounters before = ReadAllocator(device_);
      ResetAllocatorPeak(device_);
      scheduler_->Probe(tokens, info_.context_window);
      ReleaseAllocatorCache(device_);
      const AllocatorCounters after = ReadAllocator(device_);
      const int64_t working = std::max<int64_t>(0, after.peak_allocated - after.allocated);
      const int64_t pool =
          std::max<int64_t>(0, (after.reserved - after.allocated) - (before.reserved - before.allocated));
      info_.step_reserve_bytes = working + pool;
      info_.probe_prefill_tokens = tokens;
      info_.probe_decode_rows = std::min<int64_t>(options_.max_batch_rows, info_.kv_blocks);
      reserve_->bytes.store(info_.step_reserve_bytes);
      if (device_.is_cuda())
        log::Info("sampler: its largest steps (a prefill of {} tokens, a decode step of {} rows) take {} MiB beyond "
                  "its tensors ({} MiB working memory, {} MiB idle graph pool): kept in reserve",
                  tokens, info_.probe_decode_rows, info_.step_reserve_bytes >> 20, working >> 20, pool >> 20);
      return Status::Ok();
    } catch (const std::exception& e) {
      ReleaseAllocatorCache(device_);
      return Status::Invalid("the sampler's largest steps, a prefill of " + std::to_string(tokens) +
                             " prompt tokens (--max-prefill-tokens) and a decode step of " +
                             std::to_string(options_.max_batch_rows) +
                             " rows (--max-batch-rows), do not fit on " + device_.str() +
                             " beside its KV cache and adapter slots (" + e.what() +
                             "): lower those flags, --kv-budget-tokens or --sampler-adapters");
    }
  }

 public:
  SamplerImpl(std::shared_ptr<const Transformer> model, const SamplerOptions& options,
              std::unique_ptr<Detokenizer> detok, SamplerInfo info)
      : options_(options), detok_(std::move(detok)), info_(std::move(info)) {
    auto bank = std::make_unique<SlotBank>(options.sampler_adapters, options.max_rank, model->device(),
                                           model->LoraTargets());
    // The eager path's LoRA arithmetic (DecodeOptions::lora_fp32): the
    // model's dtype by default, as the trainer's; fp32 as PEFT's.
    bank->set_lora_fp32(options.decode.lora_fp32);
    sample::SchedulerLimits limits;
    limits.max_batch_rows = options.max_batch_rows;
    limits.max_prefill_tokens = options.max_prefill_tokens;
    // 0: by device. On the H200 a cap below the step's own budget made both
    // tenants slower (docs/benchmarks.md, session 11 sweep), so a GPU caps
    // nothing beyond max_prefill_tokens and keeps only the rule's order.
    limits.contended_prefill_tokens = options.contended_prefill_tokens > 0 ? options.contended_prefill_tokens
                                      : model->device().is_cuda()         ? options.max_prefill_tokens
                                                                          : 32;
    limits.contended_decode_rows = options.contended_decode_rows;
    limits.prefill_riders = options.contended_prefill_riders;
    // Decode steps with prompt chunks in one forward need the decode graphs.
    limits.mixed_steps = options.mixed_steps && model->device().is_cuda() && options.decode.cuda_graphs &&
                         options.decode.fast_prefill_tokens > 0;
    limits.prefix_cache = options.prefix_cache;
    device_ = model->device();
    scheduler_ = std::make_unique<Scheduler>(std::move(model), std::move(bank), info_.kv_blocks, info_.block_size,
                                             limits, options.decode, detok_.get(), info_.eos_token_ids);
    if (options.probe_steps.value_or(device_.is_cuda())) probe_ = ProbeSteps();
    if (options.device_turn.count() > 0) reserve_->turns = std::make_shared<DeviceTurns>();
    stats_ = scheduler_->stats();
    thread_ = std::thread([this] { Loop(); });
  }

  // Whether the start-up probe's steps fit (Open refuses the sampler if not).
  const Status& probe_status() const { return probe_; }
  std::shared_ptr<const DeviceReserve> device_reserve() const override { return reserve_; }

  ~SamplerImpl() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  const SamplerInfo& info() const override { return info_; }

  Status Validate(const SampleCall& c) const override { return ValidateSampleCall(info_, c); }

  void Submit(SampleCall call, SampleCallback done) override {
    if (Status s = Validate(call); !s.ok()) {
      if (done) done(s);
      return;
    }
    auto r = std::make_unique<SampleRequest>();
    const int64_t P = static_cast<int64_t>(call.prompt.size());
    r->max_tokens = call.params.max_tokens ? *call.params.max_tokens : info_.context_window - P;
    if (call.params.seed) {
      r->seed = *call.params.seed;
    } else {
      std::random_device rd;
      r->seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    }
    r->call = std::move(call);
    r->done = std::move(done);
    std::optional<Status> refused;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) {
        refused = Status::Unavailable("the sampler is shutting down");
      } else if (auto c = cancelled_.find(r->call.session); c != cancelled_.end()) {
        refused = c->second;
      } else {
        r->id = next_id_++;
        inbox_.push_back(std::move(r));
      }
    }
    if (refused) {
      if (r->done) r->done(*refused);
      return;
    }
    cv_.notify_one();
  }

  void Cancel(const std::string& session, const Status& why) override {
    if (session.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!cancelled_.emplace(session, why).second) return;
      cancels_.emplace_back(session, why);
    }
    cv_.notify_one();
  }

  void Offer(const std::string& adapter_dir, std::shared_ptr<const SlotSnapshot> snapshot) override {
    auto peft = std::dynamic_pointer_cast<const PeftSnapshot>(std::move(snapshot));
    if (!peft || adapter_dir.empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) offers_.emplace_back(adapter_dir, std::move(peft));
  }

  bool SamplesFromMemory() const override { return true; }

  SamplerStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  void Loop() {
    c10::NoGradGuard no_grad;
    if (options_.threads > 0) at::set_num_threads(options_.threads);
#if LOOM_CUDA_KERNELS
    // DecodeOptions::priority_stream: this thread's kernels on a
    // high-priority stream of its own, after everything the constructor
    // launched on the default stream (the KV pool, the slots, the decode
    // graphs' buffers). Snapshots from the trainer's stream are ordered by
    // their own events (PeftSnapshot::Ready).
    std::optional<c10::cuda::CUDAStreamGuard> own_stream;
    if (options_.decode.priority_stream && device_.is_cuda()) {
      const c10::DeviceIndex index = device_.index() < 0 ? 0 : device_.index();
      const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, index);
      at::cuda::CUDAEvent ready;
      ready.record(c10::cuda::getDefaultCUDAStream(index));
      ready.block(stream);
      own_stream.emplace(stream);
    }
#endif
    DeviceTurns::Turn turn;  // DeviceReserve::turns: held across consecutive steps
    std::chrono::steady_clock::time_point turn_began;
    for (;;) {
      std::vector<std::pair<std::string, Status>> cancels;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !inbox_.empty() || !cancels_.empty() || !scheduler_->idle(); });
        if (scheduler_->idle() && cancels_.empty()) GatherBurst(lock);
        if (stop_) break;
        // Offers first: a call that names a directory offered before it
        // was submitted finds the snapshot.
        for (auto& [dir, snapshot] : offers_) scheduler_->Offer(dir, std::move(snapshot));
        offers_.clear();
        for (auto& r : inbox_) scheduler_->Add(std::move(r));
        inbox_.clear();
        cancels = std::move(cancels_);
        cancels_.clear();
      }
      // Cancels land between steps, so a cancelled call runs no further step.
      for (const auto& [session, why] : cancels) scheduler_->Cancel(session, why);
      if (!scheduler_->idle()) {
        if (reserve_->turns && !turn.held()) {
          turn = reserve_->turns->Take();
          turn_began = std::chrono::steady_clock::now();
        }
        scheduler_->Step();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        stats_ = scheduler_->stats();
      }
      RunCompleted();
      // The turn ends when there is no step to run, or when its time is up
      // and a pass waits; the device's queued work first.
      if (turn.held() && (scheduler_->idle() || (std::chrono::steady_clock::now() - turn_began >= options_.device_turn &&
                                                 reserve_->turns->contended()))) {
        SynchronizeDevice(device_);
        turn.Release();
      }
    }
    std::vector<std::unique_ptr<SampleRequest>> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      left = std::move(inbox_);
    }
    for (auto& r : left) scheduler_->Add(std::move(r));
    scheduler_->FailAll(Status::Unavailable("the sampler is shutting down"));
    RunCompleted();
  }

  // The sampler was idle and requests are arriving: requests sent together
  // (one RL step's samples, each its own HTTP call) come a little apart, so
  // wait for a quiet admission_window (BatchWindow's rule, the trainer's too)
  // and give them one prefill, not the first arrival a prefill of its own.
  void GatherBurst(std::unique_lock<std::mutex>& lock) {
    const BatchWindow rule{options_.admission_window};
    if (!rule.enabled()) return;
    using Clock = std::chrono::steady_clock;
    const Clock::time_point first = Clock::now();
    Clock::time_point newest = first;
    size_t seen = inbox_.size();
    while (!stop_ && rule.KeepWaiting(Clock::now(), newest, first)) {
      if (cv_.wait_until(lock, rule.WaitUntil(newest, first), [&] { return stop_ || inbox_.size() != seen; })) {
        seen = inbox_.size();
        newest = Clock::now();
      }
    }
  }

  // Callbacks run outside mu_ (they may call stats() or Submit()).
  void RunCompleted() {
    for (auto& [done, result] : scheduler_->TakeCompleted()) done(std::move(result));
  }

  SamplerOptions options_;
  at::Device device_ = at::kCPU;
  std::shared_ptr<DeviceReserve> reserve_ = std::make_shared<DeviceReserve>();
  Status probe_ = Status::Ok();
  std::unique_ptr<Detokenizer> detok_;
  SamplerInfo info_;
  std::unique_ptr<Scheduler> scheduler_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t next_id_ = 0;
  std::vector<std::unique_ptr<SampleRequest>> inbox_;
  std::vector<std::pair<std::string, std::shared_ptr<const PeftSnapshot>>> offers_;  // for the scheduler, in order
  // Sessions cancelled so far (never cleared: session ids are not reused),
  // and the cancels the decode thread has not applied yet.
  std::map<std::string, Status> cancelled_;
  std::vector<std::pair<std::string, Status>> cancels_;
  SamplerStats stats_;
  std::thread thread_;
};

}  // namespace

Result<std::unique_ptr<Sampler>> Sampler::Open(std::shared_ptr<const Transformer> model,
                                               const SamplerOptions& options) {
  if (!model) return Status::Invalid("sampler: no model");
  if (model->parallel().split())
    return Status::Invalid("sampler: the model is split over tensor-parallel ranks; sample on replicas "
                           "(--sampler-replicas) that hold the whole model");
  if (options.sampler_adapters < 0) return Status::Invalid("sampler_adapters must be >= 1, or 0 (auto)");
  if (options.max_rank < 1) return Status::Invalid("sampler max_rank must be >= 1");
  if (options.block_size < 1) return Status::Invalid("sampler block_size must be >= 1");
  if (options.max_batch_rows < 1) return Status::Invalid("max_batch_rows must be >= 1");
  if (options.max_prefill_tokens < 1) return Status::Invalid("max_prefill_tokens must be >= 1");
  if (options.contended_prefill_tokens < 0) return Status::Invalid("contended_prefill_tokens must be >= 0");
  if (options.contended_decode_rows < 0) return Status::Invalid("contended_decode_rows must be >= 0");
  const ModelConfig& c = model->config();
  SamplerInfo info;
  info.vocab_size = c.vocab_size;
  info.context_window = options.context_window > 0 ? options.context_window : c.max_position_embeddings;
  if (info.context_window <= 0) return Status::Invalid("context window is unknown: set context_window");
  info.block_size = options.block_size;
  int64_t tokens = options.kv_budget_tokens;
  if (tokens <= 0 && options.kv_budget_bytes > 0) {
    // Gated DeltaNet layers' recurrent states come out of the same budget, one per row.
    const int64_t states = sample::ModelRunner::StateBytesPerRow(*model) * options.max_batch_rows;
    if (states >= options.kv_budget_bytes)
      return Status::Invalid("the KV budget (" + std::to_string(options.kv_budget_bytes) + " bytes) does not hold the " +
                             "recurrent states of max_batch_rows " + std::to_string(options.max_batch_rows) + " (" +
                             std::to_string(states) + " bytes)");
    tokens = (options.kv_budget_bytes - states) / sample::ModelRunner::KvBytesPerToken(*model);
  }
  if (tokens <= 0) tokens = model->device().is_cuda() ? int64_t{512} * options.max_batch_rows : 65536;
  info.kv_blocks = tokens / options.block_size;
  if (info.kv_blocks < 1) return Status::Invalid("the KV budget holds less than one block");
  info.kv_tokens = info.kv_blocks * options.block_size;
  info.sampler_adapters = options.sampler_adapters > 0 ? options.sampler_adapters : AutoAdapters(*model, options);
  if (Status room = CheckDeviceRoom(*model, options, info); !room.ok()) return room;
  info.eos_token_ids = EosTokens(options.model_dir, c);
  std::unique_ptr<Detokenizer> detok;
  if (!options.model_dir.empty()) {
    const fs::path tj = fs::path(options.model_dir) / "tokenizer.json";
    if (fs::exists(tj)) {
      Result<std::unique_ptr<Detokenizer>> d = Detokenizer::Load(tj.string());
      if (!d.ok()) return d.status();
      detok = std::move(d.value());
    }
  }
  info.has_tokenizer = detok != nullptr;
  info.max_num_samples = std::min(options.max_num_samples, options.max_batch_rows);
  info.max_rank = options.max_rank;
  SamplerOptions chosen = options;
  chosen.sampler_adapters = info.sampler_adapters;
  try {
    auto impl = std::make_unique<SamplerImpl>(std::move(model), chosen, std::move(detok), std::move(info));
    if (!impl->probe_status().ok()) return impl->probe_status();
    return std::unique_ptr<Sampler>(std::move(impl));
  } catch (const std::exception& e) {  // e.g. the allocator, when another process took the memory meanwhile
    return Status::Internal(std::string("sampler: allocating its KV cache, states and adapter slots: ") + e.what());
  }
}

Result<std::unique_ptr<Sampler>> Sampler::OpenStandalone(const std::string& device, const std::string& dtype,
                                                         SamplerOptions options) {
  at::Device dev = at::kCPU;
  if (Status s = ResolveDevice(device, &dev); !s.ok()) return s;
  auto type = ResolveDtype(dtype, dev);
  if (!type.ok()) return type.status();
  if (options.max_rank < 0) return Status::Invalid("sampler max_rank must be >= 1, or 0 (auto)");
  try {
    auto model = Transformer::Load(options.model_dir, dev, *type);
    if (!model.ok()) return model.status();
    if (options.max_rank == 0) options.max_rank = (*model)->config().num_experts > 0 ? kAutoMoeRank : kAutoDenseRank;
    return Open(std::shared_ptr<const Transformer>(std::move(*model)), options);
  } catch (const std::exception& e) {
    return Status::Internal(std::string("loading the model for the sampler: ") + e.what());
  }
}

}  // namespace loom::engine
