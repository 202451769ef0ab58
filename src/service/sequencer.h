// Sequencer: puts one training model's requests into strict seq_id order.
//
// The SDK numbers a TrainingClient's requests 1, 2, 3, ... (create_model is
// 0) and sends the chunks of one forward_backward concurrently, first chunk
// last. Early arrivals wait here until every smaller seq_id has arrived; then
// they move, in order, to the ready queue that the engine thread drains.
//
// Invariants: ready() holds consecutive seq_ids, all < next_seq(); every
// seq_id ever admitted maps to the request_id of its first submission, so a
// retry returns the original future and never runs twice. After a gap times
// out, the waiting requests are failed and next_seq() jumps past them.
// A seq_id whose request was rejected before admission (a 4xx) is Skip()ped:
// the SDK never resends it, so later requests must not wait for it.
// Only seq_ids at most kMaxAhead past next_seq() are admitted or skipped: a
// far-future one would otherwise, once its gap timed out, move next_seq() past
// every request the client sends next (and 2^63-1 would overflow it). So
// early_ and skipped_ hold at most kMaxAhead entries, and next_seq() grows by
// at most kMaxAhead + 1 per request: no seq_id arithmetic overflows.
//
// Not thread-safe: the Service guards it with its lock.
#pragma once
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "service/training_op.h"

namespace loom::service {

class Sequencer {
 public:
  using Clock = std::chrono::steady_clock;

  // The SDK runs ahead of the model only by the chunks of one forward_backward.
  static constexpr int64_t kMaxAhead = 1024;

  explicit Sequencer(int64_t next_seq = 1) : next_seq_(next_seq) {}

  enum class Admission {
    kAccepted,     // queued (ready or waiting for a smaller seq_id)
    kDuplicate,    // this seq_id was seen before: request_id is the original one
    kStale,        // seq_id below next_seq() that was never seen (skipped by a gap timeout)
    kOutOfWindow,  // seq_id more than kMaxAhead past next_seq(): not queued, nothing changed
  };
  struct AdmitResult {
    Admission admission;
    std::string request_id;
  };
  // Admits op (op.request_id must be set unless the caller only checks for
  // duplicates first with Lookup()).
  AdmitResult Admit(TrainingOp op);

  // Ok, or kInvalidArgument naming the limit and the next expected seq_id
  // when seq_id is more than kMaxAhead past next_seq() (Admit() would answer
  // kOutOfWindow). Check it before creating the request's future.
  Status CheckWindow(int64_t seq_id) const;

  // Marks seq_id as used by a request that was rejected before admission, so
  // the requests after it do not wait for it. No-op if seq_id was admitted, is
  // below next_seq() or past the window. A later Admit() of the same seq_id
  // still succeeds.
  void Skip(int64_t seq_id);

  // The request_id first submitted with seq_id, if any.
  std::optional<std::string> Lookup(int64_t seq_id) const;

  bool HasReady() const { return !ready_.empty(); }
  const TrainingOp& FrontReady() const { return ready_.front(); }
  TrainingOp PopReady();

  // Fails the waiting (early) requests if the oldest has waited longer than
  // timeout for the gap at next_seq() to fill. Returns them (empty if none
  // expired) and advances next_seq() past the largest of them.
  std::vector<TrainingOp> ExpireGap(Clock::time_point now, Clock::duration timeout);

  // Removes and returns everything queued (ready first, then waiting).
  std::vector<TrainingOp> DrainAll();

  int64_t next_seq() const { return next_seq_; }
  size_t waiting() const { return early_.size(); }
  size_t ready_count() const { return ready_.size(); }

 private:
  void Promote();
  bool InWindow(int64_t seq_id) const;  // seq_id - next_seq_ <= kMaxAhead, without overflow

  int64_t next_seq_;
  std::map<int64_t, TrainingOp> early_;
  std::deque<TrainingOp> ready_;
  std::map<int64_t, std::string> seen_;
  std::set<int64_t> skipped_;  // rejected seq_ids >= next_seq_, never in early_
};

}  // namespace loom::service
