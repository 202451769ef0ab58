// FairQueue: the sampler's waiting requests, and the order in which they are
// admitted: fair by tokens across tenants and, within a tenant, across its
// sampling sessions, with the trainer's deficit round robin (sched/drr.h).
//
// A flow is one sampling session (SampleCall::tenant, SampleCall::session),
// a FIFO of its requests in arrival order. Calls without names share one flow.
//
// POLICY (Admit, called between steps):
//  1. Anchor. Each flow's head holds a ready ticket, taken when the flow
//     became non-empty or when it last had a request admitted. The flow with
//     the oldest ticket goes first, then the others in (tenant, session)
//     order after it, so the first turn rotates over flows. A flow whose
//     head its own tenant's limit holds back (ready() false: the tenant's
//     owed prefill fills a step) sits out the pass and cannot be the anchor,
//     so one tenant's backlog never blocks another's admission.
//  2. DRR over the flows: the pass's budget is the free KV cache in tokens, a
//     request costs its worst-case KV tokens (BlockManager::WorstCase), the
//     deficit cap is the whole KV cache, and a session's quantum is
//     cap / (tenants waiting x that tenant's sessions waiting), so every
//     tenant's sessions together get one tenant's share. A request that fails
//     the scheduler's other limits (batch rows, prefill tokens, an adapter
//     slot) ends its flow's turn in this pass.
//  3. The anchor's head waits for room: if it does not fit, nothing is
//     admitted in this pass, so a stream of small requests from others cannot
//     starve a large one. A flow that had a request admitted takes a fresh
//     ticket; one that empties is forgotten with its deficit.
//  Effect: a light tenant's request is admitted as soon as room frees (in the
//  same pass when there is room), however deep another tenant's queue is; a
//  backlogged tenant takes the rest (work conserving).
//
// Threading: the decode thread only.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/sample/sequence.h"
#include "sched/drr.h"

namespace loom::engine::sample {

class FairQueue {
 public:
  // cap_tokens: the KV cache in tokens (the deficit cap; >= any request's cost).
  explicit FairQueue(int64_t cap_tokens) : cap_(cap_tokens) {}

  void Push(std::unique_ptr<SampleRequest> r);
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }

  // ready(r): false when r's own tenant holds it back in this pass.
  // cost(r): r's worst-case KV tokens, or nullopt when r fails the limits
  // other than KV in this pass. admit(owned): kTaken or kDropped when it took
  // the request out of `owned` (admitted, or completed with an error),
  // kRefused when it left it (not now). Returns the anchor's head when it
  // could not be admitted (the pass admitted nothing), else nullptr.
  using ReadyFn = std::function<bool(const SampleRequest&)>;
  using CostFn = std::function<std::optional<int64_t>(const SampleRequest&)>;
  using AdmitFn = std::function<sched::Take(std::unique_ptr<SampleRequest>&)>;
  const SampleRequest* Admit(int64_t free_tokens, const ReadyFn& ready, const CostFn& cost, const AdmitFn& admit);

  // Takes out every waiting request of one sampling session (arrival order).
  std::vector<std::unique_ptr<SampleRequest>> TakeSession(const std::string& session);
  // Takes out every waiting request.
  std::vector<std::unique_ptr<SampleRequest>> TakeAll();

 private:
  using Key = std::pair<std::string, std::string>;  // (tenant, session)
  struct Flow {
    std::deque<std::unique_ptr<SampleRequest>> requests;  // front = head
    uint64_t ticket = 0;
    sched::DrrFlow drr;
  };

  int64_t cap_;
  std::map<Key, Flow> flows_;  // only non-empty flows
  size_t size_ = 0;
  uint64_t next_ticket_ = 1;
};

}  // namespace loom::engine::sample
