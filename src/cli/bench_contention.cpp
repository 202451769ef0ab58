// `loom bench sample --contention`: what one tenant's flood costs another
// tenant's small requests on the sampler. Tenant "light" sends requests one
// after another (each waits for the previous), first on an idle sampler, then
// while tenant "flood" keeps --flood-depth requests queued (each completion
// submits another). Each phase starts with an uncounted round of light
// requests. Prints the light requests' p50/p99 latency, submit to result, in
// both phases and their ratio, the flood's tokens/s (the tokens the sampler
// generated during the light requests, less theirs), the slowest light
// requests beside the flood and the decode graphs captured meanwhile.
#include "cli/bench_contention.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "cli/trace_profile.h"

namespace loom::cli {
namespace {

using Clock = std::chrono::steady_clock;
using engine::SampleCall;
using engine::SampleOutput;

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

// The light tenant's requests, one at a time: their latencies in seconds;
// *tokens (when given) adds the tokens they generated.
Result<std::vector<double>> LightRequests(engine::Sampler& s, const ContentionOptions& o, uint32_t seed,
                                          int64_t* tokens = nullptr) {
  std::mt19937 rng(seed);
  std::vector<double> latencies;
  for (int i = 0; i < o.light_requests; ++i) {
    SampleCall c;
    if (!o.arrival_order) c.tenant = "light", c.session = "light:sample:0";
    c.prompt = RandomPrompt(rng, s.info().vocab_size, o.light_prompt);
    c.params.max_tokens = o.light_tokens;
    c.params.temperature = 1.0;
    c.params.seed = seed + static_cast<uint32_t>(i);
    auto p = std::make_shared<std::promise<Result<SampleOutput>>>();
    auto f = p->get_future();
    const auto t0 = Clock::now();
    s.Submit(std::move(c), [p](Result<SampleOutput> r) { p->set_value(std::move(r)); });
    Result<SampleOutput> r = f.get();
    if (!r.ok()) return r.status();
    latencies.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    if (tokens)
      for (const auto& seq : r->sequences) *tokens += static_cast<int64_t>(seq.tokens.size());
  }
  return latencies;
}

// Keeps `depth` flood requests in the sampler until stopped; each completion
// (on the decode thread) submits the next.
class Flood {
 public:
  Flood(engine::Sampler& s, const ContentionOptions& o) : s_(s), o_(o), rng_(99) {}
  void Start() {
    for (int i = 0; i < o_.flood_depth; ++i) SubmitOne();
  }
  // Stops refilling, cancels what is left and waits for its callbacks.
  void Stop() {
    stop_ = true;
    s_.Cancel(kSession, Status::Unavailable("the bench is over"));  // nameless calls (--arrival-order) drain
    while (in_flight_.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  int64_t failures() const { return failures_.load(); }

 private:
  static constexpr const char* kSession = "flood:sample:0";
  void SubmitOne() {
    SampleCall c;
    if (!o_.arrival_order) c.tenant = "flood", c.session = kSession;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c.prompt = RandomPrompt(rng_, s_.info().vocab_size, o_.flood_prompt);
      c.params.seed = seed_++;
    }
    c.params.max_tokens = o_.flood_tokens;
    c.params.temperature = 1.0;
    ++in_flight_;
    s_.Submit(std::move(c), [this](Result<SampleOutput> r) {
      if (!r.ok() && !stop_) ++failures_;
      if (!stop_) SubmitOne();
      --in_flight_;
    });
  }

  engine::Sampler& s_;
  const ContentionOptions& o_;
  std::mutex mu_;
  std::mt19937 rng_;
  uint64_t seed_ = 1;
  std::atomic<bool> stop_{false};
  std::atomic<int> in_flight_{0};
  std::atomic<int64_t> failures_{0};
};

// The sampler's steps between two snapshots of its stats: what the light
// requests' steps cost and carried (decode rows, prefill tokens), so a
// phase's latency can be read against the steps it waited for.
void PrintSteps(const char* name, const engine::SamplerStats& a, const engine::SamplerStats& b) {
  const int64_t decode = b.decode_steps - a.decode_steps, prefill = b.prefill_steps - a.prefill_steps;
  const auto per = [](double x, int64_t n) { return n > 0 ? x / static_cast<double>(n) : 0.0; };
  std::printf("%-22s %lld decode steps (%.1f rows, %.2f ms a step), %lld prefill steps (%.0f tokens, %.2f ms a step; "
              "%lld on the decode graphs), %lld contended, %lld mixed\n",
              name, static_cast<long long>(decode), per(static_cast<double>(b.decode_rows - a.decode_rows), decode),
              per(1e3 * (b.decode_seconds - a.decode_seconds), decode), static_cast<long long>(prefill),
              per(static_cast<double>(b.prefill_tokens - a.prefill_tokens), prefill),
              per(1e3 * (b.prefill_seconds - a.prefill_seconds), prefill),
              static_cast<long long>(b.fast_prefill_steps - a.fast_prefill_steps),
              static_cast<long long>(b.contended_steps - a.contended_steps),
              static_cast<long long>(b.mixed_steps - a.mixed_steps));
}

}  // namespace

std::vector<int32_t> RandomPrompt(std::mt19937& rng, int64_t vocab, int len) {
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(vocab) - 2);
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (int32_t& t : p) t = tok(rng);
  return p;
}

int RunContention(engine::Sampler& s, const ContentionOptions& o) {
  std::printf("contention: light tenant %d requests one at a time (prompt %d, %d new tokens); flood tenant keeps %d "
              "requests queued (prompt %d, %d new tokens)\n",
              o.light_requests, o.light_prompt, o.light_tokens, o.flood_depth, o.flood_prompt, o.flood_tokens);
  if (o.arrival_order) std::printf("--arrival-order: both tenants in one flow, admitted in arrival order\n");
  if (auto warm = LightRequests(s, o, 7); !warm.ok())
    return std::fprintf(stderr, "loom bench sample: %s\n", warm.status().message().c_str()), 1;
  const engine::SamplerStats idle_before = s.stats();
  auto idle = LightRequests(s, o, 1000);
  const engine::SamplerStats idle_after = s.stats();
  if (!idle.ok()) return std::fprintf(stderr, "loom bench sample: %s\n", idle.status().message().c_str()), 1;

  Flood flood(s, o);
  flood.Start();
  // As on the idle sampler, one uncounted round first: the flood's first
  // prompts and the step shapes a sampler meets once in its life (each new
  // shape of the fast decode path is a CUDA graph capture, which waits for
  // the whole device) are not what a light request meets beside a running flood.
  if (auto warm = LightRequests(s, o, 7); !warm.ok()) {
    flood.Stop();
    return std::fprintf(stderr, "loom bench sample: %s\n", warm.status().message().c_str()), 1;
  }
  // The flood's tokens: every token the sampler generated meanwhile, less the light requests'.
  const engine::SamplerStats before = s.stats();
  const int64_t generated_before = before.tokens_generated;
  Status traced = o.profile.empty() ? Status::Ok() : StartTrace();
  const auto t0 = Clock::now();
  int64_t light_tokens = 0;
  auto busy = traced.ok() ? LightRequests(s, o, 1000, &light_tokens) : Result<std::vector<double>>(traced);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const engine::SamplerStats after = s.stats();
  const int64_t flood_tokens = after.tokens_generated - generated_before - light_tokens;
  if (traced.ok() && !o.profile.empty()) traced = StopTrace(o.profile + ".contended.json");
  flood.Stop();
  if (!traced.ok()) return std::fprintf(stderr, "loom bench sample: %s\n", traced.message().c_str()), 1;
  if (!busy.ok()) return std::fprintf(stderr, "loom bench sample: %s\n", busy.status().message().c_str()), 1;
  if (flood.failures() > 0)
    return std::fprintf(stderr, "loom bench sample: %lld flood requests failed\n",
                        static_cast<long long>(flood.failures())), 1;

  const double idle50 = Percentile(*idle, 0.5), idle99 = Percentile(*idle, 0.99);
  const double busy50 = Percentile(*busy, 0.5), busy99 = Percentile(*busy, 0.99);
  std::printf("%-22s %10s %10s\n", "light requests", "p50 ms", "p99 ms");
  std::printf("%-22s %10.1f %10.1f\n", "idle sampler", idle50 * 1e3, idle99 * 1e3);
  std::printf("%-22s %10.1f %10.1f\n", "beside the flood", busy50 * 1e3, busy99 * 1e3);
  std::printf("contention / idle: p50 %.2fx, p99 %.2fx; flood generated %.0f tokens/s meanwhile\n", busy50 / idle50,
              busy99 / idle99, static_cast<double>(flood_tokens) / seconds);
  PrintSteps("idle sampler steps", idle_before, idle_after);
  PrintSteps("beside the flood steps", before, after);
  std::vector<double> slowest = *busy;
  std::sort(slowest.rbegin(), slowest.rend());
  slowest.resize(std::min<size_t>(slowest.size(), 3));
  std::printf("beside the flood, the slowest light requests:");
  for (double v : slowest) std::printf(" %.1f ms", v * 1e3);
  std::printf("; graph captures meanwhile %lld (%.1f ms), %lld before\n",
              static_cast<long long>(after.decode_graphs_captured - before.decode_graphs_captured),
              (after.decode_graph_capture_seconds - before.decode_graph_capture_seconds) * 1e3,
              static_cast<long long>(before.decode_graphs_captured));
  return 0;
}

}  // namespace loom::cli
