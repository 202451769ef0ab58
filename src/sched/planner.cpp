// The batching policy; see planner.h for the rules this file implements.
#include "sched/planner.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

namespace loom::sched {

std::string BatchKey(const std::string& op, const std::string& loss_fn,
                     const std::map<std::string, double>& loss_fn_config) {
  std::string key = op + "|" + loss_fn + "|";
  bool first = true;
  for (const auto& [name, value] : loss_fn_config) {  // std::map: sorted keys
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", value);
    if (!first) key += ",";
    key += name + "=" + buf;
    first = false;
  }
  return key;
}

Planner::Planner(PlannerOptions options) : options_(options) {
  if (options_.token_budget < 1) options_.token_budget = 1;
}

Status Planner::Push(Request request) {
  if (owner_of_.count(request.id)) {
    return Status::Invalid("request id " + std::to_string(request.id) + " is already queued");
  }
  if (request.model_id.empty()) return Status::Invalid("model_id: must not be empty");
  if (request.kind == OpKind::kPackable) {
    if (request.datum_tokens.empty()) {
      return Status::Invalid("data: a forward/forward_backward request needs at least 1 datum");
    }
    if (request.batch_key.empty()) return Status::Invalid("batch_key: must not be empty");
    for (size_t i = 0; i < request.datum_tokens.size(); ++i) {
      if (request.datum_tokens[i] < 0) {
        return Status::Invalid("data[" + std::to_string(i) + "]: token count must be >= 0");
      }
    }
  } else {
    request.datum_tokens.clear();
  }
  ModelQueue& q = models_[request.model_id];
  if (q.requests.empty()) q.ticket = next_ticket_++;
  owner_of_[request.id] = request.model_id;
  q.requests.push_back(Queued{std::move(request), 0});
  ++queued_;
  return Status::Ok();
}

std::optional<Pass> Planner::Next(int64_t room) {
  if (models_.empty()) return std::nullopt;
  std::string anchor_model = OldestTicket(models_);
  if (options_.small_first && small_run_ < models_.size()) {
    const std::string* small = OldestTicket(
        models_, [](const ModelQueue& q) { return q.requests.front().request.kind != OpKind::kPackable; });
    if (small != nullptr) anchor_model = *small;
  }
  auto anchor = models_.find(anchor_model);
  Pass pass;
  const OpKind kind = anchor->second.requests.front().request.kind;
  small_run_ = kind == OpKind::kPackable ? 0 : small_run_ + 1;
  switch (kind) {
    case OpKind::kPackable:
      pass = PlanPackable(anchor_model, room > 0 ? std::min(room, options_.token_budget) : options_.token_budget);
      last_fill_ratio_ = pass.fill_ratio();
      break;
    case OpKind::kOptim:
      pass = PlanOptim();
      break;
    case OpKind::kExclusive:
      pass = PlanExclusive(anchor_model);
      break;
  }
  return pass;
}

Pass Planner::PlanPackable(const std::string& anchor_model, int64_t budget) {
  const std::string key = models_.at(anchor_model).requests.front().request.batch_key;
  Pass pass;
  pass.kind = OpKind::kPackable;
  pass.batch_key = key;
  pass.token_budget = budget;

  // A datum larger than the whole budget runs alone in the pass it anchors.
  {
    ModelQueue& mq = models_.at(anchor_model);
    Queued& head = mq.requests.front();
    const int64_t tokens = head.request.datum_tokens[head.next_datum];
    if (tokens > budget) {
      Piece p;
      p.request_id = head.request.id;
      p.model_id = anchor_model;
      p.datum_begin = head.next_datum;
      p.datum_end = head.next_datum + 1;
      p.tokens = tokens;
      p.first = (head.next_datum == 0);
      p.last = (p.datum_end == head.request.datum_tokens.size());
      pass.tokens = tokens;
      served_tokens_[anchor_model] += tokens;
      mq.drr.deficit = 0;
      if (p.last) {
        PopHead(mq);
      } else {
        head.next_datum = p.datum_end;
      }
      pass.pieces.push_back(std::move(p));
      AfterServed(anchor_model);
      return pass;
    }
  }

  // Competing models: heads with the anchor's key, visited from the anchor on.
  std::vector<std::string> order = OrderFrom(models_, anchor_model);
  std::erase_if(order, [&](const std::string& m) {
    const Request& head = models_.at(m).requests.front().request;
    return head.kind != OpKind::kPackable || head.batch_key != key;
  });
  const int64_t quantum = std::max<int64_t>(1, budget / static_cast<int64_t>(order.size()));

  // A cursor per model: where its next datum is, and the pieces taken so far.
  struct Cursor {
    size_t request = 0;  // index into the model's queue
    size_t datum = 0;
    std::vector<Piece> pieces;
  };
  std::vector<Cursor> cursors(order.size());
  std::vector<DrrFlow*> flows;
  for (size_t i = 0; i < order.size(); ++i) {
    ModelQueue& mq = models_.at(order[i]);
    cursors[i].datum = mq.requests.front().next_datum;
    mq.drr.quantum = quantum;
    flows.push_back(&mq.drr);
  }
  const auto next = [&](size_t i) -> const Queued* {
    const ModelQueue& mq = models_.at(order[i]);
    if (cursors[i].request >= mq.requests.size()) return nullptr;
    const Queued& qd = mq.requests[cursors[i].request];
    if (qd.request.kind != OpKind::kPackable || qd.request.batch_key != key) return nullptr;
    return &qd;
  };
  const auto head = [&](size_t i) -> std::optional<int64_t> {
    const Queued* qd = next(i);
    if (qd == nullptr) return std::nullopt;
    return qd->request.datum_tokens[cursors[i].datum];
  };
  const auto take = [&](size_t i) {
    Cursor& c = cursors[i];
    const Queued& qd = *next(i);
    if (c.pieces.empty() || c.pieces.back().request_id != qd.request.id) {
      Piece p;
      p.request_id = qd.request.id;
      p.model_id = qd.request.model_id;
      p.datum_begin = p.datum_end = c.datum;
      p.first = (c.datum == 0);
      c.pieces.push_back(p);
    }
    const int64_t tokens = qd.request.datum_tokens[c.datum];
    Piece& p = c.pieces.back();
    p.datum_end = c.datum + 1;
    p.tokens += tokens;
    if (++c.datum == qd.request.datum_tokens.size()) {
      ++c.request;
      c.datum = 0;
    }
    return Take::kTaken;
  };
  pass.tokens = DrrRounds(flows, budget, /*cap=*/budget, head, take);

  // Commit: drop completed requests, advance split ones, renew tickets.
  for (size_t i = 0; i < order.size(); ++i) {
    Cursor& c = cursors[i];
    if (c.pieces.empty()) continue;
    ModelQueue& mq = models_.at(order[i]);
    for (Piece& p : c.pieces) {
      Queued& head_request = mq.requests.front();  // pieces are in queue order
      p.last = (p.datum_end == head_request.request.datum_tokens.size());
      served_tokens_[order[i]] += p.tokens;
      if (p.last) {
        PopHead(mq);
      } else {
        head_request.next_datum = p.datum_end;
      }
      pass.pieces.push_back(std::move(p));
    }
    AfterServed(order[i]);
  }
  return pass;
}

Pass Planner::PlanOptim() {
  Pass pass;
  pass.kind = OpKind::kOptim;
  pass.token_budget = options_.token_budget;
  std::vector<std::string> served;
  for (auto& [model, mq] : models_) {
    const Request& head = mq.requests.front().request;
    if (head.kind != OpKind::kOptim) continue;
    Piece p;
    p.request_id = head.id;
    p.model_id = model;
    pass.pieces.push_back(p);
    PopHead(mq);
    served.push_back(model);
  }
  for (const std::string& m : served) AfterServed(m);
  return pass;
}

Pass Planner::PlanExclusive(const std::string& anchor_model) {
  Pass pass;
  pass.kind = OpKind::kExclusive;
  pass.token_budget = options_.token_budget;
  ModelQueue& mq = models_.at(anchor_model);
  Piece p;
  p.request_id = mq.requests.front().request.id;
  p.model_id = anchor_model;
  pass.pieces.push_back(p);
  PopHead(mq);
  AfterServed(anchor_model);
  return pass;
}

void Planner::PopHead(ModelQueue& q) {
  owner_of_.erase(q.requests.front().request.id);
  q.requests.pop_front();
  --queued_;
}

void Planner::AfterServed(const std::string& model) {
  auto it = models_.find(model);
  if (it == models_.end()) return;
  if (it->second.requests.empty()) {
    models_.erase(it);  // DRR: an idle flow keeps no deficit
  } else {
    it->second.ticket = next_ticket_++;
  }
}

bool Planner::Remove(uint64_t request_id) {
  auto owner = owner_of_.find(request_id);
  if (owner == owner_of_.end()) return false;
  const std::string model = owner->second;
  ModelQueue& mq = models_.at(model);
  auto it = std::find_if(mq.requests.begin(), mq.requests.end(),
                         [&](const Queued& q) { return q.request.id == request_id; });
  const bool was_head = (it == mq.requests.begin());
  mq.requests.erase(it);
  owner_of_.erase(owner);
  --queued_;
  if (mq.requests.empty()) {
    models_.erase(model);
  } else if (was_head) {
    mq.ticket = next_ticket_++;  // the next request became ready now
  }
  return true;
}

std::vector<uint64_t> Planner::DropModel(const std::string& model_id) {
  std::vector<uint64_t> ids;
  auto it = models_.find(model_id);
  if (it == models_.end()) return ids;
  for (const Queued& q : it->second.requests) {
    ids.push_back(q.request.id);
    owner_of_.erase(q.request.id);
  }
  queued_ -= ids.size();
  models_.erase(it);
  return ids;
}

std::map<std::string, size_t> Planner::QueueDepths() const {
  std::map<std::string, size_t> depths;
  for (const auto& [model, mq] : models_) depths[model] = mq.requests.size();
  return depths;
}

int64_t Planner::OldestWaitMs(const std::string& model_id, int64_t now_ms) const {
  auto it = models_.find(model_id);
  if (it == models_.end()) return 0;
  int64_t oldest = now_ms;
  for (const Queued& q : it->second.requests) oldest = std::min(oldest, q.request.arrival_ms);
  return now_ms - oldest;
}

int64_t Planner::OldestWaitMs(int64_t now_ms) const {
  int64_t wait = 0;
  for (const auto& [model, mq] : models_) wait = std::max(wait, OldestWaitMs(model, now_ms));
  return wait;
}

int64_t Planner::TokensServed(const std::string& model_id) const {
  auto it = served_tokens_.find(model_id);
  return it == served_tokens_.end() ? 0 : it->second;
}

}  // namespace loom::sched
