#include "engine/io/peft_snapshot.h"

#if LOOM_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <exception>

#include "common/durable.h"

namespace loom::engine {

#if LOOM_CUDA_KERNELS
namespace {
// WritePeft's device-to-host copy, in pieces of this many bytes.
constexpr int64_t kCopyPieceBytes = int64_t{8} << 20;
}  // namespace

struct PeftSnapshot::CopyDone {
  // block() records nothing; it only makes a stream wait (cudaStreamWaitEvent).
  mutable at::cuda::CUDAEvent event;
};
#else
struct PeftSnapshot::CopyDone {};
#endif

PeftSnapshot::PeftSnapshot(PeftAdapter adapter, PeftPlaces places, std::unique_ptr<CopyDone> done)
    : adapter_(std::move(adapter)), places_(std::move(places)), done_(std::move(done)) {}

const PeftAdapter& PeftSnapshot::adapter() const {
  // Views only: no kernel, no stream (the storage's values are the copy's, read after Ready()).
  std::call_once(viewed_, [this] {
    if (adapter_.storage.defined()) ViewFactors(adapter_, places_);
  });
  return adapter_;
}

PeftSnapshot::~PeftSnapshot() = default;

Result<std::shared_ptr<const PeftSnapshot>> PeftSnapshot::Take(const SlotBank& bank, int slot) {
  PeftPlaces places;
  Result<PeftAdapter> copy = CopyPeft(bank, slot, &places);
  if (!copy.ok()) return copy.status();
  std::unique_ptr<CopyDone> done;
#if LOOM_CUDA_KERNELS
  if (copy->storage.defined() && copy->storage.is_cuda()) {
    done = std::make_unique<CopyDone>();
    done->event.record(at::cuda::getCurrentCUDAStream(copy->storage.device().index()));
  }
#endif
  return std::shared_ptr<const PeftSnapshot>(new PeftSnapshot(std::move(*copy), std::move(places), std::move(done)));
}

void PeftSnapshot::Ready() const {
#if LOOM_CUDA_KERNELS
  if (done_) {
    const c10::cuda::CUDAStream reader = at::cuda::getCurrentCUDAStream(adapter_.storage.device().index());
    done_->event.block(reader);
    // The storage was allocated on the trainer's stream: when the snapshot
    // is freed, its memory must not go back to that stream's pool before
    // this stream's reads of it (queued asynchronously) have run.
    c10::cuda::CUDACachingAllocator::recordStream(adapter_.storage.storage().data_ptr(), reader);
  }
#endif
}

#if LOOM_CUDA_KERNELS
namespace {
// The pinned staging buffer of a thread readied to write snapshots
// (ReserveWriteStaging), undefined on any other thread. Released by
// ReleaseWriteStaging before the thread ends, not by the thread_local's
// destructor: at thread exit, thread_locals made after it on this thread
// (c10's current streams, made by the first write's stream guard) are
// destroyed before it, and its block's return to the host allocator records
// events on streams. Whether that was 5d8dcae's fault on the GPU (session
// 42) is not yet known.
at::Tensor& ThreadStaging() {
  thread_local at::Tensor staging;
  return staging;
}
}  // namespace
#endif

void PeftSnapshot::ReserveWriteStaging(int64_t bytes) {
#if LOOM_CUDA_KERNELS
  at::Tensor& staging = ThreadStaging();
  if (bytes > 0 && (!staging.defined() || staging.numel() < bytes))
    staging = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
#else
  (void)bytes;
#endif
}

void PeftSnapshot::ReleaseWriteStaging() {
#if LOOM_CUDA_KERNELS
  ThreadStaging() = at::Tensor();
#endif
}

Status PeftSnapshot::WritePeft(const std::string& dir, const std::string& base_model_name) const {
  try {
    return durable::PublishDirectory(dir, [&](const std::string& tmp) {
#if LOOM_CUDA_KERNELS
      if (done_) {
        // The device-to-host copy on a stream of its own: on the trainer's
        // stream it would hold up every kernel queued behind it.
        c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, adapter_.storage.device().index());
        c10::cuda::CUDAStreamGuard guard(side);
        Ready();
        // Into pinned memory (a writer thread's own, ReserveWriteStaging,
        // reused from one write to the next; else the caching host
        // allocator's): a DMA the side stream runs, where a
        // pageable destination is staged by the driver through its own
        // buffers, on this thread, for the whole copy. In pieces, each
        // waited for: the sampler copies each decode step's tokens to the
        // host, and a copy queued behind a whole snapshot's (hundreds of
        // MB, ~10 ms) would wait for all of it; behind a piece it waits at
        // most ~0.3 ms.
        const at::Tensor& storage = adapter_.storage;  // contiguous (CopyPeft)
        const int64_t nbytes = static_cast<int64_t>(storage.nbytes());
        at::Tensor host;
        if (ThreadStaging().defined()) {  // a writer thread's own (grown if this snapshot is bigger)
          ReserveWriteStaging(nbytes);
          host = ThreadStaging().narrow(0, 0, nbytes).view(storage.scalar_type()).view(storage.sizes());
        } else {
          host = at::empty(storage.sizes(), storage.options().device(at::kCPU).pinned_memory(true));
        }
        const at::Tensor from = storage.view({-1}), to = host.view({-1});
        const int64_t n = from.numel(), piece = std::max<int64_t>(1, kCopyPieceBytes / from.element_size());
        for (int64_t off = 0; off < n; off += piece) {
          const int64_t len = std::min(piece, n - off);
          to.narrow(0, off, len).copy_(from.narrow(0, off, len), /*non_blocking=*/true);
          side.synchronize();
        }
        return engine::WritePeft(adapter().WithStorage(host), tmp, base_model_name);
      }
#endif
      return engine::WritePeft(adapter().To(at::kCPU), tmp, base_model_name);
    });
  } catch (const std::exception& e) {
    return Status::Internal(std::string("writing the PEFT snapshot failed: ") + e.what());
  }
}

}  // namespace loom::engine
