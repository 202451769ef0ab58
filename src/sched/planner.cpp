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

std::optional<Pass> Planner::Next() {
  if (models_.empty()) return std::nullopt;
  auto anchor = models_.begin();
  for (auto it = models_.begin(); it != models_.end(); ++it) {
    if (it->second.ticket < anchor->second.ticket) anchor = it;
  }
  const std::string anchor_model = anchor->first;
  Pass pass;
  switch (anchor->second.requests.front().request.kind) {
    case OpKind::kPackable:
      pass = PlanPackable(anchor_model);
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

Pass Planner::PlanPackable(const std::string& anchor_model) {
  const int64_t budget = options_.token_budget;
  const std::string key = models_.at(anchor_model).requests.front().request.batch_key;

  // Competing models: heads with the anchor's key, visited from the anchor on.
  std::vector<std::string> order;
  auto start = models_.find(anchor_model);
  for (auto it = start; it != models_.end(); ++it) order.push_back(it->first);
  for (auto it = models_.begin(); it != start; ++it) order.push_back(it->first);
  std::erase_if(order, [&](const std::string& m) {
    const Request& head = models_.at(m).requests.front().request;
    return head.kind != OpKind::kPackable || head.batch_key != key;
  });
  const int64_t quantum = std::max<int64_t>(1, budget / static_cast<int64_t>(order.size()));

  // A cursor per model: where its next datum is, and the pieces taken so far.
  struct Cursor {
    size_t request = 0;  // index into the model's queue
    size_t datum = 0;
    bool active = true;
    std::vector<Piece> pieces;
  };
  std::vector<Cursor> cursors(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    cursors[i].datum = models_.at(order[i]).requests.front().next_datum;
  }

  Pass pass;
  pass.kind = OpKind::kPackable;
  pass.batch_key = key;
  pass.token_budget = budget;
  int64_t remaining = budget;
  bool any_active = true;
  while (any_active && remaining > 0) {
    any_active = false;
    for (size_t i = 0; i < order.size() && remaining > 0; ++i) {
      Cursor& c = cursors[i];
      if (!c.active) continue;
      ModelQueue& mq = models_.at(order[i]);
      mq.deficit = std::min(mq.deficit + quantum, budget);
      while (remaining > 0) {
        if (c.request >= mq.requests.size()) {
          c.active = false;
          break;
        }
        const Queued& qd = mq.requests[c.request];
        if (qd.request.kind != OpKind::kPackable || qd.request.batch_key != key) {
          c.active = false;
          break;
        }
        const int64_t tokens = qd.request.datum_tokens[c.datum];
        // A datum bigger than the whole budget runs alone when it anchors.
        const bool oversized_anchor = (i == 0 && pass.tokens == 0 && tokens > budget);
        if (!oversized_anchor) {
          if (tokens > remaining) {  // cannot fit in this pass any more
            c.active = false;
            break;
          }
          if (tokens > mq.deficit) break;  // wait for the next round's quantum
        }
        if (c.pieces.empty() || c.pieces.back().request_id != qd.request.id) {
          Piece p;
          p.request_id = qd.request.id;
          p.model_id = qd.request.model_id;
          p.datum_begin = p.datum_end = c.datum;
          p.first = (c.datum == 0);
          c.pieces.push_back(p);
        }
        Piece& p = c.pieces.back();
        p.datum_end = c.datum + 1;
        p.tokens += tokens;
        pass.tokens += tokens;
        remaining -= tokens;
        mq.deficit = std::max<int64_t>(0, mq.deficit - tokens);
        if (++c.datum == qd.request.datum_tokens.size()) {
          ++c.request;
          c.datum = 0;
        }
      }
      if (c.active) any_active = true;
    }
  }

  // Commit: drop completed requests, advance split ones, renew tickets.
  for (size_t i = 0; i < order.size(); ++i) {
    Cursor& c = cursors[i];
    if (c.pieces.empty()) continue;
    ModelQueue& mq = models_.at(order[i]);
    for (Piece& p : c.pieces) {
      Queued& head = mq.requests.front();  // pieces are in queue order
      p.last = (p.datum_end == head.request.datum_tokens.size());
      served_tokens_[order[i]] += p.tokens;
      if (p.last) {
        PopHead(mq);
      } else {
        head.next_datum = p.datum_end;
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
