// BatchWindow: the one batching-window rule of the trainer's pass loop
// (ServiceOptions::batch_window) and the sampler's admission
// (SamplerOptions::admission_window). Requests sent "at the same time" by
// different clients arrive a little apart, so work waits until no request has
// arrived for one window, but never keeps the oldest waiting request more
// than kMaxWindows windows. Pure and header-only: the callers own their
// clocks, locks and condition variables.
#pragma once
#include <algorithm>
#include <chrono>

namespace loom {

struct BatchWindow {
  static constexpr int kMaxWindows = 10;

  std::chrono::nanoseconds window{0};  // 0 or less: never wait

  bool enabled() const { return window.count() > 0; }

  // Whether to keep waiting at `now`, given the newest and the oldest
  // arrival among the waiting requests.
  template <typename TimePoint>
  bool KeepWaiting(TimePoint now, TimePoint newest_arrival, TimePoint oldest_arrival) const {
    return enabled() && now < WaitUntil(newest_arrival, oldest_arrival);
  }

  // When the wait ends unless another request arrives first: one window after
  // the newest arrival, capped at kMaxWindows windows after the oldest.
  template <typename TimePoint>
  TimePoint WaitUntil(TimePoint newest_arrival, TimePoint oldest_arrival) const {
    const auto w = std::chrono::duration_cast<typename TimePoint::duration>(window);
    return std::min(newest_arrival + w, oldest_arrival + kMaxWindows * w);
  }
};

}  // namespace loom
