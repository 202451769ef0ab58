// Prometheus text rendering and the windowed rates of service/metrics.h.
#include "service/metrics.h"

#include <fmt/format.h>

#include <optional>
#include <string_view>

namespace loom::service {

namespace {
// Label values escape backslash, quote and newline (exposition format).
std::string Label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// The value of the model_id label of one sample line, unescaped (Label()'s
// inverse); nullopt when the line has none.
std::optional<std::string> ModelIdOf(std::string_view line) {
  constexpr std::string_view kKey = "model_id=\"";
  const size_t brace = line.find('{');
  if (brace == std::string_view::npos) return std::nullopt;
  size_t i = line.find(kKey, brace);
  if (i == std::string_view::npos) return std::nullopt;
  std::string value;
  for (i += kKey.size(); i < line.size() && line[i] != '"'; ++i) {
    if (line[i] == '\\' && i + 1 < line.size()) {
      ++i;
      value += line[i] == 'n' ? '\n' : line[i];
    } else {
      value += line[i];
    }
  }
  return value;
}

void Head(std::string& out, const char* name, const char* type, const char* help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}
}  // namespace

void Metrics::TrimLocked(std::deque<Sample>& samples, Clock::time_point now) const {
  while (!samples.empty() && now - samples.front().at > window_) samples.pop_front();
}

double Metrics::RateLocked(const std::deque<Sample>& samples, Clock::time_point now) const {
  int64_t tokens = 0;
  for (const Sample& s : samples) {
    if (now - s.at <= window_) tokens += s.tokens;
  }
  return static_cast<double>(tokens) / std::chrono::duration<double>(window_).count();
}

double Metrics::pass_seconds(const std::string& kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pass_seconds_.find(kind);
  return it == pass_seconds_.end() ? 0.0 : it->second;
}

int64_t Metrics::passes(const std::string& kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = passes_.find(kind);
  return it == passes_.end() ? 0 : it->second;
}

int64_t Metrics::training_tokens() const {
  std::lock_guard<std::mutex> lock(mu_);
  return training_tokens_;
}

void Metrics::RecordPass(const std::string& kind, int64_t tokens, double fill_ratio, size_t models, double seconds) {
  (void)models;
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  ++passes_[kind];
  pass_seconds_[kind] += seconds;
  if (kind == "forward_backward" || kind == "forward") {
    training_tokens_ += tokens;
    training_recent_.push_back({now, tokens});
    TrimLocked(training_recent_, now);
    fill_sum_ += fill_ratio;
    ++fill_count_;
    last_fill_ = fill_ratio;
    last_fill_tokens_ = tokens;
  }
}

Metrics::Fill Metrics::fill() const {
  std::lock_guard<std::mutex> lock(mu_);
  return Fill{fill_count_, last_fill_tokens_, last_fill_, fill_count_ ? fill_sum_ / fill_count_ : 0.0};
}

double Metrics::publish_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return publish_seconds_;
}

void Metrics::RecordPublish(double seconds, bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  ++(ok ? publishes_ : publish_failures_);
  publish_seconds_ += seconds;
}

Metrics::SnapshotSeconds Metrics::snapshot_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_seconds_;
}

void Metrics::RecordSnapshotCopy(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ++snapshot_seconds_.count;
  snapshot_seconds_.copy += seconds;
}

void Metrics::RecordSnapshotHandoff(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_seconds_.handoff += seconds;
}

void Metrics::RecordQueueWait(const std::string& model_id, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& w = wait_[model_id];
  w.first += seconds;
  ++w.second;
}

void Metrics::AddSamplingTokens(int64_t tokens) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  sampling_tokens_ += tokens;
  sampling_recent_.push_back({now, tokens});
  TrimLocked(sampling_recent_, now);
}

void Metrics::CountResponse(int status_code) {
  std::lock_guard<std::mutex> lock(mu_);
  ++responses_[status_code];
}

double Metrics::TrainingTokensPerSecond() const {
  std::lock_guard<std::mutex> lock(mu_);
  return RateLocked(training_recent_, Clock::now());
}

double Metrics::SamplingTokensPerSecond() const {
  std::lock_guard<std::mutex> lock(mu_);
  return RateLocked(sampling_recent_, Clock::now());
}

int64_t Metrics::responses(int status_code) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = responses_.find(status_code);
  return it == responses_.end() ? 0 : it->second;
}

std::string Metrics::KeepModelSeries(const std::string& text,
                                     const std::function<bool(const std::string& model_id)>& visible) {
  std::map<std::string, bool> seen;  // model -> visible
  std::string out;
  out.reserve(text.size());
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    end = end == std::string::npos ? text.size() : end + 1;
    const std::string_view line(text.data() + start, end - start);
    start = end;
    if (!line.empty() && line[0] != '#') {
      if (auto model = ModelIdOf(line)) {
        auto it = seen.find(*model);
        if (it == seen.end()) it = seen.emplace(*model, visible(*model)).first;
        if (!it->second) continue;
      }
    }
    out += line;
  }
  return out;
}

void Metrics::RenderUsage(std::string& out, const std::vector<tinker::TenantUsage>& usage) {
  if (usage.empty()) return;
  // One family per figure (docs/usage.md), each with one sample per tenant.
  auto family = [&](const char* name, const char* type, const char* help, auto value) {
    Head(out, name, type, help);
    for (const tinker::TenantUsage& u : usage) {
      out += fmt::format("{}{{tenant=\"{}\"}} {}\n", name, Label(u.tenant), value(u));
    }
  };
  using U = tinker::TenantUsage;
  family("loom_tenant_tokens_trained_total", "counter", "forward_backward tokens the trainer ran, per tenant.",
         [](const U& u) { return u.tokens_trained; });
  family("loom_tenant_tokens_forward_total", "counter", "forward (no gradient) tokens the trainer ran, per tenant.",
         [](const U& u) { return u.tokens_forward; });
  family("loom_tenant_tokens_sampled_total", "counter", "Tokens generated by asample, per tenant.",
         [](const U& u) { return u.tokens_sampled; });
  family("loom_tenant_prompt_tokens_total", "counter", "Prompt tokens of asample requests, per tenant.",
         [](const U& u) { return u.prompt_tokens; });
  family("loom_tenant_prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache, per tenant.",
         [](const U& u) { return u.prompt_tokens_cached; });
  family("loom_tenant_passes_total", "counter", "Trainer passes that ran a request of the tenant.",
         [](const U& u) { return u.passes; });
  family("loom_tenant_slot_seconds_total", "counter", "Seconds the tenant's models held adapter slots.",
         [](const U& u) { return fmt::format("{:.3f}", u.slot_seconds); });
  family("loom_tenant_live_models", "gauge", "The tenant's models holding an adapter slot.",
         [](const U& u) { return u.live_models; });
  family("loom_tenant_waiting_models", "gauge", "The tenant's create_model calls waiting for a slot.",
         [](const U& u) { return u.waiting_models; });
  family("loom_tenant_checkpoints", "gauge", "Checkpoints the tenant stores.", [](const U& u) { return u.checkpoints; });
  family("loom_tenant_bytes_stored", "gauge", "Bytes of the tenant's checkpoints on disk.",
         [](const U& u) { return u.bytes_stored; });
}

std::string Metrics::Render(const QueueSnapshot& live) const {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  Head(out, "loom_queue_depth", "gauge", "Requests of a model queued (ready or waiting for an earlier seq_id).");
  for (const auto& [model, m] : live.models) {
    out += fmt::format("loom_queue_depth{{model_id=\"{}\"}} {}\n", Label(model), m.queued);
  }
  Head(out, "loom_queue_oldest_wait_seconds", "gauge", "Age of a model's oldest ready request.");
  for (const auto& [model, m] : live.models) {
    out += fmt::format("loom_queue_oldest_wait_seconds{{model_id=\"{}\"}} {:.6f}\n", Label(model), m.oldest_wait_s);
  }
  Head(out, "loom_queue_wait_seconds", "summary", "Time from ready to first engine pass, per model.");
  for (const auto& [model, w] : wait_) {
    out += fmt::format("loom_queue_wait_seconds_sum{{model_id=\"{}\"}} {:.6f}\n", Label(model), w.first);
    out += fmt::format("loom_queue_wait_seconds_count{{model_id=\"{}\"}} {}\n", Label(model), w.second);
  }
  Head(out, "loom_passes_total", "counter", "Engine passes by kind.");
  for (const auto& [kind, n] : passes_) out += fmt::format("loom_passes_total{{kind=\"{}\"}} {}\n", kind, n);
  Head(out, "loom_pass_seconds_total", "counter", "Engine time by pass kind.");
  for (const auto& [kind, s] : pass_seconds_) {
    out += fmt::format("loom_pass_seconds_total{{kind=\"{}\"}} {:.6f}\n", kind, s);
  }
  Head(out, "loom_batch_fill_ratio", "gauge", "Tokens / token budget of the last forward(_backward) pass.");
  out += fmt::format("loom_batch_fill_ratio {:.6f}\n", last_fill_);
  Head(out, "loom_batch_fill_ratio_mean", "gauge", "Mean fill ratio over all forward(_backward) passes.");
  out += fmt::format("loom_batch_fill_ratio_mean {:.6f}\n", fill_count_ ? fill_sum_ / fill_count_ : 0.0);
  Head(out, "loom_token_budget", "gauge", "Tokens per packed pass (--token-budget).");
  out += fmt::format("loom_token_budget {}\n", live.token_budget);
  Head(out, "loom_training_tokens_total", "counter", "Tokens run through forward(_backward) passes.");
  out += fmt::format("loom_training_tokens_total {}\n", training_tokens_);
  Head(out, "loom_training_tokens_per_second", "gauge", "Training tokens per second over the recent window.");
  out += fmt::format("loom_training_tokens_per_second {:.3f}\n", RateLocked(training_recent_, now));
  Head(out, "loom_sampling_tokens_total", "counter", "Tokens generated by samplers.");
  out += fmt::format("loom_sampling_tokens_total {}\n", sampling_tokens_);
  Head(out, "loom_sampling_tokens_per_second", "gauge", "Sampled tokens per second over the recent window.");
  out += fmt::format("loom_sampling_tokens_per_second {:.3f}\n", RateLocked(sampling_recent_, now));
  Head(out, "loom_slots_in_use", "gauge", "Adapter slots bound to live models.");
  out += fmt::format("loom_slots_in_use {}\n", live.slots_in_use);
  Head(out, "loom_slots_total", "gauge", "Adapter slots (--max-adapters).");
  out += fmt::format("loom_slots_total {}\n", live.slots_total);
  Head(out, "loom_publishes_total", "counter",
       "save_weights_for_sampler snapshots written and committed off the engine thread, by result.");
  out += fmt::format("loom_publishes_total{{result=\"ok\"}} {}\n", publishes_);
  out += fmt::format("loom_publishes_total{{result=\"failed\"}} {}\n", publish_failures_);
  Head(out, "loom_publish_seconds_total", "counter", "Writer-thread time spent writing and committing snapshots.");
  out += fmt::format("loom_publish_seconds_total {:.6f}\n", publish_seconds_);
  Head(out, "loom_snapshot_seconds_total", "counter",
       "Engine-thread time of save_weights_for_sampler's snapshots, by part: the slot's copy, the hand-off to the "
       "writers.");
  out += fmt::format("loom_snapshot_seconds_total{{part=\"copy\"}} {:.9f}\n", snapshot_seconds_.copy);
  out += fmt::format("loom_snapshot_seconds_total{{part=\"handoff\"}} {:.9f}\n", snapshot_seconds_.handoff);
  Head(out, "loom_train_planned_passes_total", "counter",
       "forward_backward passes the trainer's memory plan sized (on a GPU).");
  out += fmt::format("loom_train_planned_passes_total {}\n", live.planned_passes);
  Head(out, "loom_train_recomputed_layers_total", "counter",
       "Decoder layers those passes recomputed in their backward (each runs its forward again; see --pass-tokens).");
  out += fmt::format("loom_train_recomputed_layers_total {}\n", live.recomputed_layers);
  Head(out, "loom_train_rows_total", "counter",
       "Rows those passes trained: their datums' tokens less the rows of shared prefixes trained once for several "
       "datums (--shared-prefixes; loom_training_tokens_total counts every datum's).");
  out += fmt::format("loom_train_rows_total {}\n", live.planned_rows);
  Head(out, "loom_publishes_pending", "gauge", "Snapshots queued or being written.");
  out += fmt::format("loom_publishes_pending {}\n", live.publishes_pending);
  Head(out, "loom_sampler_adapter_loads_total", "counter", "Sampler snapshot loads from disk.");
  out += fmt::format("loom_sampler_adapter_loads_total {}\n", live.adapter_loads);
  Head(out, "loom_sampler_adapter_installs_total", "counter",
       "Sampler snapshots installed from the trainer's memory (no disk read).");
  out += fmt::format("loom_sampler_adapter_installs_total {}\n", live.adapter_installs);
  if (live.sampler_replicas > 0) {
    Head(out, "loom_sampler_replicas", "gauge", "Sampler replicas the gateway routes to (--sampler-replicas).");
    out += fmt::format("loom_sampler_replicas {}\n", live.sampler_replicas);
    Head(out, "loom_sampler_replicas_live", "gauge", "Of those, the ones taking calls now.");
    out += fmt::format("loom_sampler_replicas_live {}\n", live.sampler_replicas_live);
    Head(out, "loom_sampler_resubmitted_total", "counter",
         "asample calls submitted again to another replica after theirs failed (killed or hung).");
    out += fmt::format("loom_sampler_resubmitted_total {}\n", live.sampler_resubmitted);
  }
  Head(out, "loom_capacity_waiters", "gauge", "create_model calls waiting for an adapter slot (--capacity-wait).");
  out += fmt::format("loom_capacity_waiters {}\n", live.capacity_waiters);
  Head(out, "loom_http_responses_total", "counter", "HTTP responses by status code.");
  for (const auto& [code, n] : responses_) out += fmt::format("loom_http_responses_total{{code=\"{}\"}} {}\n", code, n);
  RenderUsage(out, live.usage);
  return out;
}

}  // namespace loom::service
