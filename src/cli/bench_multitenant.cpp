// `loom bench multi-tenant`: every tenant trains its own adapter with
// forward_backward(cross_entropy, --tokens tokens) + optim_step per step,
// through the in-process Service (sequencer, planner, engine thread: the
// path `loom serve` runs). Two schedules of the same requests:
//   packed      all tenants submit their step at once; the scheduler packs them
//   one-by-one  tenant after tenant, each waiting for its own step
// and, as the yardstick for packing, one tenant sending the same tokens as one
// datum of N x --tokens tokens per step (the best case for the engine: one
// long sequence, one adapter).
// Prints tokens/s of the three and the ratios.
#include "cli/bench_multitenant.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <unistd.h>

#include "cli/service_driver.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

engine::ForwardBackwardCall StepCall(int tokens, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> tok(0, vocab - 1);
  engine::Datum d;
  std::vector<int64_t> targets;
  for (int i = 0; i < tokens; ++i) {
    d.tokens.push_back(static_cast<int32_t>(tok(rng)));
    targets.push_back(tok(rng));
  }
  d.loss_fn_inputs["target_tokens"] = engine::Array::Ints(targets);
  engine::ForwardBackwardCall call;
  call.data.push_back(std::move(d));
  return call;
}

// One step of tenant i: fwd/bwd then optim, both awaited (one-by-one) or
// only submitted (packed; ids appended to pending).
Status Step(ServiceDriver& d, Tenant& t, int i, int tokens, bool wait,
            std::vector<std::pair<Tenant*, std::string>>* pending) {
  auto fb = d.SubmitForwardBackward(t, StepCall(tokens, d.info().vocab_size, 1000 + i));
  if (!fb.ok()) return fb.status();
  auto op = d.SubmitOptimStep(t, engine::AdamParams{});
  if (!op.ok()) return op.status();
  if (wait) {
    if (auto r = d.Await(t, *fb); !r.ok()) return r.status();
    if (auto r = d.Await(t, *op); !r.ok()) return r.status();
  } else {
    pending->push_back({&t, *fb});
    pending->push_back({&t, *op});
  }
  return Status::Ok();
}

enum class Schedule { kOneByOne, kPacked, kSingle };

// Seconds of one round: one step of every tenant, packed or one by one; or
// one step of tenant 0 with all the round's tokens.
Result<double> Round(ServiceDriver& d, std::vector<Tenant>& tenants, int tokens, Schedule schedule) {
  const auto t0 = Clock::now();
  if (schedule == Schedule::kSingle) {
    const int all = tokens * static_cast<int>(tenants.size());
    if (Status st = Step(d, tenants[0], 0, all, true, nullptr); !st.ok()) return st;
  } else if (schedule == Schedule::kPacked) {
    std::vector<std::pair<Tenant*, std::string>> pending;
    for (size_t i = 0; i < tenants.size(); ++i) {
      if (Status st = Step(d, tenants[i], static_cast<int>(i), tokens, false, &pending); !st.ok()) return st;
    }
    for (auto& [t, id] : pending) {
      if (auto r = d.Await(*t, id); !r.ok()) return r.status();
    }
  } else {
    for (size_t i = 0; i < tenants.size(); ++i) {
      if (Status st = Step(d, tenants[i], static_cast<int>(i), tokens, true, nullptr); !st.ok()) return st;
    }
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Total seconds of `steps` rounds of each schedule, after one untimed warm-up
// round of each. The schedules alternate round by round, so load from other
// processes on the machine hits both alike.
// seconds[k]: total of Schedule k.
Status Run(ServiceDriver& d, std::vector<Tenant>& tenants, int tokens, int steps, double seconds[3]) {
  seconds[0] = seconds[1] = seconds[2] = 0;
  for (int s = 0; s <= steps; ++s) {
    for (Schedule k : {Schedule::kOneByOne, Schedule::kPacked, Schedule::kSingle}) {
      auto r = Round(d, tenants, tokens, k);
      if (!r.ok()) return r.status();
      if (s > 0) seconds[static_cast<int>(k)] += *r;
    }
  }
  return Status::Ok();
}

}  // namespace

int BenchMultiTenant(int argc, char** argv) {
  CLI::App app{"tokens/s of N tenants packed by the scheduler vs one tenant at a time", "loom bench multi-tenant"};
  int tenants = 8, tokens = 64, steps = 5, rank = 8, threads = 0;
  int64_t token_budget = 8192;
  std::string model_dir;
  app.add_option("--tenants", tenants, "concurrent tenants")->default_val(tenants)->check(CLI::Range(1, 256));
  app.add_option("--tokens", tokens, "tokens per tenant per step")->default_val(tokens)->check(CLI::Range(2, 1 << 20));
  app.add_option("--steps", steps, "timed steps per schedule (after one warm-up)")->default_val(steps)->check(CLI::Range(1, 100000));
  app.add_option("--rank", rank, "LoRA rank of every tenant")->default_val(rank)->check(CLI::Range(1, 1024));
  app.add_option("--threads", threads, "CPU threads (0 = all cores)")->default_val(threads);
  app.add_option("--token-budget", token_budget, "tokens per packed pass")->default_val(token_budget);
  app.add_option("--model", model_dir, "HF model dir (default: the embedded tiny qwen3)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const std::string data_dir = (fs::temp_directory_path() / ("loom-bench-mt-" + std::to_string(::getpid()))).string();
  DriverOptions opt;
  opt.model_dir = model_dir;
  opt.data_dir = data_dir;
  opt.max_slots = tenants;
  opt.max_rank = rank;
  opt.threads = threads;
  opt.token_budget = token_budget;
  auto driver = ServiceDriver::Open(opt);
  if (!driver.ok()) {
    std::fprintf(stderr, "loom bench multi-tenant: %s\n", driver.status().message().c_str());
    return 2;
  }
  ServiceDriver& d = **driver;
  std::vector<Tenant> ts;
  for (int i = 0; i < tenants; ++i) {
    auto t = d.NewTenant("tenant-" + std::to_string(i), rank, 100 + i);
    if (!t.ok()) {
      std::fprintf(stderr, "loom bench multi-tenant: create_model: %s\n", t.status().message().c_str());
      return 2;
    }
    ts.push_back(*t);
  }
  const auto& info = d.info();
  std::printf("model=%s device=%s dtype=%s layers=%lld hidden=%lld tenants=%d tokens=%d steps=%d rank=%d budget=%lld\n",
              info.model_type.c_str(), info.device.c_str(), info.dtype.c_str(),
              static_cast<long long>(info.num_layers), static_cast<long long>(info.hidden_size), tenants, tokens,
              steps, rank, static_cast<long long>(token_budget));
  double seconds[3];
  Status st = Run(d, ts, tokens, steps, seconds);
  driver->reset();
  std::error_code ec;
  fs::remove_all(data_dir, ec);
  if (!st.ok()) {
    std::fprintf(stderr, "loom bench multi-tenant: %s\n", st.message().c_str());
    return 1;
  }
  const double total = static_cast<double>(tenants) * tokens * steps;
  const double solo = seconds[0], packed = seconds[1], single = seconds[2];
  const double solo_tps = total / solo, packed_tps = total / packed, single_tps = total / single;
  std::printf("one-by-one: %.1f tokens/s (%.1f ms per round of %d tenant steps)\n", solo_tps, solo * 1e3 / steps, tenants);
  std::printf("packed:     %.1f tokens/s (%.1f ms per round of %d tenant steps)\n", packed_tps, packed * 1e3 / steps, tenants);
  std::printf("one tenant: %.1f tokens/s (%.1f ms per step of %d tokens)\n", single_tps, single * 1e3 / steps,
              tenants * tokens);
  std::printf("ratio:      %.2fx (packed / one-by-one)\n", packed_tps / solo_tps);
  std::printf("vs single:  %.2fx (packed / one tenant with all the tokens)\n", packed_tps / single_tps);
  return 0;
}

}  // namespace loom::cli
