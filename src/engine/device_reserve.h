// What a second user of a GPU (the sampler beside the trainer) asks of the
// trainer there:
// - DeviceReserve::bytes: device memory it keeps in reserve beyond what its
//   live tensors hold: the working memory of its largest step (measured at
//   its start-up) and the idle part of its decode graphs' pool. The trainer
//   leaves it out of the room it plans its passes in (Engine::ShareDevice),
//   so that a sampler step never finds the device's limit by running out of
//   memory beside a pass.
// - DeviceReserve::turns (when set): the two take turns on the device, in
//   arrival order, instead of interleaving their kernels on one stream. A
//   turn ends with the device's queued work done, so a sampler step never
//   waits for a pass's queued kernels and a pass runs at its own speed.
//
// Threading: bytes written by its owner, read from any thread; DeviceTurns
// from any thread.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

namespace loom::engine {

// A first-come, first-served lock over the device (a ticket lock).
class DeviceTurns {
 public:
  // Held while alive; movable.
  class Turn {
   public:
    Turn() = default;
    explicit Turn(DeviceTurns* owner) : owner_(owner) {}
    Turn(Turn&& o) noexcept : owner_(o.owner_) { o.owner_ = nullptr; }
    Turn& operator=(Turn&& o) noexcept {
      if (this != &o) {
        Release();
        owner_ = o.owner_;
        o.owner_ = nullptr;
      }
      return *this;
    }
    ~Turn() { Release(); }
    bool held() const { return owner_ != nullptr; }
    void Release() {
      if (owner_) owner_->Next();
      owner_ = nullptr;
    }

   private:
    DeviceTurns* owner_ = nullptr;
  };

  // Blocks until every earlier caller's turn has ended.
  Turn Take() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t mine = next_++;
    cv_.wait(lock, [&] { return serving_ == mine; });
    return Turn(this);
  }
  // Callers waiting for a turn now (not counting the holder).
  int64_t waiting() const {
    std::lock_guard<std::mutex> lock(mu_);
    return next_ > serving_ ? static_cast<int64_t>(next_ - serving_ - 1) : 0;
  }
  // Whether someone waits for a turn now (the holder may end its turn early).
  bool contended() const { return waiting() > 0; }

 private:
  void Next() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++serving_;
    }
    cv_.notify_all();
  }
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ = 0, serving_ = 0;
};

struct DeviceReserve {
  std::atomic<int64_t> bytes{0};
  std::shared_ptr<DeviceTurns> turns;  // null: the two interleave their kernels
};

}  // namespace loom::engine
