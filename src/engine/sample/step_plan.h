// PlanStep: what the sampler's next step runs, a prefill of prompt chunks or
// one decode step over running rows, and whose work it carries when tenants
// contend: a light tenant's work never waits behind a heavy tenant's long
// prefill chunk (issue 19).
//
// SHARES. A tenant's load is the KV tokens its admitted requests reserve
// (SampleRequest::kv_tokens: their worst case, as admission counts them).
// The tenants with work are those with an admitted request, and those whose
// last request completed in the last kRecentSteps steps (at load 0): a client
// that sends its next request as soon as it has a result (an agent, an RL
// loop) finds a small step in progress, not a full chunk. A tenant whose load
// is above the mean of the tenants with work is over its share; the others
// are within it. The step is contended when some tenant is over its share
// (then there are two tenants or more, unequal): one tenant alone, or equal
// loads, run uncontended.
//
// RULE.
//  Uncontended: a prefill step when prompts wait and the last step was not a
//   prefill (or no row is running), taking up to max_prefill_tokens in
//   admission order, a longer prompt in chunks; else a decode step over every
//   running row.
//  Contended: within-share work goes first, and the over-share tenants'
//   work that shares its steps is capped: at most contended_prefill_tokens
//   of their prompts per prefill step (together, in admission order, after
//   the within-share chunks), at most contended_decode_rows of their running
//   rows per decode step (those that waited longest; 0 = all rows).
//   1. A prefill step when a within-share prompt waits, unless the last step
//      was one and rows are running (then a decode step comes between); it
//      carries capped over-share chunks too unless prefill_riders is off.
//   2. Else a decode step of the within-share rows and the capped over-share
//      ones, unless kDecodeRun such steps in a row have left over-share work
//      waiting (a prompt, or rows beyond the cap): then 3, so a long
//      generation cannot starve the other tenants.
//   3. Else the over-share tenants' turn: a capped prefill step when their
//      prompts wait and the last step was not a prefill (or no row runs),
//      else a decode step of every running row.
//   With mixed_steps (see StepLimits), the decode steps of 2 and 3 carry a
//   capped over-share prefill too (StepPlan: rows and chunks both set).
//  Effect: a within-share request waits for at most one capped step at
//  arrival, then runs its prefill and, back to back, its decode steps, each
//  carrying a capped part of the others' work: its latency stays within a
//  small factor of its latency alone, however long the others' prompts are;
//  the over-share tenants take what is left (work conserving).
//  A prompt asking for prompt logprobs is prefilled whole: it joins a step
//  only where it fits the budget left, or as the step's first chunk.
//
// Threading: plain functions of the scheduler's state (the decode thread).
// Torch-free.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/sample/sequence.h"

namespace loom::engine::sample {

// Steps a tenant counts as having work after its last request completed.
constexpr uint64_t kRecentSteps = 16;
// Rule-2 decode steps in a row while over-share work waits.
constexpr int kDecodeRun = 4;

struct StepLimits {
  int64_t max_prefill_tokens = 8192;
  int64_t contended_prefill_tokens = 512;
  int64_t contended_decode_rows = 0;  // 0 = every running row
  // MIXED: a contended decode step (rules 2 and 3) also carries up to
  // contended_prefill_tokens of the over-share tenants' prompts in the same
  // forward (ModelRunner::Mixed, on the CUDA decode graphs). Their prompts
  // then advance in every step, not only in prefill steps; each rider adds
  // a row to the step's graph (on the H200 that made the light tenant's steps
  // dearer about as much as it sped the flood: docs/benchmarks.md, session 14).
  bool mixed_steps = false;
  // RIDERS: a within-share prefill step (rule 1) also carries up to
  // contended_prefill_tokens of the over-share prompts. Off: it carries the
  // within-share chunks alone, so the light request's prefill costs what it
  // costs on an idle sampler (on the CUDA decode graphs the riders' rows
  // also move the step to a larger row bucket); the over-share prompts then
  // advance in rule-3 steps only.
  bool prefill_riders = true;
};

// The steps before this one, as the rule reads them.
struct StepHistory {
  uint64_t step = 0;                  // steps run so far
  bool last_prefill = false;          // the last step was a prefill
  bool last_within_prefill = false;   // ... carrying a within-share tenant's chunk
  int within_run = 0;                 // rule-2 steps in a row just before this one
  std::map<std::string, uint64_t> last_done;  // tenant -> step (1-based) of its last completion
};

struct StepPlan {
  bool prefill = false;
  bool contended = false;
  bool within_prefill = false;        // a prefill carrying a within-share tenant's chunk (rule 1)
  bool within_decode = false;         // a decode step of rule 2
  std::vector<PrefillChunk> chunks;   // prefill: admission order (a mixed decode step: its riding chunks)
  std::vector<Sequence*> rows;        // decode: within-share rows, then over-share ones
};

StepPlan PlanStep(const std::vector<std::unique_ptr<SampleRequest>>& admitted, const StepLimits& limits,
                  const StepHistory& history);

}  // namespace loom::engine::sample
