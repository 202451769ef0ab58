#include "service/future_table.h"

#include <vector>

namespace loom::service {

FutureTable::FutureTable(std::string instance_tag, std::chrono::seconds retention)
    : tag_(std::move(instance_tag)), retention_(retention) {}

std::string FutureTable::Create(const std::string& owner, const std::string& kind) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string id = "req-" + tag_ + "-" + std::to_string(next_id_++);
  Entry& e = entries_[id];
  e.owner = owner;
  e.view.request_id = id;
  e.view.kind = kind;
  return id;
}

void FutureTable::Finish(const std::string& request_id, FutureState state, Status error,
                         std::shared_ptr<const FutureResult> result) {
  std::map<uint64_t, std::function<void()>> watchers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(request_id);
    if (it == entries_.end() || it->second.view.state != FutureState::kPending) return;
    it->second.view.state = state;
    it->second.view.error = std::move(error);
    it->second.view.result = std::move(result);
    it->second.finished_at = Clock::now();
    watchers.swap(it->second.watchers);
  }
  for (auto& [id, fn] : watchers) fn();
}

void FutureTable::Complete(const std::string& request_id, FutureResult result) {
  Finish(request_id, FutureState::kDone, Status::Ok(), std::make_shared<const FutureResult>(std::move(result)));
}

void FutureTable::SetQueueState(const std::string& request_id, QueueState state, std::string reason) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(request_id);
  if (it == entries_.end() || it->second.view.state != FutureState::kPending) return;
  it->second.view.queue_state = state;
  it->second.view.queue_reason = std::move(reason);
}

void FutureTable::Fail(const std::string& request_id, Status error) {
  if (error.ok()) error = Status::Internal("request failed without a reason");
  Finish(request_id, FutureState::kFailed, std::move(error), nullptr);
}

Result<FutureView> FutureTable::Get(const std::string& owner, const std::string& request_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(request_id);
  if (it == entries_.end() || it->second.owner != owner) {
    return Status::NotFound("request_id '" + request_id + "' not found");
  }
  return it->second.view;
}

uint64_t FutureTable::Watch(const std::string& request_id, std::function<void()> on_done) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(request_id);
  if (it == entries_.end() || it->second.view.state != FutureState::kPending) return 0;
  uint64_t w = next_watch_++;
  it->second.watchers.emplace(w, std::move(on_done));
  return w;
}

void FutureTable::Unwatch(const std::string& request_id, uint64_t watch_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(request_id);
  if (it != entries_.end()) it->second.watchers.erase(watch_id);
}

bool FutureTable::IsFromEarlierInstance(const std::string& request_id) const {
  const std::string ours = "req-" + tag_ + "-";
  return request_id.rfind("req-", 0) == 0 && request_id.rfind(ours, 0) != 0;
}

size_t FutureTable::Sweep(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.view.state != FutureState::kPending && now - it->second.finished_at > retention_) {
      it = entries_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

size_t FutureTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

}  // namespace loom::service
