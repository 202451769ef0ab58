// Planner: the cross-tenant batching policy, as pure code (no tensors, no
// threads, no clock). The service pushes each model's *ready* requests (next
// in seq_id order, nothing ahead of them pending) and asks Next() for the next
// engine pass. Requests are opaque ids to the planner; the service keeps the
// payloads and maps a Pass's pieces back onto them.
//
// Kinds of request:
//   packable   forward_backward / forward. Carries a batch key (BatchKey():
//              op + loss_fn + canonical loss_fn_config) and the token count of
//              each datum. Requests with the same key from many models share
//              a pass, up to the token budget.
//   optim      optim_step. All models whose queue head is an optim_step run
//              together in one merged pass.
//   exclusive  save/load/anything else: runs alone in its own pass.
//
// POLICY (what Next() does):
//  1. Anchor. Every model's queue head carries a "ready ticket", taken when it
//     became the head or when it last got a piece of a pass. The head with the
//     oldest ticket is the anchor; its kind picks the pass (and for a packable
//     anchor, the batch key). A model served in a pass takes a fresh ticket, so
//     anchors rotate round-robin over models: a backlog does not keep the
//     anchor role.
//  2. Packable pass: deficit round robin (DRR, sched/drr.h) by tokens over the models whose
//     head has the anchor's key, starting with the anchor's model and then in
//     model order after it. Each round adds a quantum q = max(1, budget / n)
//     (n = models with that key) to a model's deficit; the model then takes
//     whole datums, in order, from its head request (and from following
//     requests of the same key) while the next datum's tokens <= its deficit
//     and fit in what is left of the budget. Rounds repeat until the budget is
//     full or nobody can add a datum. Deficits carry over between passes (a
//     model the budget cut off before its datum fit keeps its credit and, still
//     holding the oldest ticket, is visited first next time) and reset to 0
//     when a model's queue empties; a deficit never exceeds one budget, so every
//     datum that fits the budget eventually runs. A datum larger than the whole
//     budget never joins others: it runs alone in the pass it anchors.
//     Effect: with n competing models each gets >= ~budget/n tokens of any pass
//     with its key, so a light tenant's request runs in the next pass of its key
//     (in ~2 if it is bigger than its share), however deep another tenant's
//     backlog is; a backlogged tenant gets the rest (work conserving).
//  3. A request bigger than what it is given is split by datums into pieces
//     over several passes, in datum order; Piece::last marks the piece after
//     which the request is complete (the service answers it then, and the
//     engine accumulates the gradient of all its pieces as one).
//  4. Optim pass: every head that is an optim_step, one piece each.
//  5. Exclusive pass: the anchor alone.
//  6. Small ops first (PlannerOptions::small_first, off by default): before
//     the anchor's pass, the oldest-ticket head that is an optim_step or an
//     exclusive op (milliseconds, where a packable pass takes up to seconds)
//     runs first (an optim_step with every other optim head, as in 4), so a
//     tenant whose forward_backward completed early steps, saves and samples
//     again while the others' pieces still train. At most as many such
//     passes in a row as models are queued; then the anchor's pass, whatever
//     its kind, so that a stream of small ops never starves a packable one.
//
// Threading: not thread-safe; the service serialises calls (one mutex).
#pragma once
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "sched/drr.h"

namespace loom::sched {

enum class OpKind { kPackable, kOptim, kExclusive };

// Canonical key of a packable op: "<op>|<loss_fn>|k1=v1,k2=v2" with config
// keys sorted and values printed exactly (%.17g), so equal configs give equal
// keys. op is e.g. "forward_backward" or "forward".
std::string BatchKey(const std::string& op, const std::string& loss_fn,
                     const std::map<std::string, double>& loss_fn_config);

struct Request {
  uint64_t id = 0;              // unique per planner (the service's handle)
  std::string model_id;
  OpKind kind = OpKind::kPackable;
  std::string batch_key;        // packable only
  std::vector<int64_t> datum_tokens;  // packable only: tokens of each datum, >= 0, non-empty
  int64_t arrival_ms = 0;       // when it became ready (for wait metrics only)
};

// One request's share of a pass: datums [datum_begin, datum_end) of it.
// Optim and exclusive pieces have datum_begin == datum_end == 0.
struct Piece {
  uint64_t request_id = 0;
  std::string model_id;
  size_t datum_begin = 0;
  size_t datum_end = 0;
  int64_t tokens = 0;
  bool first = true;  // the request's first piece
  bool last = true;   // the request is complete after this piece
};

struct Pass {
  OpKind kind = OpKind::kPackable;
  std::string batch_key;     // packable only
  // Pieces of one model are adjacent and in queue order; models appear in
  // the order they joined the pass (the anchor's model first).
  std::vector<Piece> pieces;
  int64_t tokens = 0;        // sum of pieces' tokens
  int64_t token_budget = 0;
  // tokens / token_budget for packable passes (may exceed 1 for a lone
  // oversized datum); 0 for optim and exclusive passes.
  double fill_ratio() const {
    return (kind == OpKind::kPackable && token_budget > 0)
               ? static_cast<double>(tokens) / static_cast<double>(token_budget)
               : 0.0;
  }
};

struct PlannerOptions {
  int64_t token_budget = 8192;  // tokens per packable pass (--token-budget), >= 1
  bool small_first = false;     // POLICY 6 (--small-ops-first)
};

class Planner {
 public:
  explicit Planner(PlannerOptions options = {});

  // Appends a ready request to its model's queue. Invalid for a duplicate id,
  // a packable request without datums or key, or a negative token count.
  Status Push(Request request);
  // The next engine pass, or nullopt when every queue is empty. The pieces it
  // returns are removed from the queues (the service must run or fail them).
  // room > 0: the most tokens the device holds for a pass now (memory held
  // since start-up, by snapshots awaiting their writers, shrinks it below
  // the budget); a packable pass is planned to min(token_budget, room), so the
  // requests that would overflow wait for the next pass instead of failing
  // this one. 0: no limit known.
  std::optional<Pass> Next(int64_t room = 0);

  // Removes one queued request (e.g. it failed in an earlier piece); returns
  // false when it is not queued. Its remaining datums will not be planned.
  bool Remove(uint64_t request_id);
  // Removes every queued request of a model (unloaded, lease expired, failed);
  // returns their ids in queue order so the service can fail their futures.
  std::vector<uint64_t> DropModel(const std::string& model_id);

  bool empty() const { return queued_ == 0; }
  size_t queued() const { return queued_; }
  int64_t token_budget() const { return options_.token_budget; }

  // ---- metrics ----
  // Requests queued per model (models with an empty queue are omitted).
  std::map<std::string, size_t> QueueDepths() const;
  // now_ms minus the arrival of the model's oldest queued request (0 if none).
  int64_t OldestWaitMs(const std::string& model_id, int64_t now_ms) const;
  // The same over all models.
  int64_t OldestWaitMs(int64_t now_ms) const;
  // fill_ratio() of the last packable pass (0 before the first one).
  double last_fill_ratio() const { return last_fill_ratio_; }
  // Tokens planned for a model so far (packable passes).
  int64_t TokensServed(const std::string& model_id) const;

 private:
  struct Queued {
    Request request;
    size_t next_datum = 0;  // datums before this were already planned
  };
  struct ModelQueue {
    std::deque<Queued> requests;  // front = head
    uint64_t ticket = 0;          // ready ticket of the head (see POLICY 1)
    DrrFlow drr;                  // DRR deficit (tokens) and this pass's quantum
  };

  Pass PlanPackable(const std::string& anchor_model, int64_t budget);
  Pass PlanOptim();
  Pass PlanExclusive(const std::string& anchor_model);
  // After `model` got pieces of a pass: renews its ticket, or forgets the
  // queue (and its deficit) when it is empty.
  void AfterServed(const std::string& model);
  void PopHead(ModelQueue& q);

  PlannerOptions options_;
  // Only models with a non-empty queue; ordered, which is the DRR visiting order.
  std::map<std::string, ModelQueue> models_;
  std::map<std::string, int64_t> served_tokens_;
  std::map<uint64_t, std::string> owner_of_;  // request id -> model id
  size_t queued_ = 0;
  uint64_t next_ticket_ = 1;
  double last_fill_ratio_ = 0.0;
  size_t small_run_ = 0;  // small-op passes in a row since the last packable one (POLICY 6)
};

}  // namespace loom::sched
