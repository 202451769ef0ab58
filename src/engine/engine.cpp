// TrainingEngine: the Engine of api.h over one Transformer, one SlotBank and
// its per-slot AdamW state.
//
// Invariant: a slot's weights, gradients, moments and step change only
// through calls naming that slot (BindSlot, ReleaseSlot, ForwardBackward,
// OptimStep, LoadState). ForwardBackward runs all calls as ONE packed forward
// and ONE backward of the sum of the calls' finite losses; each call's loss
// depends only on its own sequences (attention is block-diagonal, LoRA is
// routed per sequence), so each slot receives exactly its own gradient.
//
// Threading: engine thread only, except info(), ValidateForwardBackward(),
// MaxPassTokens() and MemoryPlanReport() (the memory plan is fixed at Open).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include "engine/train/text.h"

#if LOOM_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <atomic>
#include <cmath>
#include <exception>
#include <map>
#include <set>
#include <thread>

#include <unistd.h>

#include "common/log.h"
#include "engine/api.h"
#include "engine/io/peft_snapshot.h"
#include "engine/lora/slot_bank.h"
#include "engine/model/device.h"
#include "engine/model/transformer.h"
#include "engine/train/adamw.h"
#include "engine/train/forward_backward.h"
#include "engine/train/grad_marks.h"
#include "engine/train/memory_plan.h"
#include "engine/train/shared_prefix.h"
#include "engine/train/pass_graphs.h"
#include "engine/train/loss_spec.h"
#include "engine/group_engine.h"
#include "engine/train/split_state.h"
#include "engine/train/state.h"

namespace loom::engine {
namespace {

using train::Cat;

Status FromException(const char* op, const std::exception& e) {
  return Status::Internal(Cat(op, " failed in the engine: ", e.what()));
}

class TrainingEngine final : public Engine {
 public:
  TrainingEngine(std::unique_ptr<Transformer> model, ModelInfo info, const EngineOptions& options, int threads)
      : threads_(threads),
        recompute_layers_(options.recompute_layers),
        share_min_rows_(options.share_prefixes && model->config().SharesPrefixes() ? train::kShareMinRows : 0),
        model_(std::move(model)),
        info_(std::move(info)),
        bank_(info_.max_slots, info_.max_rank, model_->device(), model_->LoraTargets()),
        optimizer_(bank_, info_.moments_on_host),
        // No training graphs across ranks: a captured pass would hold the group's collectives.
        graphs_(train::PassGraphs::Options{
            model_->device().is_cuda() && !model_->parallel().split() ? options.graph_max_tokens : 0,
            /*capture=*/true, [this](int64_t tokens) { return RoomForGraph(tokens); }}) {
    bank_.set_lora_fp32(options.lora_fp32);
    lora_ragged_ = options.lora_ragged && model_->device().is_cuda();
    bank_.AllowRagged(lora_ragged_);
    tp_ = model_->parallel().group.get();
    if (tp_ != nullptr) {
      optimizer_.set_parallel(tp_);
      // The flat columns whose gradient is a part per rank (kPartial).
      std::vector<int64_t> cols;
      for (const LoraTarget& t : bank_.targets()) {
        for (bool a : {true, false}) {
          if ((a ? t.a_shard : t.b_shard).kind != ShardKind::kPartial) continue;
          const int64_t begin = a ? t.a_col : t.b_col, n = a ? t.AElems(bank_.max_rank()) : t.BElems(bank_.max_rank());
          for (int64_t c = begin; c < begin + n; ++c) cols.push_back(c);
        }
      }
      partial_cols_ = at::tensor(cols, at::kLong).to(model_->device());
    }
  }

  const ModelInfo& info() const override { return info_; }
  std::shared_ptr<const Transformer> SharedModel() const override { return model_; }

  Status ValidateForwardBackward(const ForwardBackwardCall& call) const override {
    if (call.slot < 0 || call.slot >= info_.max_slots)
      return Status::Invalid(Cat("slot: ", call.slot, " is outside [0, ", info_.max_slots, ")"));
    if (Status s = train::ValidateCallData(call, info_.vocab_size, info_.context_window); !s.ok()) return s;
    // A datum is never split across passes: one that no pass can hold is
    // refused up front. Any thread: the room of a pass of its slot alone,
    // which reads no slot's state.
    const int64_t limit = RoomTokens(0, -1);
    for (size_t i = 0; limit > 0 && i < call.data.size(); ++i)
      if (static_cast<int64_t>(call.data[i].tokens.size()) > limit)
        return Status::Invalid(Cat("data[", i, "].model_input: ", call.data[i].tokens.size(),
                                   " tokens need more device memory than one training pass has on this server (at "
                                   "most ",
                                   limit, " tokens, every layer recomputed)"));
    return Status::Ok();
  }

  // The probe passes of memory_plan.h on scratch slots (0 and 1, free at
  // start-up), leaving them free and every gradient zero. Device only. Two
  // slots at max rank with unequal shares (3/4 and 1/4 of the tokens) make
  // the pass take the multi-slot grouped LoRA form, in each order a pass may
  // take (ragged, where it is on, and padded, with its gathered copies):
  // each term of the plan is the dearer order's, so that ordinary passes
  // cost no more than measured. On the H100 (qwen3-4b, session 31) the
  // ragged order measured less a token with every layer kept and more with
  // every layer recomputed than the padded one.
  void Calibrate() {
    if (!model_->device().is_cuda()) return;
    const int64_t layers = info_.num_layers;
    const int64_t probe = std::max<int64_t>(16, std::min<int64_t>(1024, info_.context_window / 2));
    const int scratch_slots = std::min(2, info_.max_slots);
    for (int s = 0; s < scratch_slots; ++s) {
      LoraConfig scratch;
      scratch.rank = info_.max_rank;
      scratch.alpha = info_.max_rank;
      scratch.seed = static_cast<uint64_t>(s + 1);
      if (!bank_.Bind(s, scratch).ok()) return;
    }
    auto pass = [&](int64_t tokens, int64_t recompute) {
      std::vector<ForwardBackwardCall> calls(static_cast<size_t>(scratch_slots));
      for (int s = 0; s < scratch_slots; ++s) {
        const int64_t n = scratch_slots == 1 ? tokens : s == 0 ? tokens * 3 / 4 : tokens - tokens * 3 / 4;
        Datum d;
        std::vector<int64_t> targets;
        for (int64_t i = 0; i < n; ++i) {
          d.tokens.push_back(static_cast<int32_t>((i * 7919 + s) % info_.vocab_size));
          targets.push_back((i * 104729 + 1) % info_.vocab_size);
        }
        d.loss_fn_inputs["target_tokens"] = Array::Ints(targets);
        calls[static_cast<size_t>(s)].slot = s;
        calls[static_cast<size_t>(s)].data.push_back(std::move(d));
      }
      const int64_t before = Memory().allocated;
      ResetPeakMemory();
      for (auto& r : train::ForwardBackward(*model_, bank_, calls, info_.vocab_size, info_.context_window, recompute))
        if (!r.ok()) throw std::runtime_error(r.status().message());
      return static_cast<double>(Memory().peak_allocated - before);
    };
    try {
      train::ActivationCost cost;
      for (const bool ragged : lora_ragged_ ? std::vector<bool>{true, false} : std::vector<bool>{false}) {
        bank_.AllowRagged(ragged);
        // First the larger probes' passes, unmeasured: they allocate the
        // gradients, workspaces and kernels' caches that a pass keeps, for
        // both shapes and both plans, so that the measured probes find the
        // allocator as later passes do. Warmed at the smaller probe only,
        // the padded order measured 355 KiB a token with every layer
        // recomputed, and an RL round at the budget that gave (46,966
        // tokens) ran out of device memory; warmed so, 420 KiB (H100,
        // session 31).
        pass(2 * probe, layers);
        pass(2 * probe, 0);
        double m[2][2];
        for (int t = 0; t < 2; ++t)
          for (int k = 0; k < 2; ++k) m[t][k] = pass(probe * (t + 1), k ? layers : 0);
        cost = train::ActivationCost::Dearest(cost, train::ActivationCost::FromProbes(layers, probe, m));
      }
      cost_ = cost;
      probe_tokens_ = probe;
    } catch (const std::exception&) {
      cost_ = {};  // no plan: every pass recomputes every layer
    }
    bank_.AllowRagged(lora_ragged_);
    for (int s = 0; s < scratch_slots; ++s) {
      bank_.Release(s);
      optimizer_.Reset(s);
    }
    ResetPeakMemory();
  }

  void ShareDevice(std::shared_ptr<const DeviceReserve> neighbour) override {
    if (!neighbour) return;
    if (neighbour->turns) turns_.push_back(neighbour->turns);
    neighbours_.push_back(std::move(neighbour));
  }

  // A pass of the slots bound now must fit the room these report once its
  // own plan (Plan) runs, which counts what they cast once and finds their
  // gradient marks allocated: a room without them let the train loop plan
  // passes that plan then refused, each retried call by call (H100, bench
  // rl, session 28).
  int64_t MaxPassTokens() const override { return RoomTokens(SlotBytesOfAPass(), -1); }
  int64_t KeptPassTokens() const override { return RoomTokens(SlotBytesOfAPass(), 0); }

  RecomputeStats TrainRecomputeStats() const override {
    return {recompute_passes_.load(std::memory_order_relaxed), recomputed_layers_.load(std::memory_order_relaxed),
            planned_rows_.load(std::memory_order_relaxed)};
  }

  std::string MemoryPlanReport() const override {
    if (!cost_.known()) return {};
    constexpr double kMiB = 1024.0 * 1024.0;
    return Cat("activations per token ", static_cast<int64_t>(cost_.kept / 1024), " KiB with every layer kept, ",
               static_cast<int64_t>(cost_.recomputed / 1024), " KiB with every layer recomputed, plus ",
               static_cast<int64_t>(cost_.fixed / kMiB), " MiB per pass (probes of ", probe_tokens_, " and ",
               2 * probe_tokens_, " tokens); ", static_cast<int64_t>(FreeForActivations() / kMiB),
               " MiB free for them now", neighbours_.empty() ? std::string() : Cat(", beside ", NeighbourReserve() / (1 << 20),
               " MiB the sampler keeps for its steps"));
  }

  Status BindSlot(int slot, const LoraConfig& config) override {
    if (slot < 0 || slot >= info_.max_slots)
      return Status::Invalid(Cat("slot: ", slot, " is outside [0, ", info_.max_slots, ")"));
    if (config.rank < 1 || config.rank > info_.max_rank)
      return Status::Invalid(
          Cat("rank: ", config.rank, " is outside [1, ", info_.max_rank, "] (the server's max_rank)"));
    if (!config.train_attn && !config.train_mlp && !config.train_unembed)
      return Status::Invalid("train_attn/train_mlp/train_unembed: at least one must be true");
    if (bank_.slot(slot).bound) return Status::Precondition(Cat("slot ", slot, " is already bound"));
    try {
      Status s = bank_.Bind(slot, config);
      optimizer_.Reset(slot);
      return s;
    } catch (const std::exception& e) {
      return FromException("bind", e);
    }
  }

  void ReleaseSlot(int slot) override {
    if (slot < 0 || slot >= info_.max_slots) return;
    bank_.Release(slot);
    optimizer_.Reset(slot);
    marks_.erase(slot);
  }

  std::vector<Result<ForwardBackwardOutput>> ForwardBackward(const std::vector<ForwardBackwardCall>& calls) override {
    UseThisThread();
    const DeviceTurn turn = TakeTurn();
    RECORD_USER_SCOPE("trainer forward_backward");  // a span in a trace (loom bench rl --profile)
    std::vector<Result<ForwardBackwardOutput>> results(calls.size(), Status::Internal("not run"));
    // Where each training slot's gradient stood, to undo a half-done backward.
    std::vector<train::GradMark> before;
    try {
      for (const ForwardBackwardCall& c : calls) {
        if (c.forward_only || !Bound(c.slot)) continue;
        bool seen = false;
        for (const train::GradMark& m : before) seen = seen || m.slot == c.slot;
        if (!seen) before.push_back(train::TakeGradMark(bank_, c.slot));
      }
      const int64_t rows = PassTokens(calls);
      const train::PassPlan plan = Plan(calls, rows);
      if (!plan.fits) return Refuse(calls, plan);
      recompute_passes_.fetch_add(1, std::memory_order_relaxed);
      recomputed_layers_.fetch_add(plan.recompute_layers, std::memory_order_relaxed);
      planned_rows_.fetch_add(rows, std::memory_order_relaxed);
      at::Tensor slots, partial_before;
      if (tp_ != nullptr && !before.empty()) {
        std::vector<int64_t> ids;
        for (const train::GradMark& m : before) ids.push_back(m.slot);
        slots = at::tensor(ids, at::kLong).to(model_->device());
        partial_before = bank_.flat_grad().index_select(0, slots).index_select(1, partial_cols_);
      }
      results = train::ForwardBackward(*model_, bank_, calls, info_.vocab_size, info_.context_window,
                                       plan.recompute_layers,
                                       graphs_.options().max_tokens > 0 ? &graphs_ : nullptr, share_min_rows_);
      if (partial_before.defined()) SumPartialGradients(slots, partial_before);
    } catch (const std::exception& e) {
      for (const train::GradMark& m : before) train::RestoreGradMark(bank_, m);
      for (auto& r : results)
        if (r.ok() || r.status().code() == Code::kInternal) r = FromException("forward_backward", e);
    }
    return results;
  }

  void MarkGrad(int slot) override {
    if (!Bound(slot)) return;
    marks_.insert_or_assign(slot, train::TakeGradMark(bank_, slot));
  }
  void RollbackGrad(int slot) override {
    auto it = marks_.find(slot);
    if (it == marks_.end()) return;
    if (Bound(slot)) train::RestoreGradMark(bank_, it->second);
    marks_.erase(it);
  }
  void ForgetGradMark(int slot) override { marks_.erase(slot); }

  DeviceMemory Memory() const override {
    const AllocatorCounters c = ReadAllocator(model_->device());
    return DeviceMemory{c.allocated, c.peak_allocated, c.reserved, c.mallocs, c.retries};
  }
  GraphStats TrainGraphStats() const override {
    const auto& s = graphs_.stats();
    return GraphStats{s.passes, s.captures, s.replays, s.pool_bytes};
  }
  void ResetPeakMemory() override { ResetAllocatorPeak(model_->device()); }

  std::vector<Result<OptimStepOutput>> OptimStep(const std::vector<OptimStepCall>& calls) override {
    UseThisThread();
    const DeviceTurn turn = TakeTurn();
    RECORD_USER_SCOPE("trainer optim_step");
    try {
      return optimizer_.Step(bank_, calls);
    } catch (const std::exception& e) {
      return std::vector<Result<OptimStepOutput>>(calls.size(), FromException("optim_step", e));
    }
  }

  Status SaveState(int slot, const std::string& dir) override {
    try {
      if (tp_ != nullptr) {  // the whole adapter, written by rank 0
        if (!Bound(slot)) return train::SaveSlotState(bank_, optimizer_, slot, dir);  // its error, on every rank
        train::WholeSlot whole = train::GatherSlot(bank_, optimizer_, slot, model_->WholeLoraTargets(), *tp_);
        return tp_->rank() == 0 ? train::SaveSlotState(*whole.bank, *whole.optimizer, 0, dir) : Status::Ok();
      }
      return train::SaveSlotState(bank_, optimizer_, slot, dir);
    } catch (const std::exception& e) {
      return FromException("save_state", e);
    }
  }

  Status LoadState(int slot, const std::string& dir, bool with_optimizer) override {
    try {
      if (tp_ != nullptr && Bound(slot)) {  // every rank reads the whole adapter and keeps its part
        train::WholeSlot whole = train::MakeWholeSlot(bank_, model_->WholeLoraTargets());
        if (Status s = whole.bank->Bind(0, bank_.slot(slot).config); !s.ok()) return s;
        if (Status s = train::LoadSlotState(*whole.bank, *whole.optimizer, 0, dir, with_optimizer); !s.ok()) return s;
        train::ScatterSlot(whole, bank_, optimizer_, slot);
        return Status::Ok();
      }
      return train::LoadSlotState(bank_, optimizer_, slot, dir, with_optimizer);
    } catch (const std::exception& e) {
      return FromException("load_state", e);
    }
  }

  Result<std::shared_ptr<const SlotSnapshot>> SnapshotForSampler(int slot) override {
    if (slot < 0 || slot >= info_.max_slots)
      return Status::Invalid(Cat("slot: ", slot, " is outside [0, ", info_.max_slots, ")"));
    if (!bank_.slot(slot).bound) return Status::Precondition(Cat("slot ", slot, " is not bound to a model"));
    RECORD_USER_SCOPE("trainer snapshot");  // a span in a trace: what a save's engine time waits on
    try {
      if (tp_ != nullptr) {  // the whole adapter (every rank gathers; rank 0's is the one used)
        train::WholeSlot whole = train::GatherSlot(bank_, optimizer_, slot, model_->WholeLoraTargets(), *tp_);
        auto snapshot = PeftSnapshot::Take(*whole.bank, 0);
        if (!snapshot.ok()) return snapshot.status();
        return std::shared_ptr<const SlotSnapshot>(std::move(*snapshot));
      }
      auto snapshot = PeftSnapshot::Take(bank_, slot);
      if (!snapshot.ok()) return snapshot.status();
      return std::shared_ptr<const SlotSnapshot>(std::move(*snapshot));
    } catch (const std::exception& e) {
      return FromException("save_weights_for_sampler", e);
    }
  }

  void PrepareSnapshotWriter() const override {
    if (!bank_.flat().is_cuda()) return;
    // A snapshot is at most a slot's whole flat row (CopyPeft); over ranks
    // the gathered adapter is at most every rank's row.
    const int64_t row = bank_.flat().size(1) * static_cast<int64_t>(bank_.flat().element_size());
    const int64_t bytes = row * (tp_ != nullptr ? tp_->size() : 1);
    try {
      PeftSnapshot::ReserveWriteStaging(bytes);
    } catch (const std::exception& e) {  // the writes take it themselves then (and fail there if they cannot)
      log::Warn("snapshot writer: {} MiB of pinned host memory could not be taken ahead: {}", bytes >> 20, e.what());
    }
  }
  void ReleaseSnapshotWriter() const override { PeftSnapshot::ReleaseWriteStaging(); }

 private:
  // Device memory a pass may fill: 90% of the device (the caching
  // allocator's rounding and fragmentation take the rest) less what live
  // tensors hold now (weights, slots, moments, the sampler's KV cache), the
  // training graphs' pool and what the device's other users keep in reserve
  // (ShareDevice: the sampler's largest step and its graphs' idle pool).
  double FreeForActivations() const {
#if LOOM_CUDA_KERNELS
    if (model_->device().is_cuda()) {
      const auto* props = at::cuda::getDeviceProperties(model_->device().index() < 0 ? 0 : model_->device().index());
      // The training graphs' pool is reserved for them, allocated or not.
      return 0.90 * static_cast<double>(props->totalGlobalMem) - static_cast<double>(Memory().allocated) -
             static_cast<double>(graphs_.stats().pool_bytes) - static_cast<double>(NeighbourReserve());
    }
#endif
    return 0;
  }
  // A pass's or a step's turns on the device shared with the samplers that
  // take turns (DeviceReserve::turns), in a fixed order; on leaving, the
  // device's queued work is done first, so the next holder never waits on it.
  struct DeviceTurn {
    std::vector<DeviceTurns::Turn> turns;
    at::Device device = at::kCPU;
    DeviceTurn() = default;
    DeviceTurn(DeviceTurn&&) = default;
    ~DeviceTurn() {
      if (!turns.empty()) SynchronizeDevice(device);
    }
  };
  DeviceTurn TakeTurn() const {
    DeviceTurn t;
    t.device = model_->device();
    for (const auto& turns : turns_) t.turns.push_back(turns->Take());
    return t;
  }

  int64_t NeighbourReserve() const {
    int64_t bytes = 0;
    for (const auto& n : neighbours_) bytes += n->bytes.load(std::memory_order_relaxed);
    return bytes;
  }

  // The rows the pass trains: every datum's tokens less the shared
  // prefixes' repeats (invalid calls are left out of the pass later, and a
  // call's sharing depends on its data alone, so this is an upper bound on
  // what it holds).
  int64_t PassTokens(const std::vector<ForwardBackwardCall>& calls) const {
    return train::SharedPassRows(calls, share_min_rows_);
  }

  // How many layers this pass recomputes: the fixed count asked for, or the
  // fewest that fit (all of them where nothing was measured, on a GPU).
  train::PassPlan Plan(const std::vector<ForwardBackwardCall>& calls, int64_t tokens) const {
    if (recompute_layers_ >= 0) return {true, recompute_layers_, 0};
    if (!model_->device().is_cuda()) return {true, 0, 0};
    if (!cost_.known()) return {true, info_.num_layers, 0};
    std::set<int> slots;
    for (const ForwardBackwardCall& c : calls)
      if (!c.forward_only) slots.insert(c.slot);
    return train::PlanPass(cost_, tokens, FreeForActivations() - CastOnceBytes(static_cast<int64_t>(slots.size())));
  }

  // What a pass of this many training slots casts once (PassGroup) beyond
  // the calibration probes' two slots, which the measured costs include.
  double CastOnceBytes(int64_t slots) const {
    if (slots <= 2 || slots > SlotBank::kCastOncePerPassUpTo) return 0;
    return static_cast<double>(slots - 2) * bank_.PassGroupBytes(model_->dtype());
  }
  // The most tokens a pass holds in the memory free now less `beside`
  // bytes, with recompute_layers recomputed (-1: all); 0 where nothing was
  // measured (the CPU), else at least 1.
  int64_t RoomTokens(double beside, int64_t recompute_layers) const {
    if (!cost_.known()) return 0;
    return std::max<int64_t>(1, train::MaxPassTokens(cost_, FreeForActivations() - beside, recompute_layers));
  }
  // What a pass of every slot bound now holds beside its activations, at
  // most: their casts (CastOnceBytes, up to kCastOncePerPassUpTo slots),
  // and a gradient mark (ForwardBackward's TakeGradMark: a copy of the
  // slot's gradient row) of each whose gradient is not zero, as a slot in
  // the middle of a request split over passes has.
  double SlotBytesOfAPass() const {
    int64_t bound = 0, dirty = 0;
    for (int i = 0; i < info_.max_slots; ++i) {
      bound += bank_.slot(i).bound ? 1 : 0;
      dirty += bank_.slot(i).bound && bank_.slot(i).grad_dirty ? 1 : 0;
    }
    const at::Tensor& grad = bank_.flat_grad();
    const double mark = grad.defined() ? static_cast<double>(grad.size(1)) * static_cast<double>(grad.element_size()) : 0;
    return CastOnceBytes(std::min<int64_t>(bound, SlotBank::kCastOncePerPassUpTo)) + static_cast<double>(dirty) * mark;
  }

  std::vector<Result<ForwardBackwardOutput>> Refuse(const std::vector<ForwardBackwardCall>& calls,
                                                    const train::PassPlan& plan) const {
    const int64_t tokens = PassTokens(calls);
    constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
    const Status s = Status::Exhausted(
        Cat("forward_backward: a pass of ", tokens, " tokens needs about ", static_cast<int64_t>(plan.bytes / kGiB),
            " GiB of activations with every layer recomputed; ", static_cast<int64_t>(FreeForActivations() / kGiB),
            " GiB is free on the device now (at most ", MaxPassTokens(), " tokens per pass)"));
    return std::vector<Result<ForwardBackwardOutput>>(calls.size(), s);
  }

  bool Bound(int slot) const { return slot >= 0 && slot < info_.max_slots && bank_.slot(slot).bound; }

  // After a pass split over ranks: the gradient it added to the kPartial
  // columns of `slots` (each rank a part) summed over the ranks, so that
  // every rank holds the whole factor's gradient (parallel.h).
  void SumPartialGradients(const at::Tensor& slots, const at::Tensor& before) {
    c10::NoGradGuard no_grad;
    const at::Tensor& grad = bank_.flat_grad();
    at::Tensor added = grad.index_select(0, slots).index_select(1, partial_cols_) - before;
    tp_->AllReduceSum(added);
    grad.index_put_({slots.unsqueeze(1), partial_cols_.unsqueeze(0)}, before + added);
  }

  // A new graph shape of this many padded tokens: its eager first pass must
  // fit with every layer kept, as the graphs keep them (and the pool then
  // holds about that much). Without a measured plan the packed path runs.
  bool RoomForGraph(int64_t tokens) const {
    if (!cost_.known()) return false;
    // A graph's slots are not known here: room for the most that cast once.
    const train::PassPlan p =
        train::PlanPass(cost_, tokens, FreeForActivations() - CastOnceBytes(SlotBank::kCastOncePerPassUpTo));
    return p.fits && p.recompute_layers == 0;
  }

  // OpenMP's thread count is a per-thread setting: a new engine thread would
  // otherwise run with the runtime's default rather than options.threads.
  void UseThisThread() {
    const std::thread::id me = std::this_thread::get_id();
    if (me == configured_thread_) return;
    at::set_num_threads(threads_);
    configured_thread_ = me;
  }

  int threads_;
  bool lora_ragged_ = false;  // EngineOptions::lora_ragged, on a GPU
  int64_t recompute_layers_;  // -1: planned per pass
  int64_t share_min_rows_;    // shared prefixes (train/shared_prefix.h): 0 = off
  std::atomic<int64_t> recompute_passes_{0}, recomputed_layers_{0}, planned_rows_{0};  // TrainRecomputeStats
  train::ActivationCost cost_;  // measured by Calibrate (unknown on the CPU)
  int64_t probe_tokens_ = 0;
  std::vector<std::shared_ptr<const DeviceReserve>> neighbours_;  // ShareDevice
  std::vector<std::shared_ptr<DeviceTurns>> turns_;               // theirs that take turns
  std::thread::id configured_thread_ = std::this_thread::get_id();
  std::shared_ptr<Transformer> model_;  // shared with the Sampler (SharedModel)
  ModelInfo info_;
  SlotBank bank_;
  train::SlotOptimizer optimizer_;
  train::PassGraphs graphs_;  // small passes as CUDA graphs (GPU only)
  std::map<int, train::GradMark> marks_;  // MarkGrad's, by slot
  Collective* tp_ = nullptr;  // the ranks the model is split over (model_->parallel()); null: whole
  at::Tensor partial_cols_;   // with tp_: the flat columns of kPartial factors
};

// Memory the adapter slots may take: 80% of what the device has beside the
// live tensors (the base weights) on CUDA, 80% of physical RAM on the CPU.
// The rest is left to passes, the sampler and the allocator's slack.
double RoomForSlots(at::Device device) {
  if (device.is_cuda()) return 0.8 * DeviceFreeBytes(device);
  return 0.8 * static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

// 80% of the host memory available now (HostAvailableBytes).
double HostRoom() { return 0.8 * HostAvailableBytes(); }

// Where the slots' moments go (EngineOptions::moments) and whether
// max_slots slots fit there, before any exists: an MoE slot at max rank is
// gigabytes (docs/architecture.md, expert LoRA layout). Fills info's slot
// bytes; Invalid naming the flag and the room when they do not fit.
// A max_slots of 0 is planned here (kAutoSlotShare of the room, resident
// moments); info->max_slots is the count used.
Status PlanSlotMemory(const EngineOptions& options, at::Device device, int64_t slot_elems, ModelInfo* info) {
  const std::string& where = options.moments;
  if (where != "auto" && where != "device" && where != "host")
    return Status::Invalid(Cat("moments: '", where, "' is not auto, device or host"));
  if (!(options.memory_share > 0 && options.memory_share <= 1))
    return Status::Invalid(Cat("memory_share: ", options.memory_share, " is outside (0, 1]"));
  const double room = options.memory_share * RoomForSlots(device);
  const double resident = 16.0 * static_cast<double>(slot_elems), split = 8.0 * static_cast<double>(slot_elems);
  info->slot_room_bytes = static_cast<int64_t>(room);
  if (info->auto_slots) {
    const double per = where == "host" ? split : resident;
    info->max_slots = static_cast<int>(std::clamp<double>(std::floor(kAutoSlotShare * room / per), 1, kAutoSlotCap));
  }
  const double slots = info->max_slots;
  // On the CPU the host is the device: "host" only changes the code path,
  // and the host's room is the device's (checked above as room).
  const double host_room = device.is_cuda() ? HostRoom() : HUGE_VAL;
  const bool host = where == "host" || (where == "auto" && device.is_cuda() && resident * slots > room &&
                                        split * slots <= room && split * slots <= host_room);
  info->moments_on_host = host;
  info->slot_bytes = static_cast<int64_t>(host ? split : resident);
  info->slot_host_bytes = host ? static_cast<int64_t>(split) : 0;
  constexpr double kMiB = 1024.0 * 1024.0;
  const auto mib = [&](double b) { return static_cast<int64_t>(b / kMiB); };
  if (static_cast<double>(info->slot_bytes) * slots > room) {
    return Status::Invalid(Cat("max_slots: ", info->max_slots, " adapter slots at max_rank ", info->max_rank,
                               " need ", mib(static_cast<double>(info->slot_bytes) * slots), " MiB on the ",
                               info->device, " (", mib(static_cast<double>(info->slot_bytes)), " MiB each: fp32 weights, gradient",
                               host ? "; the AdamW moments on the host" : " and two AdamW moments", "); it has room for ",
                               static_cast<int64_t>(room / static_cast<double>(info->slot_bytes)),
                               " (80% of the memory beside the base weights",
                               options.memory_share < 1 ? Cat(", this model's share of ", options.memory_share) : std::string(),
                               "); lower --max-adapters or --max-rank",
                               host ? "" : ", or put the moments on the host (--moments host)"));
  }
  if (host && split * slots > host_room) {
    return Status::Invalid(Cat("max_slots: ", info->max_slots, " adapter slots at max_rank ", info->max_rank,
                               " need ", mib(split * slots), " MiB of host memory for their AdamW moments (",
                               mib(split), " MiB each); the host has room for ",
                               static_cast<int64_t>(host_room / split),
                               " (80% of its free memory); lower --max-adapters or --max-rank"));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Engine>> OpenTrainingEngine(const EngineOptions& options, std::shared_ptr<Collective>* group) {
  if (options.max_slots < 0) return Status::Invalid(Cat("max_slots: ", options.max_slots, " must be >= 1, or 0 (auto)"));
  if (options.max_rank < 0) return Status::Invalid(Cat("max_rank: ", options.max_rank, " must be >= 1, or 0 (auto)"));
  if (options.recompute_layers < -1)
    return Status::Invalid(Cat("recompute_layers: ", options.recompute_layers, " must be >= 0, or -1 (auto)"));
  if (options.context_window < 0)
    return Status::Invalid(Cat("context_window: ", options.context_window, " must be >= 0"));
  if (options.graph_max_tokens < 0)
    return Status::Invalid(Cat("graph_max_tokens: ", options.graph_max_tokens, " must be >= 0"));
  at::Device device = at::kCPU;
  if (Status s = ResolveDevice(options.device, &device); !s.ok()) return s;
  auto resolved_dtype = ResolveDtype(options.dtype, device);
  if (!resolved_dtype.ok()) return resolved_dtype.status();
  const at::ScalarType dtype = *resolved_dtype;
  const int threads = options.threads > 0 ? options.threads
                                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  at::set_num_threads(threads);
  try {
    Parallel parallel;
    const int size = std::max(options.tp_size, options.ep_size);
    if ((options.tp_size != 1 && options.tp_size != size) || (options.ep_size != 1 && options.ep_size != size))
      return Status::Invalid(Cat("tp ", options.tp_size, " and ep ", options.ep_size,
                                 ": each is 1 or the group's size (both split the same ranks)"));
    if (options.group_rank < 0 || options.group_rank >= size)
      return Status::Invalid(Cat("group_rank: ", options.group_rank, " of ", size));
    if (size > 1) {
      if (options.group_store.empty()) return Status::Invalid("group_store: a rendezvous path is needed for tp or ep > 1");
      // One GPU per rank: rank r takes its machine's cuda:(r mod GPUs) unless told which (cuda:N).
      if (device.is_cuda() && options.device.find(':') == std::string::npos)
        device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(
                                           options.group_rank % std::max<int>(1, static_cast<int>(at::getNumGPUs()))));
#if LOOM_CUDA_KERNELS
      if (device.is_cuda()) c10::cuda::set_device(device.index());  // the default stream and allocator of this rank's GPU
#endif
      auto config = ModelConfig::Load(options.model_dir);
      if (!config.ok()) return config.status();
      if (Status s = Transformer::SplitSupport(*config, options.tp_size, options.ep_size); !s.ok()) return s;
      auto opened = OpenCollective(options.group_store, options.group_rank, size, device);
      if (!opened.ok()) return opened.status();
      parallel = Parallel{options.group_rank, size, *opened, options.tp_size > 1, options.ep_size > 1};
      if (group != nullptr) *group = parallel.group;
    }
    auto model = Transformer::Load(options.model_dir, device, dtype, parallel);
    if (!model.ok()) return model.status();
    const ModelConfig& cfg = (*model)->config();
    ModelInfo info;
    info.model_type = cfg.model_type;
    info.device = device.is_cuda() ? "cuda" : "cpu";
    info.dtype = dtype == at::kBFloat16 ? "bfloat16" : "float32";
    info.vocab_size = cfg.vocab_size;
    info.context_window = options.context_window > 0 ? options.context_window : cfg.max_position_embeddings;
    info.num_layers = cfg.num_hidden_layers;
    info.hidden_size = cfg.hidden_size;
    info.auto_slots = options.max_slots == 0;
    info.auto_rank = options.max_rank == 0;
    info.max_slots = options.max_slots;
    info.max_rank = info.auto_rank ? (cfg.num_experts > 0 ? kAutoMoeRank : kAutoDenseRank) : options.max_rank;
    for (const auto& [name, shape] : Transformer::ExpectedWeights(cfg)) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      info.base_parameters += n;
      const bool expert = name.find(".mlp.experts.") != std::string::npos;
      info.active_parameters += expert ? n * cfg.num_experts_per_tok / cfg.num_experts : n;
    }
    // The slots are checked against memory before they exist: an MoE slot
    // at max rank is gigabytes (docs/architecture.md, expert LoRA layout).
    int64_t slot_elems = 0;
    for (const LoraTargetSpec& t : (*model)->LoraTargets()) slot_elems += t.AElems(info.max_rank) + t.BElems(info.max_rank);
    if (Status s = PlanSlotMemory(options, device, slot_elems, &info); !s.ok()) return s;
    auto engine = std::make_unique<TrainingEngine>(std::move(*model), std::move(info), options, threads);
    if (options.recompute_layers < 0) engine->Calibrate();
    return std::unique_ptr<Engine>(std::move(engine));
  } catch (const std::exception& e) {
    return FromException("open", e);
  }
}

Result<StateInfo> Engine::ReadStateInfo(const std::string& dir) { return train::ReadStateInfo(dir); }

}  // namespace loom::engine
