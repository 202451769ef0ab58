// Metrics: the service's counters and gauges for GET /metrics, rendered as
// Prometheus text (exposition format 0.0.4, written by hand). The engine loop
// records passes and per-model queue waits, the writer threads record
// publishes, the sampler records generated tokens, the router counts responses by status code; the service adds the
// live gauges (queue depths, slots in use) when it renders.
//
// Invariant: counters only grow; the tokens/s gauges are rates over the last
// `window` of recorded work (0 when nothing ran in that window).
//
// Who sees what: series with a model_id label belong to that model's tenant;
// KeepModelSeries() drops the ones a viewer may not see (http/ decides who),
// the aggregates (no model_id) are for everyone. The per-tenant usage series
// (loom_tenant_*, labelled tenant) are rendered only when the snapshot
// carries usage, which http/ asks for only for the admin key.
//
// Threading: every method may be called from any thread (one internal mutex).
#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "service/pass_history.h"
#include "tinker/results.h"

namespace loom::service {

// Live state the service reads under its own lock when /metrics is scraped.
struct QueueSnapshot {
  struct Model {
    size_t queued = 0;          // requests ready or waiting for a smaller seq_id
    double oldest_wait_s = 0;   // age of its oldest ready request
  };
  std::map<std::string, Model> models;
  int slots_in_use = 0;
  int slots_total = 0;
  int capacity_waiters = 0;         // create_model calls waiting for a slot
  int64_t token_budget = 0;
  size_t publishes_pending = 0;     // save_weights_for_sampler snapshots queued or being written
  int64_t adapter_loads = 0;        // the sampler's snapshot loads from disk
  int64_t adapter_installs = 0;     // the sampler's snapshots installed from memory
  // The trainers' passes sized by their memory plans, the decoder layers
  // those recomputed and the rows they trained (Engine::TrainRecomputeStats,
  // summed over base models).
  int64_t planned_passes = 0, recomputed_layers = 0, planned_rows = 0;
  // Sampling on replicas (--sampler-replicas): how many, how many live, and
  // the calls submitted again after their replica failed. 0 in process.
  int64_t sampler_replicas = 0, sampler_replicas_live = 0, sampler_resubmitted = 0;
  std::vector<tinker::TenantUsage> usage;  // per tenant; empty: no loom_tenant_* series
};

class Metrics {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Metrics(std::chrono::seconds window = std::chrono::seconds(10)) : window_(window) {}

  // One engine pass: kind is "forward_backward", "forward", "optim_step" or
  // "exclusive"; tokens and fill ratio matter for the first two.
  void RecordPass(const std::string& kind, int64_t tokens, double fill_ratio, size_t models, double seconds);
  // One save_weights_for_sampler written and committed by a writer thread
  // (or failed there), and how long that took.
  void RecordPublish(double seconds, bool ok);
  // One save_weights_for_sampler's engine-thread time, in its two parts:
  // the slot's copy (launching it, and the allocation of its buffer),
  // recorded before the save is handed off (its future may be answered
  // then), and the hand-off to the writers (Publisher::Submit: an ephemeral
  // sampling session opened under ServiceLock::mu, a wait for room in the
  // queue), after.
  void RecordSnapshotCopy(double seconds);
  void RecordSnapshotHandoff(double seconds);
  // How long a request waited from ready to its first pass.
  void RecordQueueWait(const std::string& model_id, double seconds);
  // Tokens a sampler generated (the sampling layer calls this).
  void AddSamplingTokens(int64_t tokens);
  // One HTTP response (the router calls this).
  void CountResponse(int status_code);

  // Rates over the window, tokens per second.
  double TrainingTokensPerSecond() const;
  double SamplingTokensPerSecond() const;
  int64_t responses(int status_code) const;
  // Engine seconds recorded for passes of this kind so far (0 for none).
  double pass_seconds(const std::string& kind) const;
  // Engine passes of this kind so far.
  int64_t passes(const std::string& kind) const;
  // Tokens of the forward(_backward) passes so far.
  int64_t training_tokens() const;
  // Writer-thread seconds of the publishes so far (RecordPublish).
  double publish_seconds() const;
  // The snapshots' engine-thread seconds so far, by part (RecordSnapshotCopy, RecordSnapshotHandoff).
  struct SnapshotSeconds {
    int64_t count = 0;
    double copy = 0, handoff = 0;
  };
  SnapshotSeconds snapshot_seconds() const;

  // The forward(_backward) passes' fill, as loom_batch_fill_ratio* show it.
  struct Fill {
    int64_t passes = 0;
    int64_t last_tokens = 0;  // tokens of the last pass (against QueueSnapshot::token_budget)
    double last_ratio = 0;
    double mean_ratio = 0;
  };
  Fill fill() const;
  // Each model's recent forward_backward losses (the dashboard's curves).
  PassHistory& pass_history() { return history_; }
  const PassHistory& pass_history() const { return history_; }

  // The whole exposition, with the live gauges of `live`.
  std::string Render(const QueueSnapshot& live) const;
  // `text` (as Render() writes it) without the samples whose model_id label
  // names a model `visible` refuses; asks once per model. HELP/TYPE lines
  // and series without a model_id stay.
  static std::string KeepModelSeries(const std::string& text,
                                     const std::function<bool(const std::string& model_id)>& visible);

 private:
  struct Sample {
    Clock::time_point at;
    int64_t tokens;
  };
  double RateLocked(const std::deque<Sample>& samples, Clock::time_point now) const;
  static void RenderUsage(std::string& out, const std::vector<tinker::TenantUsage>& usage);
  void TrimLocked(std::deque<Sample>& samples, Clock::time_point now) const;

  const Clock::duration window_;
  mutable std::mutex mu_;
  std::map<std::string, int64_t> passes_;       // by kind
  std::map<std::string, double> pass_seconds_;  // by kind
  int64_t training_tokens_ = 0;
  int64_t sampling_tokens_ = 0;
  double fill_sum_ = 0;
  int64_t fill_count_ = 0;
  double last_fill_ = 0;
  int64_t last_fill_tokens_ = 0;
  std::map<std::string, std::pair<double, int64_t>> wait_;  // model -> (sum s, count)
  std::map<int, int64_t> responses_;
  int64_t publishes_ = 0, publish_failures_ = 0;
  double publish_seconds_ = 0;
  SnapshotSeconds snapshot_seconds_;
  mutable std::deque<Sample> training_recent_;
  mutable std::deque<Sample> sampling_recent_;
  PassHistory history_;  // its own lock
};

}  // namespace loom::service
