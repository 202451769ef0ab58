// DeviceReserve: device memory that one user of a GPU (the sampler beside
// the trainer) keeps in reserve beyond what its live tensors hold: the
// working memory of its largest step (measured at its start-up) and the
// idle part of its decode graphs' pool. The trainer leaves it out of the
// room it plans its passes in (Engine::ShareDevice), so that a sampler step
// never finds the device's limit by running out of memory beside a pass.
//
// Threading: written by its owner, read from any thread.
#pragma once
#include <atomic>
#include <cstdint>

namespace loom::engine {

struct DeviceReserve {
  std::atomic<int64_t> bytes{0};
};

}  // namespace loom::engine
