// Deficit round robin (DRR) by tokens: the rounds that share one pass's token
// budget among competing flows. Two users, one rule:
//   - the trainer's Planner (planner.h): flows are models, items are the
//     datums of their forward(_backward) requests, the budget --token-budget;
//   - the sampler's admission (engine/sample/fair_queue.h): flows are sampling
//     sessions (weighted so that every tenant gets one share), items are
//     requests costing their worst-case KV tokens, the budget the free KV.
//
// RULE (DrrRounds): flows are visited in the caller's order, round after
// round. Each round adds a flow's quantum to its deficit (never above cap);
// the flow then takes items in order while the next one costs no more than
// its deficit and no more than what is left of the budget. A flow is done for
// the pass when its next item does not fit the rest of the budget, when it
// has no item it may add (head() says so), or when take() refuses one.
// Rounds repeat until the budget is spent or every flow is done.
// Deficits belong to the caller and carry over between passes; the caller
// resets a flow's deficit when its queue empties (an idle flow keeps no
// credit). With cap >= budget every item that fits the budget is eventually
// covered, so the rounds end.
//
// Threading: plain functions; the caller owns the flows.
#pragma once
#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace loom::sched {

struct DrrFlow {
  int64_t deficit = 0;  // tokens of credit, carried between passes
  int64_t quantum = 1;  // tokens added per round (>= 1)
};

// What take() did with a flow's next item.
enum class Take {
  kTaken,    // joined the pass: charged to the deficit and the budget
  kDropped,  // left the queue without joining (e.g. it failed): charged to neither
  kRefused,  // cannot join this pass: the flow is done for it
};

// Runs the rounds of one pass over flows (visiting order) and returns the
// tokens taken. head(i) -> std::optional<int64_t>: the cost of flow i's next
// item, or nullopt when it has none it may add to this pass. take(i) -> Take:
// takes that item.
template <class Head, class TakeFn>
int64_t DrrRounds(const std::vector<DrrFlow*>& flows, int64_t budget, int64_t cap, Head&& head, TakeFn&& take) {
  int64_t remaining = budget;
  std::vector<char> active(flows.size(), 1);
  bool any_active = true;
  while (any_active && remaining > 0) {
    any_active = false;
    for (size_t i = 0; i < flows.size() && remaining > 0; ++i) {
      if (!active[i]) continue;
      DrrFlow& f = *flows[i];
      f.deficit = std::min(f.deficit + std::max<int64_t>(1, f.quantum), cap);
      while (remaining > 0) {
        const std::optional<int64_t> cost = head(i);
        if (!cost || *cost > remaining) {
          active[i] = 0;
          break;
        }
        if (*cost > f.deficit) break;  // wait for the next round's quantum
        const Take t = take(i);
        if (t == Take::kRefused) {
          active[i] = 0;
          break;
        }
        if (t == Take::kTaken) {
          remaining -= *cost;
          f.deficit = std::max<int64_t>(0, f.deficit - *cost);
        }
      }
      if (active[i]) any_active = true;
    }
  }
  return budget - remaining;
}

// The visiting order of a pass: the anchor first, then the other keys of
// `flows` (an ordered map) after it, wrapping around.
template <class Map>
std::vector<typename Map::key_type> OrderFrom(const Map& flows, const typename Map::key_type& anchor) {
  std::vector<typename Map::key_type> order;
  auto start = flows.find(anchor);
  for (auto it = start; it != flows.end(); ++it) order.push_back(it->first);
  for (auto it = flows.begin(); it != start; ++it) order.push_back(it->first);
  return order;
}

// The key whose flow holds the oldest ready ticket (the anchor) among the
// flows whose value passes eligible(value), for an ordered map of flows whose
// values have a `ticket` member; nullptr when none passes.
template <class Map, class Pred>
const typename Map::key_type* OldestTicket(const Map& flows, Pred eligible) {
  const typename Map::key_type* anchor = nullptr;
  const typename Map::mapped_type* best = nullptr;
  for (const auto& [key, flow] : flows)
    if (eligible(flow) && (best == nullptr || flow.ticket < best->ticket)) anchor = &key, best = &flow;
  return anchor;
}

// The anchor among all flows of a non-empty map.
template <class Map>
typename Map::key_type OldestTicket(const Map& flows) {
  return *OldestTicket(flows, [](const auto&) { return true; });
}

}  // namespace loom::sched
