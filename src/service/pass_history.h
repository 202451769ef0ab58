// PassHistory: the recent forward_backward results of each live model, for
// the dashboard's loss curves (GET /api/v1/dashboard, docs/dashboard.md).
//
// Bound: the last kMaxPoints requests per model, in memory only; a model's
// history goes when the model does (Forget, called when it is unloaded,
// expires or fails), so it never outlives what its tenant can see. The
// train loop records and forgets under ServiceLock::mu, recording only for a
// model still active, so a gone model's history is never recreated.
// Invariant: points of one model are in the order the engine finished them;
// `index` counts the model's recorded requests from 1 (it keeps counting
// after old points fall off, so a curve's x-axis stays the request number).
//
// Threading: every method may be called from any thread (one internal mutex,
// a leaf: taken after ServiceLock::mu when both are held, nothing under it).
#pragma once
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace loom::service {

class PassHistory {
 public:
  static constexpr size_t kMaxPoints = 1000;
  struct Point {
    int64_t index = 0;     // the model's n-th recorded forward_backward
    double loss_sum = 0;   // its "loss:sum" metric
    int64_t tokens = 0;    // tokens it trained (the mean is loss_sum / tokens)
    int64_t at_ms = 0;     // wall-clock time it finished
  };
  struct ModelHistory {
    std::string owner;
    std::vector<Point> points;  // oldest first
  };

  // One finished forward_backward of `model_id` (owned by `owner`).
  void Record(const std::string& owner, const std::string& model_id, double loss_sum, int64_t tokens, int64_t at_ms);
  // Drops a model's history (its model is gone).
  void Forget(const std::string& model_id);
  // The histories of the tenant's models, by model id.
  std::map<std::string, ModelHistory> Of(const std::string& tenant) const;

 private:
  struct Entry {
    std::string owner;
    int64_t recorded = 0;
    std::deque<Point> points;
  };
  mutable std::mutex mu_;
  std::map<std::string, Entry> models_;  // [mu_] model id -> its recent points
};

}  // namespace loom::service
