#include "service/pass_history.h"

namespace loom::service {

void PassHistory::Record(const std::string& owner, const std::string& model_id, double loss_sum, int64_t tokens,
                         int64_t at_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = models_[model_id];
  e.owner = owner;
  e.points.push_back(Point{++e.recorded, loss_sum, tokens, at_ms});
  if (e.points.size() > kMaxPoints) e.points.pop_front();
}

void PassHistory::Forget(const std::string& model_id) {
  std::lock_guard<std::mutex> lock(mu_);
  models_.erase(model_id);
}

std::map<std::string, PassHistory::ModelHistory> PassHistory::Of(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, ModelHistory> out;
  for (const auto& [id, e] : models_) {
    if (e.owner != tenant) continue;
    out[id] = ModelHistory{e.owner, std::vector<Point>(e.points.begin(), e.points.end())};
  }
  return out;
}

}  // namespace loom::service
