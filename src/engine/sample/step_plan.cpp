// The sampler's step rule; see step_plan.h.
#include "engine/sample/step_plan.h"

#include <algorithm>

namespace loom::engine::sample {
namespace {

using Admitted = std::vector<std::unique_ptr<SampleRequest>>;

// tenant -> over its share (SHARES in step_plan.h).
std::map<std::string, bool> OverShare(const Admitted& admitted, const StepHistory& h) {
  std::map<std::string, int64_t> load;
  for (const auto& r : admitted) load[r->call.tenant] += r->kv_tokens;
  for (const auto& [tenant, done] : h.last_done)
    if (h.step - done < kRecentSteps) load.emplace(tenant, 0);
  int64_t total = 0;
  for (const auto& [tenant, l] : load) total += l;
  const int64_t n = static_cast<int64_t>(load.size());
  std::map<std::string, bool> over;
  for (const auto& [tenant, l] : load) over[tenant] = l * n > total;
  return over;
}

// Appends chunks of the prefilling requests that pass `take`, in admission
// order, within `budget` prompt tokens; returns the tokens added.
template <class Pred>
int64_t AddChunks(const Admitted& admitted, Pred take, int64_t budget, std::vector<PrefillChunk>* chunks) {
  int64_t used = 0;
  for (const auto& owned : admitted) {
    SampleRequest& r = *owned;
    if (!r.prefilling() || !take(r)) continue;
    const int64_t begin = r.sequences[0]->cached, left = r.prompt_len() - begin;
    if (used >= budget || (r.whole_prefill() && left > budget - used && !chunks->empty())) break;
    const int64_t n = r.whole_prefill() ? left : std::min(left, budget - used);
    chunks->push_back({&r, begin, begin + n});
    used += n;
  }
  return used;
}

// The running rows of requests that pass `take`.
template <class Pred>
std::vector<Sequence*> Rows(const Admitted& admitted, Pred take) {
  std::vector<Sequence*> rows;
  for (const auto& r : admitted)
    if (!r->prefilling() && take(*r))
      for (const auto& s : r->sequences)
        if (!s->finished) rows.push_back(s.get());
  return rows;
}

template <class Pred>
bool AnyPrefilling(const Admitted& admitted, Pred take) {
  return std::any_of(admitted.begin(), admitted.end(), [&](const auto& r) { return r->prefilling() && take(*r); });
}

}  // namespace

StepPlan PlanStep(const Admitted& admitted, const StepLimits& limits, const StepHistory& h) {
  StepPlan plan;
  const std::map<std::string, bool> over = OverShare(admitted, h);
  const auto is_over = [&](const SampleRequest& r) { return over.at(r.call.tenant); };
  const auto is_within = [&](const SampleRequest& r) { return !over.at(r.call.tenant); };
  const auto all = [](const SampleRequest&) { return true; };
  plan.contended = std::any_of(over.begin(), over.end(), [](const auto& t) { return t.second; });
  const bool any_rows = !Rows(admitted, all).empty();

  if (!plan.contended) {
    plan.prefill = AnyPrefilling(admitted, all) && (!h.last_prefill || !any_rows);
    if (plan.prefill) {
      AddChunks(admitted, all, limits.max_prefill_tokens, &plan.chunks);
    } else {
      plan.rows = Rows(admitted, all);
    }
    return plan;
  }

  const bool within_waits = AnyPrefilling(admitted, is_within);
  const bool over_waits = AnyPrefilling(admitted, is_over);
  std::vector<Sequence*> within_rows = Rows(admitted, is_within);
  std::vector<Sequence*> over_rows = Rows(admitted, is_over);
  const size_t cap = limits.contended_decode_rows > 0 ? static_cast<size_t>(limits.contended_decode_rows)
                                                      : over_rows.size();
  // Over-share work that a within-share decode step leaves waiting.
  const bool over_left = over_waits || over_rows.size() > cap;
  if (within_waits && !(h.last_within_prefill && any_rows)) {
    plan.prefill = plan.within_prefill = true;  // 1
  } else if (!within_rows.empty() && !(over_left && h.within_run >= kDecodeRun)) {
    plan.within_decode = true;  // 2
    if (over_rows.size() > cap) {
      // The rows that waited longest first; ties in arrival order.
      std::stable_sort(over_rows.begin(), over_rows.end(), [](const Sequence* a, const Sequence* b) {
        if (a->last_step != b->last_step) return a->last_step < b->last_step;
        return a->request->id < b->request->id;
      });
      over_rows.resize(cap);
    }
    plan.rows = std::move(within_rows);
    plan.rows.insert(plan.rows.end(), over_rows.begin(), over_rows.end());
    if (limits.mixed_steps) AddChunks(admitted, is_over, limits.contended_prefill_tokens, &plan.chunks);
    return plan;
  } else {  // 3: the over-share tenants' turn
    plan.prefill = over_waits && (!h.last_prefill || !any_rows);
    if (!plan.prefill) {
      plan.rows = Rows(admitted, all);
      if (limits.mixed_steps && !plan.rows.empty())
        AddChunks(admitted, is_over, limits.contended_prefill_tokens, &plan.chunks);
      return plan;
    }
  }
  const int64_t used =
      plan.within_prefill ? AddChunks(admitted, is_within, limits.max_prefill_tokens, &plan.chunks) : 0;
  if (!plan.within_prefill || limits.prefill_riders)
    AddChunks(admitted, is_over, std::min(limits.contended_prefill_tokens, limits.max_prefill_tokens - used),
              &plan.chunks);
  return plan;
}

}  // namespace loom::engine::sample
