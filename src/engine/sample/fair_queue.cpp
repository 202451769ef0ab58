// The sampler's admission order; see fair_queue.h for the rules.
#include "engine/sample/fair_queue.h"

#include <algorithm>

namespace loom::engine::sample {

void FairQueue::Push(std::unique_ptr<SampleRequest> r) {
  Flow& f = flows_[Key{r->call.tenant, r->call.session}];
  if (f.requests.empty()) f.ticket = next_ticket_++;
  f.requests.push_back(std::move(r));
  ++size_;
}

const SampleRequest* FairQueue::Admit(int64_t free_tokens, const ReadyFn& ready, const CostFn& cost,
                                      const AdmitFn& admit) {
  const Key* oldest = sched::OldestTicket(flows_, [&](const Flow& f) { return ready(*f.requests.front()); });
  if (oldest == nullptr) return nullptr;  // every flow sits out the pass
  const Key anchor = *oldest;
  const std::vector<Key> order = sched::OrderFrom(flows_, anchor);
  const SampleRequest& anchor_head = *flows_.at(anchor).requests.front();
  const std::optional<int64_t> anchor_cost = cost(anchor_head);
  if (!anchor_cost || *anchor_cost > free_tokens) return &anchor_head;

  std::map<std::string, int64_t> sessions_of;  // tenant -> its waiting sessions
  for (const auto& [key, f] : flows_) ++sessions_of[key.first];
  std::vector<sched::DrrFlow*> drr;
  std::vector<Flow*> flows;
  for (const Key& k : order) {
    Flow& f = flows_.at(k);
    const int64_t shares = static_cast<int64_t>(sessions_of.size()) * sessions_of[k.first];
    f.drr.quantum = std::max<int64_t>(1, cap_ / shares);
    drr.push_back(&f.drr);
    flows.push_back(&f);
  }
  std::vector<char> served(flows.size(), 0);
  bool blocked = false;  // the anchor's head was refused before anything was taken
  bool taken_any = false;
  const auto head = [&](size_t i) -> std::optional<int64_t> {
    if (blocked || flows[i]->requests.empty()) return std::nullopt;
    return cost(*flows[i]->requests.front());
  };
  const auto take = [&](size_t i) {
    Flow& f = *flows[i];
    const sched::Take t = admit(f.requests.front());
    if (t == sched::Take::kRefused) {
      if (i == 0 && !taken_any) blocked = true;
      return t;
    }
    f.requests.pop_front();
    --size_;
    served[i] = 1;
    if (t == sched::Take::kTaken) taken_any = true;
    return t;
  };
  sched::DrrRounds(drr, free_tokens, cap_, head, take);

  for (size_t i = 0; i < order.size(); ++i) {
    if (!served[i]) continue;
    auto it = flows_.find(order[i]);
    if (it->second.requests.empty()) {
      flows_.erase(it);  // DRR: an idle flow keeps no deficit
    } else {
      it->second.ticket = next_ticket_++;
    }
  }
  return blocked ? flows_.at(anchor).requests.front().get() : nullptr;
}

std::vector<std::unique_ptr<SampleRequest>> FairQueue::TakeSession(const std::string& session) {
  std::vector<std::unique_ptr<SampleRequest>> out;
  for (auto it = flows_.begin(); it != flows_.end();) {
    if (it->first.second != session) {
      ++it;
      continue;
    }
    for (auto& r : it->second.requests) out.push_back(std::move(r));
    it = flows_.erase(it);
  }
  size_ -= out.size();
  return out;
}

std::vector<std::unique_ptr<SampleRequest>> FairQueue::TakeAll() {
  std::vector<std::unique_ptr<SampleRequest>> out;
  for (auto& [key, f] : flows_)
    for (auto& r : f.requests) out.push_back(std::move(r));
  flows_.clear();
  size_ = 0;
  return out;
}

}  // namespace loom::engine::sample
