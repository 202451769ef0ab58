// PeftSnapshot: the engine's SlotSnapshot (api.h). A PeftAdapter copied out
// of a trainer slot (CopyPeft: one buffer on the engine's device) plus, on
// CUDA, an event recorded after the copy's kernels, so that a reader on
// another thread waits for exactly them and not for the training queued
// behind them.
//
// Readers: the service's writer thread (WritePeft: the buffer to pinned host
// memory on a stream of its own, synchronized before it returns, then the
// files) and
// the sampler's decode thread (adapter(), installed into its own bank after
// Ready(), which also tells the caching allocator that the reader's stream
// uses the buffer, so it may be freed as soon as the install is queued,
// whichever stream that is).
//
// Threading: Take on the engine thread; everything else any thread, at once.
#pragma once
#include <memory>
#include <mutex>
#include <string>

#include "engine/api.h"
#include "engine/io/peft.h"

namespace loom::engine {

class PeftSnapshot final : public SlotSnapshot {
 public:
  // Copies bound slot s of bank (CopyPeft) on the current stream.
  static Result<std::shared_ptr<const PeftSnapshot>> Take(const SlotBank& bank, int slot);
  ~PeftSnapshot() override;

  // On the bank's device. Call Ready() on the thread that reads it first.
  // Its factors' views are made on the first call (not on the engine
  // thread, which only copied the storage: CopyPeft's deferred places).
  const PeftAdapter& adapter() const;
  // Makes the calling thread's current stream wait for the copy and records
  // the buffer's use on it (CUDA; a no-op on the CPU, where the copy is done
  // when Take returns).
  void Ready() const;

  Status WritePeft(const std::string& dir, const std::string& base_model_name) const override;
  // Gives the calling thread pinned host memory for WritePeft to stage
  // snapshots of up to `bytes` through, kept until ReleaseWriteStaging (a
  // bigger snapshot grows it at its write); a thread without it stages each
  // write through the caching host allocator. CUDA builds only; no-ops else.
  static void ReserveWriteStaging(int64_t bytes);
  // Gives it back; the thread calls it before it ends.
  static void ReleaseWriteStaging();
  int64_t bytes() const override { return adapter_.bytes(); }

 private:
  struct CopyDone;  // the CUDA event, where there is one
  PeftSnapshot(PeftAdapter adapter, PeftPlaces places, std::unique_ptr<CopyDone> done);
  mutable PeftAdapter adapter_;  // its factors made once, under viewed_
  PeftPlaces places_;
  mutable std::once_flag viewed_;
  std::unique_ptr<CopyDone> done_;
};

}  // namespace loom::engine
