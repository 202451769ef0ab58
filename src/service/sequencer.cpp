#include "service/sequencer.h"

#include <algorithm>

#include <fmt/format.h>

namespace loom::service {

const char* OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kCreateModel: return "CreateModel";
    case OpKind::kForwardBackward: return "ForwardBackward";
    case OpKind::kOptimStep: return "OptimStep";
    case OpKind::kSaveWeights: return "SaveWeights";
    case OpKind::kLoadWeights: return "LoadWeights";
    case OpKind::kSaveForSampler: return "SaveWeightsForSampler";
    case OpKind::kUnloadModel: return "UnloadModel";
  }
  return "Unknown";
}

std::optional<std::string> Sequencer::Lookup(int64_t seq_id) const {
  auto it = seen_.find(seq_id);
  if (it == seen_.end()) return std::nullopt;
  return it->second;
}

bool Sequencer::InWindow(int64_t seq_id) const {
  // Past the first test seq_id >= next_seq_ >= 0, so the difference cannot overflow.
  return seq_id < next_seq_ || seq_id - next_seq_ <= kMaxAhead;
}

Status Sequencer::CheckWindow(int64_t seq_id) const {
  if (InWindow(seq_id)) return Status::Ok();
  return Status::Invalid(fmt::format("seq_id: {} is more than {} ahead of the next expected seq_id {} (a model's "
                                     "requests may run at most {} ahead of the next one it expects)",
                                     seq_id, kMaxAhead, next_seq_, kMaxAhead));
}

Sequencer::AdmitResult Sequencer::Admit(TrainingOp op) {
  if (auto prior = Lookup(op.seq_id)) return {Admission::kDuplicate, *prior};
  if (op.seq_id < next_seq_) return {Admission::kStale, ""};
  if (!InWindow(op.seq_id)) return {Admission::kOutOfWindow, ""};
  skipped_.erase(op.seq_id);
  seen_[op.seq_id] = op.request_id;
  std::string id = op.request_id;
  const int64_t seq = op.seq_id;
  early_.emplace(seq, std::move(op));
  Promote();
  return {Admission::kAccepted, id};
}

void Sequencer::Skip(int64_t seq_id) {
  if (seq_id < next_seq_ || !InWindow(seq_id) || seen_.count(seq_id)) return;
  skipped_.insert(seq_id);
  Promote();
}

void Sequencer::Promote() {
  for (;;) {
    if (auto it = early_.begin(); it != early_.end() && it->first == next_seq_) {
      ready_.push_back(std::move(it->second));
      early_.erase(it);
    } else if (!skipped_.empty() && *skipped_.begin() == next_seq_) {
      skipped_.erase(skipped_.begin());
    } else {
      return;
    }
    ++next_seq_;
  }
}

TrainingOp Sequencer::PopReady() {
  TrainingOp op = std::move(ready_.front());
  ready_.pop_front();
  return op;
}

std::vector<TrainingOp> Sequencer::ExpireGap(Clock::time_point now, Clock::duration timeout) {
  std::vector<TrainingOp> expired;
  if (early_.empty()) return expired;
  Clock::time_point oldest = Clock::time_point::max();
  for (const auto& [seq, op] : early_) oldest = std::min(oldest, op.arrived);
  if (now - oldest < timeout) return expired;
  next_seq_ = early_.rbegin()->first + 1;
  for (auto& [seq, op] : early_) expired.push_back(std::move(op));
  early_.clear();
  skipped_.erase(skipped_.begin(), skipped_.lower_bound(next_seq_));
  Promote();
  return expired;
}

std::vector<TrainingOp> Sequencer::DrainAll() {
  std::vector<TrainingOp> all;
  while (!ready_.empty()) all.push_back(PopReady());
  for (auto& [seq, op] : early_) all.push_back(std::move(op));
  early_.clear();
  return all;
}

}  // namespace loom::service
