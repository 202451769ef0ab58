// `loom bench rl`: the client-driven RL loop of issue 18, against the
// in-process Service (the code path of `loom serve`, minus HTTP). Each tenant
// runs --steps steps, each of three calls as a cookbook RL recipe makes them:
//   1. sample --group completions of --new-tokens from a --prompt-len prompt,
//      on a sampling session of the version saved last (step 0: the fresh
//      adapter, saved before the loop);
//   2. importance_sampling forward_backward on all of them (target tokens,
//      the sampler's logprobs, advantages = reward - the group's mean), then
//      optim_step;
//   3. save_weights_for_sampler, the version the next step samples.
// Tenants run concurrently, one client thread each, then (the yardstick) the
// same loop with fresh tenants one at a time (left out with --no-yardstick,
// to compare settings of the together round); with --heavy-tenant, once more
// concurrently with tenant 0 sampling 10x the group, to show what a heavy
// sampler costs the others. Prints steps/s, where a step's
// client time goes, the save's share of the trainer's busy time (engine
// seconds of exclusive passes, which in the loop are the saves, over all
// engine seconds: what a save leaves on the engine thread, the snapshot),
// the writer threads' time per save (PEFT files and commit, off the engine
// thread), and how the sampler got each version it sampled (disk loads
// against installs of the trainer's in-memory snapshot).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "cli/bench_rl.h"
#include "cli/gpu_busy.h"
#include "cli/service_driver.h"
#include "cli/trace_profile.h"
#include "service/metrics.h"
#include "service/pass_room.h"
#include "engine/model/device.h"
#include "engine/sample_api.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct RlOptions {
  std::string model_dir;
  int tenants = 4;
  int steps = 3;
  int group = 4;
  int prompt_len = 16;
  int new_tokens = 16;
  int rank = 8;
  int threads = 0;
  double lr = 1e-3;
  bool heavy_tenant = false;
  bool yardstick = true;  // --no-yardstick: the together round only (comparing settings of it)
  bool unnamed_saves = false;
  int publish_threads = service::ServiceOptions{}.publish_threads;
  std::string publish_staging = "per-write";
  int64_t token_budget = DriverOptions{}.token_budget;
  int64_t kv_budget_tokens = DriverOptions{}.kv_budget_tokens;
  std::string pass_tokens = "most";
  std::string lora_order = "ragged";
  std::string shared_prefixes = "on";
  bool small_ops_first = false;
  std::string profile;  // a Kineto trace of the together round, PATH.together.json
  const StepFlags* sampler_steps = nullptr;
  const DecodeFlags* sampler_decode = nullptr;
};

constexpr int kHeavyFactor = 10;  // --heavy-tenant: tenant 0's group is this many times --group

// Seconds a tenant's client spent in each call of its steps.
struct Phases {
  double sample = 0, train = 0, save = 0;
  double total() const { return sample + train + save; }
  Phases& operator+=(const Phases& o) {
    sample += o.sample;
    train += o.train;
    save += o.save;
    return *this;
  }
};

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The reward of a completion: the share of its tokens with an even id (a
// task the adapter can learn, computed from the tokens alone).
double Reward(const std::vector<int32_t>& tokens) {
  if (tokens.empty()) return 0;
  return static_cast<double>(std::count_if(tokens.begin(), tokens.end(), [](int32_t t) { return t % 2 == 0; })) /
         static_cast<double>(tokens.size());
}

// The importance_sampling datums of one sampled group on `prompt`.
std::vector<engine::Datum> GroupData(const std::vector<int32_t>& prompt, const tinker::SampleOutput& out) {
  std::vector<double> rewards;
  for (const auto& s : out.sequences) rewards.push_back(Reward(s.tokens));
  const double mean = std::accumulate(rewards.begin(), rewards.end(), 0.0) / static_cast<double>(rewards.size());
  std::vector<engine::Datum> data;
  for (size_t i = 0; i < out.sequences.size(); ++i) {
    const auto& seq = out.sequences[i];
    if (seq.tokens.empty()) continue;
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), seq.tokens.begin(), seq.tokens.end());
    engine::Datum d;
    d.tokens.assign(all.begin(), all.end() - 1);
    std::vector<int64_t> targets(all.begin() + 1, all.end());
    // Positions before the completion carry no loss: advantage 0.
    const size_t first = prompt.size() - 1;
    std::vector<float> logprobs(targets.size(), 0.0f), advantages(targets.size(), 0.0f);
    for (size_t k = 0; k < seq.tokens.size(); ++k) {
      logprobs[first + k] = seq.logprobs[k];
      advantages[first + k] = static_cast<float>(rewards[i] - mean);
    }
    d.loss_fn_inputs["target_tokens"] = engine::Array::Ints(std::move(targets));
    d.loss_fn_inputs["logprobs"] = engine::Array::Floats(std::move(logprobs));
    d.loss_fn_inputs["advantages"] = engine::Array::Floats(std::move(advantages));
    data.push_back(std::move(d));
  }
  return data;
}

// `group` completions of `prompt`: one asample call, or, past the sampler's
// per-call limit (the heavy tenant's 10x group), several sent at once, as
// a client wanting that many makes them.
Result<tinker::SampleOutput> SampleGroup(ServiceDriver& d, const Tenant& t, const std::string& session,
                                         const std::vector<int32_t>& prompt, int group,
                                         const tinker::SamplingParams& params) {
  const int limit = engine::SamplerOptions{}.max_num_samples;
  if (group <= limit) return d.Sample(t, session, prompt, group, params);
  const int calls = (group + limit - 1) / limit;
  std::vector<Result<tinker::SampleOutput>> parts(static_cast<size_t>(calls), Status::Internal("not run"));
  std::vector<std::thread> threads;
  for (int c = 0; c < calls; ++c) {
    threads.emplace_back([&, c] {
      tinker::SamplingParams p = params;
      if (p.seed) p.seed = *p.seed + static_cast<uint32_t>(c) * 7919u;
      parts[static_cast<size_t>(c)] = d.Sample(t, session, prompt, std::min(limit, group - c * limit), p, c);
    });
  }
  for (auto& th : threads) th.join();
  tinker::SampleOutput out;
  for (auto& part : parts) {
    if (!part.ok()) return part.status();
    for (auto& seq : part->sequences) out.sequences.push_back(std::move(seq));
  }
  return out;
}

// One tenant's loop; *phases gets its client seconds per call kind, and
// *mean_logprob the mean sampled logprob of each step.
Status RunTenant(ServiceDriver& d, Tenant& t, const RlOptions& o, int group, uint32_t seed, Phases* phases,
                 std::vector<double>* mean_logprob) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(d.info().vocab_size) - 1);
  std::vector<int32_t> prompt(static_cast<size_t>(o.prompt_len));
  for (int32_t& p : prompt) p = tok(rng);
  // The version the next step samples: a named save's path (a sampling
  // session is made on it), or with --unnamed-saves the ephemeral sampler of
  // an unnamed save (the SDK's save_weights_and_get_sampling_client).
  const auto save = [&](const std::string& name) {
    return o.unnamed_saves ? d.SaveAndGetSampler(t) : d.SaveForSampler(t, name);
  };
  auto version = save("v0");
  if (!version.ok()) return version.status();
  for (int step = 0; step < o.steps; ++step) {
    auto t0 = Clock::now();
    auto session = o.unnamed_saves ? version : d.NewSamplingSession(t, *version);
    if (!session.ok()) return session.status();
    tinker::SamplingParams params;
    params.max_tokens = o.new_tokens;
    params.temperature = 1.0;
    params.seed = seed * 1000u + static_cast<uint32_t>(step);
    auto out = SampleGroup(d, t, *session, prompt, group, params);
    if (!out.ok()) return out.status();
    phases->sample += Since(t0);
    double lp = 0;
    size_t n = 0;
    for (const auto& s : out->sequences)
      for (float x : s.logprobs) lp += x, ++n;
    mean_logprob->push_back(n ? lp / static_cast<double>(n) : 0.0);

    t0 = Clock::now();
    engine::ForwardBackwardCall call;
    call.data = GroupData(prompt, *out);
    call.loss_fn = "importance_sampling";
    auto fb = d.SubmitForwardBackward(t, std::move(call));
    if (!fb.ok()) return fb.status();
    engine::AdamParams adam;
    adam.learning_rate = o.lr;
    auto opt = d.SubmitOptimStep(t, adam);
    if (!opt.ok()) return opt.status();
    for (const std::string& id : {*fb, *opt})
      if (auto done = d.Await(t, id); !done.ok()) return done.status();
    phases->train += Since(t0);

    t0 = Clock::now();
    version = save("step-" + std::to_string(step + 1));
    if (!version.ok()) return version.status();
    phases->save += Since(t0);
  }
  return Status::Ok();
}

struct RoundResult {
  double wall = 0;                 // seconds for the whole round
  Phases phases;                   // summed over tenants
  double busy = 0, save_busy = 0;  // engine seconds: all passes, exclusive (save) passes
  double write = 0;                // writer-thread seconds of the saves (write + commit, off the engine thread)
  double sampling = 0;             // sampler seconds: its prefill and decode steps (device time: each ends on the host)
  int64_t saves = 0;
  int64_t disk_loads = 0, memory_installs = 0;  // how the sampler got each new version
  std::vector<double> first_lp, last_lp;
  std::vector<double> tenant_seconds;  // each tenant's client seconds over its steps
  int64_t device_mallocs = 0, alloc_retries = 0;  // the device allocator's, during the round
  double gpu_busy = -1;  // NVML's utilization over the round (GpuBusyMeter), -1 where there is no meter
  // Where the device time went: the sampler's steps and the trainer's passes.
  int64_t decode_steps = 0, prefill_steps = 0, decode_rows = 0, max_rows = 0;
  double decode_seconds = 0, prefill_seconds = 0;
  int64_t fb_passes = 0, optim_passes = 0, train_tokens = 0;
  int64_t planned_passes = 0, recomputed_layers = 0, planned_rows = 0;  // Engine::TrainRecomputeStats over the round
  double fb_seconds = 0, optim_seconds = 0;
  // The saves' engine-thread time by part (Metrics::RecordSnapshotCopy, RecordSnapshotHandoff).
  service::Metrics::SnapshotSeconds snapshots;
};

// The tenants' loops, concurrently (one thread each) or one after another;
// tenant 0 samples heavy_group completions per step when that is > 0.
Result<RoundResult> Round(ServiceDriver& d, std::vector<Tenant>& tenants, const RlOptions& o, bool concurrent,
                          uint32_t seed, GpuBusyMeter* meter, int heavy_group = 0) {
  auto& metrics = d.service().metrics();
  const auto engine_seconds = [&] {
    double s = 0;
    for (const char* kind : {"forward_backward", "forward", "optim_step", "exclusive"}) s += metrics.pass_seconds(kind);
    return s;
  };
  const double busy0 = engine_seconds(), save0 = metrics.pass_seconds("exclusive"), write0 = metrics.publish_seconds();
  const double fb_s0 = metrics.pass_seconds("forward_backward"), optim_s0 = metrics.pass_seconds("optim_step");
  const int64_t fb0 = metrics.passes("forward_backward"), optim0 = metrics.passes("optim_step");
  const int64_t tokens0 = metrics.training_tokens();
  const service::Metrics::SnapshotSeconds snap0 = metrics.snapshot_seconds();
  const engine::SamplerStats sampler0 = d.service().sampler_stats().value_or(engine::SamplerStats{});
  const engine::DeviceMemory memory0 = d.service().device_memory();
  const engine::Engine::RecomputeStats recompute0 = d.service().recompute_stats();
  std::vector<Phases> phases(tenants.size());
  std::vector<std::vector<double>> lps(tenants.size());
  std::vector<Status> status(tenants.size(), Status::Ok());
  if (meter) meter->Start();
  const auto t0 = Clock::now();
  auto one = [&](size_t i) {
    const int group = i == 0 && heavy_group > 0 ? heavy_group : o.group;
    status[i] = RunTenant(d, tenants[i], o, group, seed + static_cast<uint32_t>(i), &phases[i], &lps[i]);
  };
  if (concurrent) {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < tenants.size(); ++i) threads.emplace_back(one, i);
    for (auto& th : threads) th.join();
  } else {
    for (size_t i = 0; i < tenants.size(); ++i) one(i);
  }
  RoundResult r;
  r.wall = Since(t0);
  if (meter) r.gpu_busy = meter->Stop();
  for (size_t i = 0; i < tenants.size(); ++i) {
    if (!status[i].ok()) return status[i];
    r.phases += phases[i];
    r.tenant_seconds.push_back(phases[i].total());
    r.first_lp.push_back(lps[i].front());
    r.last_lp.push_back(lps[i].back());
  }
  r.busy = engine_seconds() - busy0;
  r.save_busy = metrics.pass_seconds("exclusive") - save0;
  r.write = metrics.publish_seconds() - write0;
  r.saves = static_cast<int64_t>(tenants.size()) * (o.steps + 1);
  const engine::SamplerStats sampler1 = d.service().sampler_stats().value_or(engine::SamplerStats{});
  r.sampling = (sampler1.prefill_seconds + sampler1.decode_seconds) - (sampler0.prefill_seconds + sampler0.decode_seconds);
  r.disk_loads = sampler1.adapter_loads - sampler0.adapter_loads;
  r.memory_installs = sampler1.adapter_installs - sampler0.adapter_installs;
  r.decode_steps = sampler1.decode_steps - sampler0.decode_steps;
  r.prefill_steps = sampler1.prefill_steps - sampler0.prefill_steps;
  r.decode_rows = sampler1.decode_rows - sampler0.decode_rows;
  r.max_rows = sampler1.max_rows_in_step;  // over the run so far
  r.decode_seconds = sampler1.decode_seconds - sampler0.decode_seconds;
  r.prefill_seconds = sampler1.prefill_seconds - sampler0.prefill_seconds;
  r.fb_passes = metrics.passes("forward_backward") - fb0;
  r.optim_passes = metrics.passes("optim_step") - optim0;
  r.train_tokens = metrics.training_tokens() - tokens0;
  r.fb_seconds = metrics.pass_seconds("forward_backward") - fb_s0;
  r.optim_seconds = metrics.pass_seconds("optim_step") - optim_s0;
  const service::Metrics::SnapshotSeconds snap1 = metrics.snapshot_seconds();
  r.snapshots = {snap1.count - snap0.count, snap1.copy - snap0.copy, snap1.handoff - snap0.handoff};
  const engine::DeviceMemory memory1 = d.service().device_memory();
  r.device_mallocs = memory1.device_mallocs - memory0.device_mallocs;
  r.alloc_retries = memory1.alloc_retries - memory0.alloc_retries;
  const engine::Engine::RecomputeStats recompute1 = d.service().recompute_stats();
  r.planned_passes = recompute1.passes - recompute0.passes;
  r.recomputed_layers = recompute1.layers - recompute0.layers;
  r.planned_rows = recompute1.rows - recompute0.rows;
  return r;
}

// The share of the round's wall time the device was busy training or
// sampling: on a GPU with NVML, its utilization over the round (the share of
// time a kernel ran); elsewhere estimated from the trainer's passes and the
// sampler's steps, timed on their own threads, which may overlap, so the
// union of the two lies between the larger of them and their sum.
std::string BusyShare(const RoundResult& r) {
  if (r.gpu_busy >= 0) return fmt::format("{:.0f}%", 100 * r.gpu_busy);
  const double lo = std::max(r.busy, r.sampling) / r.wall, hi = std::min(1.0, (r.busy + r.sampling) / r.wall);
  return fmt::format("{:.0f}-{:.0f}%", 100 * lo, 100 * hi);
}

void Print(const char* name, const RoundResult& r, const RlOptions& o) {
  const double steps = static_cast<double>(o.tenants) * o.steps;
  std::printf("%-12s %10.3f %12.3f %10.1f %10.1f %10.1f %10.1f %9.1f%% %10.2f %10.2f %6lld/%lld %10s\n", name,
              steps / r.wall, o.steps / (r.phases.total() / o.tenants), 1e3 * r.phases.sample / steps,
              1e3 * r.phases.train / steps, 1e3 * r.phases.save / steps, 1e3 * r.busy / steps,
              r.busy > 0 ? 100.0 * r.save_busy / r.busy : 0.0, 1e3 * r.save_busy / static_cast<double>(r.saves),
              1e3 * r.write / static_cast<double>(r.saves), static_cast<long long>(r.disk_loads),
              static_cast<long long>(r.memory_installs), BusyShare(r).c_str());
}

// Where a round's device time went: the sampler's decode and prefill steps
// (count, rows a decode step carried on average, ms a step) and the
// trainer's passes (count, tokens a pass, ms a pass), and the saves'
// snapshots (ms a snapshot: the slot's copy, the hand-off to the writers).
void PrintDeviceTime(const char* name, const RoundResult& r, int64_t layers) {
  const auto per = [](double seconds, int64_t n) { return n > 0 ? 1e3 * seconds / static_cast<double>(n) : 0.0; };
  std::printf("%-12s sampler: %lld decode steps (%.1f rows a step, at most %lld so far; %.2f ms a step), %lld prefill "
              "steps (%.2f ms); trainer: %lld forward_backward passes (%.0f tokens, %.0f rows trained once shared, %.1f "
              "ms a pass, %.1f of %lld layers recomputed), %lld optim_step passes (%.1f ms), %lld snapshots (copy %.2f "
              "ms, hand-off %.2f ms)\n",
              name, static_cast<long long>(r.decode_steps),
              r.decode_steps > 0 ? static_cast<double>(r.decode_rows) / static_cast<double>(r.decode_steps) : 0.0,
              static_cast<long long>(r.max_rows), per(r.decode_seconds, r.decode_steps),
              static_cast<long long>(r.prefill_steps), per(r.prefill_seconds, r.prefill_steps),
              static_cast<long long>(r.fb_passes),
              r.fb_passes > 0 ? static_cast<double>(r.train_tokens) / static_cast<double>(r.fb_passes) : 0.0,
              r.planned_passes > 0 ? static_cast<double>(r.planned_rows) / static_cast<double>(r.planned_passes) : 0.0,
              per(r.fb_seconds, r.fb_passes),
              r.planned_passes > 0 ? static_cast<double>(r.recomputed_layers) / static_cast<double>(r.planned_passes)
                                   : 0.0,
              static_cast<long long>(layers), static_cast<long long>(r.optim_passes), per(r.optim_seconds, r.optim_passes),
              static_cast<long long>(r.snapshots.count), per(r.snapshots.copy, r.snapshots.count),
              per(r.snapshots.handoff, r.snapshots.count));
}

int BenchRlRun(const RlOptions& o) {
  std::string templ = (fs::temp_directory_path() / "loom-bench-rl-XXXXXX").string();
  if (!::mkdtemp(templ.data())) {
    std::fprintf(stderr, "loom bench rl: cannot create a temp dir\n");
    return 1;
  }
  const std::string data_dir = templ;
  auto fail = [&](const Status& s) {
    std::fprintf(stderr, "loom bench rl: %s\n", s.message().c_str());
    std::error_code ec;
    fs::remove_all(data_dir, ec);
    return 1;
  };
  DriverOptions opt;
  opt.model_dir = o.model_dir;
  opt.data_dir = data_dir;
  // Fresh tenants for each round, the last round's unloaded first: the
  // slots of one round's tenants, as a server of N tenants holds.
  opt.max_slots = o.tenants;
  opt.max_rank = o.rank;
  opt.threads = o.threads;
  opt.with_sampler = true;
  opt.publish_threads = o.publish_threads;
  opt.publish_staging_ahead = o.publish_staging == "ahead";
  opt.token_budget = o.token_budget;
  opt.kv_budget_tokens = o.kv_budget_tokens;
  opt.pass_sizing = service::ParsePassSizing(o.pass_tokens);
  opt.lora_ragged = o.lora_order == "ragged";
  opt.share_prefixes = o.shared_prefixes == "on";
  opt.small_ops_first = o.small_ops_first;
  opt.sampler_steps = o.sampler_steps;
  opt.sampler_decode = o.sampler_decode;
  auto driver = ServiceDriver::Open(opt);
  if (!driver.ok()) return fail(driver.status());
  ServiceDriver& d = **driver;
  // Round k's tenants (tenant-kN .. tenant-kN+N-1, seeds 1..N in every
  // round), after round k-1's are unloaded.
  std::vector<Tenant> previous;
  auto fresh = [&](int k) -> Result<std::vector<Tenant>> {
    for (const Tenant& t : previous)
      if (Status s = d.Unload(t); !s.ok()) return s;
    std::vector<Tenant> set;
    for (int i = 0; i < o.tenants; ++i) {
      auto t = d.NewTenant("tenant-" + std::to_string(k * o.tenants + i), o.rank, static_cast<uint64_t>(i + 1));
      if (!t.ok()) return t.status();
      set.push_back(*t);
    }
    previous = set;
    return set;
  };
  const auto& info = d.info();
  // On a GPU the busy column is measured (NVML); elsewhere, or without NVML, estimated.
  std::unique_ptr<GpuBusyMeter> meter;
  if (info.device != "cpu") {
    at::Device dev(at::kCPU);
    if (engine::ResolveDevice(info.device, &dev).ok()) meter = GpuBusyMeter::Open(engine::PciBusId(dev));
  }
  std::printf("model %s (%s, %s/%s), %d tenants x %d steps: group %d, prompt %d, %d new tokens, rank %d, lr %g; "
              "%d publish threads, token budget %lld, %s saves\n",
              o.model_dir.empty() ? "embedded tiny qwen3" : o.model_dir.c_str(), info.model_type.c_str(),
              info.device.c_str(), info.dtype.c_str(), o.tenants, o.steps, o.group, o.prompt_len, o.new_tokens, o.rank,
              o.lr, o.publish_threads, static_cast<long long>(d.token_budget()), o.unnamed_saves ? "unnamed" : "named");
  auto together = fresh(0);
  if (!together.ok()) return fail(together.status());
  if (!o.profile.empty())
    if (Status s = StartTrace(); !s.ok()) return fail(s);
  auto conc = Round(d, *together, o, /*concurrent=*/true, 11, meter.get());
  if (!o.profile.empty())
    if (Status s = StopTrace(o.profile + ".together.json"); !s.ok()) return fail(s);
  if (!conc.ok()) return fail(conc.status());
  std::optional<RoundResult> seq;  // the yardstick: fresh tenants one at a time
  if (o.yardstick) {
    auto alone = fresh(1);
    if (!alone.ok()) return fail(alone.status());
    auto r = Round(d, *alone, o, /*concurrent=*/false, 11, meter.get());
    if (!r.ok()) return fail(r.status());
    seq = std::move(*r);
  }
  std::printf("%-12s %10s %12s %10s %10s %10s %10s %10s %10s %10s %13s %10s\n", "tenants", "steps/s", "steps/s/ten",
              "sample ms", "train ms", "save ms", "engine ms", "save/busy", "snap ms", "write ms", "disk/memory",
              "busy");
  Print("together", *conc, o);
  if (seq) Print("one by one", *seq, o);
  const std::string speedup =
      seq ? fmt::format("{:.2f}x", (o.tenants * o.steps / conc->wall) / (o.tenants * o.steps / seq->wall))
          : std::string("not measured (--no-yardstick)");
  std::printf("aggregate speed-up of running together: %s (ms columns: client time per step, summed over tenants;\n"
              "  engine ms: engine time per step; save/busy: the saves' share of it (the snapshot, on the engine thread);\n"
              "  snap ms / write ms: per save, engine-thread time and writer-thread time (PEFT files + commit, off the\n"
              "  engine thread); disk/memory: how the sampler got the versions it sampled: loads from disk / installs\n"
              "  from the trainer's snapshot; busy: the share of the round's wall time the device trained or sampled:\n"
              "  %s)\n",
              speedup.c_str(),
              meter ? "NVML's GPU utilization (the share of time a kernel ran, as nvidia-smi's), polled every 50 ms"
                    : "between max(engine, sampler) and their sum, as the trainer's passes and the sampler's steps may overlap");
  if (info.device != "cpu")  // where a save's snapshot may wait: its copy's memory from the driver
    std::printf("device allocator, together / one by one: %lld / %s cudaMalloc calls, %lld / %s retried after "
                "freeing its cache (each retry waits for all queued device work)\n",
                static_cast<long long>(conc->device_mallocs),
                seq ? std::to_string(seq->device_mallocs).c_str() : "-", static_cast<long long>(conc->alloc_retries),
                seq ? std::to_string(seq->alloc_retries).c_str() : "-");
  PrintDeviceTime("together", *conc, info.num_layers);
  if (seq) PrintDeviceTime("one by one", *seq, info.num_layers);
  if (o.heavy_tenant) {
    auto set = fresh(o.yardstick ? 2 : 1);
    if (!set.ok()) return fail(set.status());
    auto heavy = Round(d, *set, o, /*concurrent=*/true, 11, meter.get(), kHeavyFactor * o.group);
    if (!heavy.ok()) return fail(heavy.status());
    Print("with heavy", *heavy, o);
    // The light tenants (1..N-1): their mean client seconds per step beside
    // the heavy tenant, against the same tenants' in the plain round.
    double with = 0, without = 0;
    for (int i = 1; i < o.tenants; ++i) {
      with += heavy->tenant_seconds[static_cast<size_t>(i)];
      without += conc->tenant_seconds[static_cast<size_t>(i)];
    }
    const double steps = static_cast<double>(o.tenants - 1) * o.steps;
    std::printf("light tenants' step beside one sampling %dx their group: %.1f ms against %.1f ms, %.2fx\n",
                kHeavyFactor, 1e3 * with / steps, 1e3 * without / steps, with / without);
  }
  std::printf("mean sampled logprob, first -> last step, per tenant (together):");
  for (size_t i = 0; i < conc->first_lp.size(); ++i) std::printf(" %.3f->%.3f", conc->first_lp[i], conc->last_lp[i]);
  std::printf("\n");
  driver->reset();
  std::error_code ec;
  fs::remove_all(data_dir, ec);
  return 0;
}

}  // namespace

int BenchRl(int argc, char** argv) {
  CLI::App app{"The client-driven RL loop (sample, train, publish) of N tenants on the in-process service",
               "loom bench rl"};
  RlOptions o;
  app.add_option("--model", o.model_dir, "HF model dir (default: the embedded tiny qwen3)");
  app.add_option("--tenants", o.tenants, "concurrent tenants")->default_val(o.tenants)->check(CLI::Range(1, 256));
  app.add_option("--steps", o.steps, "steps per tenant")->default_val(o.steps)->check(CLI::Range(1, 10000));
  app.add_option("--group", o.group, "completions per step")->default_val(o.group)->check(CLI::Range(1, 256));
  app.add_option("--prompt-len", o.prompt_len, "prompt tokens")->default_val(o.prompt_len)->check(CLI::Range(2, 1 << 16));
  app.add_option("--new-tokens", o.new_tokens, "tokens sampled per completion")
      ->default_val(o.new_tokens)
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--rank", o.rank, "LoRA rank")->default_val(o.rank)->check(CLI::Range(1, 1024));
  app.add_option("--threads", o.threads, "CPU threads (0 = all cores)")->default_val(o.threads);
  app.add_option("--lr", o.lr, "AdamW learning rate")->default_val(o.lr)->check(CLI::Range(0.0, 10.0));
  app.add_option("--publish-threads", o.publish_threads, "writer threads for save_weights_for_sampler (as loom serve's)")
      ->default_val(o.publish_threads)
      ->check(CLI::Range(1, 64));
  app.add_option("--publish-staging", o.publish_staging,
                 "per-write | ahead: the writers' pinned staging memory, taken by each write or by each writer at "
                 "start-up (as loom serve's)")
      ->default_val(o.publish_staging)
      ->check(CLI::IsMember({"per-write", "ahead"}));
  app.add_option("--token-budget", o.token_budget,
                 "tokens per training pass, as loom serve's (0 = as serve's default: on a GPU the most that fit, "
                 "measured at start-up; 8192 on the CPU)")
      ->default_val(o.token_budget)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  app.add_option("--kv-budget-tokens", o.kv_budget_tokens,
                 "the sampler's KV cache in tokens, as loom serve's (0 = serve's default: 512 a batch row on a GPU, "
                 "65,536 on the CPU); what it leaves free is the trainer's room for activations")
      ->default_val(o.kv_budget_tokens)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--pass-tokens", o.pass_tokens,
                 "most | kept: passes sized to the most that fit with every layer recomputed, or to the tokens "
                 "that fit with every layer kept (as loom serve's flag)")
      ->default_val(o.pass_tokens)
      ->check(CLI::IsMember({"most", "kept"}));
  app.add_option("--lora-order", o.lora_order,
                 "ragged | padded: the trainer's LoRA over tenants of unequal tokens, as bench train's")
      ->default_val(o.lora_order)
      ->check(CLI::IsMember({"ragged", "padded"}));
  app.add_option("--shared-prefixes", o.shared_prefixes,
                 "on | off: a group's completions train their prompt's rows once, as loom serve's flag")
      ->default_val(o.shared_prefixes)
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--profile", o.profile,
                 "trace the together round (Kineto, libtorch 2.x) to PATH.together.json; the trainer's passes are "
                 "the spans \"trainer forward_backward\" (bench/trace_summary.py --during), its optimizer steps "
                 "and saves \"trainer optim_step\" and \"trainer snapshot\"; its figures then include the tracing");
  app.add_flag("--unnamed-saves", o.unnamed_saves,
               "save each version unnamed and sample its sampling session, as the SDK's "
               "save_weights_and_get_sampling_client (the cookbook's RL recipes) does; default: named saves");
  app.add_flag("--small-ops-first", o.small_ops_first,
               "ready optim_steps and saves run before the next packable pass (as loom serve's flag)");
  app.add_flag("--heavy-tenant", o.heavy_tenant, "also run with tenant 0 sampling 10x the group (needs --tenants >= 2)");
  app.add_flag("--yardstick,!--no-yardstick", o.yardstick,
               "run the one-at-a-time round, the speed-up's yardstick (default); --no-yardstick runs the together "
               "round alone, to compare settings of it at half the time");
  const StepFlags step_flags(app);  // the sampler's step limits, as loom serve takes them
  o.sampler_steps = &step_flags;
  const DecodeFlags decode_flags(app);  // and its decode switches (--decode-stream, ...)
  o.sampler_decode = &decode_flags;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (o.heavy_tenant && o.tenants < 2) {
    std::fprintf(stderr, "loom bench rl: --heavy-tenant needs --tenants >= 2 (a heavy one and the others)\n");
    return 2;
  }
  return BenchRlRun(o);
}

}  // namespace loom::cli
