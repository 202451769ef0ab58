#include "engine/train/pass_graphs.h"

#include <cmath>
#include <exception>

#include "common/log.h"
#include "engine/lora/lora_nodes.h"

#if LOOM_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace loom::engine::train {

struct PassGraphs::Entry {
  explicit Entry(const UniformKey& key, at::Device device) : pass(key, device) {}
  UniformPass pass;
#if LOOM_CUDA_KERNELS
  std::unique_ptr<at::cuda::CUDAGraph> forward, backward;
#endif
  bool captured() const {
#if LOOM_CUDA_KERNELS
    return forward != nullptr;
#else
    return false;
#endif
  }
};

#if LOOM_CUDA_KERNELS
struct PassGraphs::Cuda {
  explicit Cuda(int device) : stream(at::cuda::getStreamFromPool(false, device)), pool(at::cuda::graph_pool_handle()) {}
  at::cuda::CUDAStream stream;
  decltype(at::cuda::graph_pool_handle()) pool;
};

namespace {
int64_t ReservedBytes(int device) {
  constexpr size_t all = 0;  // StatType::AGGREGATE
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device).reserved_bytes[all].current;
}
}  // namespace
#else
struct PassGraphs::Cuda {};
#endif

PassGraphs::PassGraphs(Options options) : options_(options) {}
PassGraphs::~PassGraphs() = default;

std::optional<UniformResult> PassGraphs::Run(const Transformer& model, SlotBank& bank, const LossSpec& spec,
                                             const std::vector<const Datum*>& data, const std::vector<int>& slots) {
  // MoE and MLA passes run in the packed layout (the graphs' layers are the dense attention's).
  if (model.config().num_experts > 0 || model.config().IsMla()) return std::nullopt;
  std::vector<int64_t> lengths;
  for (const Datum* d : data) lengths.push_back(static_cast<int64_t>(d->tokens.size()));
  const auto shape = UniformShapeFor(lengths, options_.max_tokens);
  if (!shape) return std::nullopt;
  UniformKey key;
  key.shape = *shape;
  key.spec = spec;
  for (int s : slots) {
    key.attn = key.attn || bank.trains(s, TargetGroup::kAttn);
    key.mlp = key.mlp || bank.trains(s, TargetGroup::kMlp);
    key.unembed = key.unembed || bank.trains(s, TargetGroup::kUnembed);
  }
  const at::Device device = model.device();
  std::unique_ptr<Entry>& e = entries_[key.ToString()];
  if (!e) e = std::make_unique<Entry>(key, device);
  const bool capture = options_.capture && device.is_cuda();
  if (!capture) return RunEntry(*e, model, bank, data, slots);
  if (!e->captured() && options_.room && !options_.room(key.shape.tokens())) return std::nullopt;
#if LOOM_CUDA_KERNELS
  const int index = device.index() < 0 ? 0 : device.index();
  if (!cuda_) cuda_ = std::make_unique<Cuda>(index);
  // The graphs' stream starts after the caller's earlier work (the last
  // optimizer step's writes) and the caller's later work after it.
  const at::cuda::CUDAStream caller = at::cuda::getCurrentCUDAStream(index);
  at::cuda::CUDAEvent ready;
  ready.record(caller);
  ready.block(cuda_->stream);
  std::optional<UniformResult> out;
  {
    c10::cuda::CUDAStreamGuard guard(cuda_->stream);
    out = RunEntry(*e, model, bank, data, slots);
    if (!e->captured() && out) Capture(*e, model, bank);
  }
  at::cuda::CUDAEvent done;
  done.record(cuda_->stream);
  done.block(caller);
  return out;
#else
  return RunEntry(*e, model, bank, data, slots);
#endif
}

std::optional<UniformResult> PassGraphs::RunEntry(Entry& e, const Transformer& model, SlotBank& bank,
                                                  const std::vector<const Datum*>& data,
                                                  const std::vector<int>& slots) {
  UniformPass& p = e.pass;
  p.Load(bank, data, slots);
#if LOOM_CUDA_KERNELS
  if (e.captured()) e.forward->replay();
#endif
  if (!e.captured()) p.Forward(model, bank);
  const at::Tensor loss_host = p.seq_loss().to(at::kDouble).cpu();
  const double* loss = loss_host.data_ptr<double>();
  for (size_t i = 0; i < data.size(); ++i)
    if (!std::isfinite(loss[i])) {
      ++stats_.not_finite;
      if (!e.captured()) p.Drop();  // its gradient is never applied
      return std::nullopt;
    }
  // Each slot's gradient may now be non-zero (as the packed pass marks it).
  for (int s : slots) bank.slot(s).grad_dirty = true;
#if LOOM_CUDA_KERNELS
  if (e.captured()) {
    e.backward->replay();
    ++stats_.replays;
  }
#endif
  if (!e.captured()) p.Backward();
  ++stats_.passes;
  UniformResult r;
  r.len = p.key().shape.len;
  r.logprobs = p.logprobs().cpu();
  r.elementwise = p.elementwise().cpu();
  r.loss.assign(loss, loss + data.size());
  return r;
}

void PassGraphs::Capture(Entry& e, const Transformer& model, SlotBank& bank) {
#if LOOM_CUDA_KERNELS
  const int index = model.device().index() < 0 ? 0 : model.device().index();
  // Every .grad the backward adds into must exist before the capture: one
  // made inside it would live in the graphs' pool.
  for (LoraTarget& t : bank.targets()) {
    FactorGrad(t.A);
    FactorGrad(t.B);
  }
  cuda_->stream.synchronize();
  const int64_t before = ReservedBytes(index);
  auto forward = std::make_unique<at::cuda::CUDAGraph>();
  auto backward = std::make_unique<at::cuda::CUDAGraph>();
  try {
    // Thread-local mode: the sampler may use the device from its own thread meanwhile.
    forward->capture_begin(cuda_->pool, cudaStreamCaptureModeThreadLocal);
    try {
      e.pass.Forward(model, bank);
    } catch (...) {
      try { forward->capture_end(); } catch (...) {}
      throw;
    }
    forward->capture_end();
    backward->capture_begin(cuda_->pool, cudaStreamCaptureModeThreadLocal);
    try {
      e.pass.Backward();
    } catch (...) {
      try { backward->capture_end(); } catch (...) {}
      throw;
    }
    backward->capture_end();
  } catch (const std::exception& ex) {
    log::Warn("training graphs: capturing {} failed, small passes run eagerly from now on: {}",
              e.pass.key().ToString(), ex.what());
    options_.capture = false;
    return;
  }
  cuda_->stream.synchronize();
  e.forward = std::move(forward);
  e.backward = std::move(backward);
  ++stats_.captures;
  stats_.pool_bytes += ReservedBytes(index) - before;
  log::Info("training graphs: captured {} (graph pool {} MiB)", e.pass.key().ToString(),
            stats_.pool_bytes / (1024 * 1024));
#else
  (void)e;
  (void)model;
  (void)bank;
#endif
}

}  // namespace loom::engine::train
