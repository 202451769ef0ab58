// `loom bench train`: training throughput of one tenant alone against N
// tenants packed into one engine call (forward_backward + optim_step per
// step), on the same engine code the service runs. Prints tokens/s for both
// and their ratio (the payoff of multi-tenant packing), the MFU and the
// device allocator's peak. MFU convention (bench/hf_peft_train.py's): 4 N
// FLOPs per trained token, N = the base parameters a token runs through (a
// tied embedding once; an MoE layer's experts k of E, the active parameters):
// forward 2N plus input gradients 2N, a frozen base has no weight-gradient
// matmuls; attention and the LoRA factors are left out; against 989 TFLOP/s
// (dense bf16, H100/H200). Printed on the GPU only.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <unistd.h>

#include "cli/bench_multitenant.h"
#include "cli/bench_rl.h"
#include "cli/bench_sample.h"
#include "cli/commands.h"
#include "cli/trace_profile.h"
#include "cli/trainer_group.h"
#include "engine/api.h"
#include "engine/model/attention.h"
#include "testmodel/make_model.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;
using engine::Datum;

struct TrainBenchOptions {
  std::string model_dir;
  int tenants = 8;
  int tokens_per_tenant = 64;
  int datum_tokens = 0;  // 0: each tenant's tokens are one datum
  int tokens_spread = 0;  // percent: tenants 1, 2 (mod 3) get that many more, fewer tokens than tenant 0's
  int steps = 5;
  // Untimed steps first: the first kCudnnAfterPasses passes of a shape take
  // the varlen flash kernel, the next builds cuDNN's plan for it
  // (engine/model/attention.h); the timed steps are the steady state of a
  // loop of one shape.
  int warmup = static_cast<int>(engine::kCudnnAfterPasses) + 1;
  int rank = 8;
  int threads = 0;
  std::string device = "auto";
  double lr = 1e-4;
  std::string save_adapter;  // after timing, tenant 0's PEFT snapshot goes here
  bool lora_fp32 = false;
  std::string lora_order = "ragged";
  int recompute_layers = -1;
  int64_t context_window = 0;  // 0: the model config's max_position_embeddings
  int64_t graph_tokens = engine::EngineOptions{}.graph_max_tokens;
  std::string moments = engine::EngineOptions{}.moments;
  std::string profile;       // a Kineto trace of one timed step of each row, PATH.one.json / PATH.packed.json
  // A trainer group (engine/model/parallel.h): this process is rank 0 and
  // starts the others (cli/trainer_group.h); group_rank > 0 is one of those.
  int tp = 1, ep = 1, group_rank = 0;
  std::string group_store;
  std::vector<std::string> command_line;  // `bench train ...`, for the other ranks
};

// Tenant s's tokens a step: --tokens-per-tenant, or with --tokens-spread P
// that many P percent more (s = 1 mod 3) or fewer (s = 2 mod 3), in whole
// datums where --datum-tokens is set: slots of unequal rows, as an RL pass's
// pieces are (their LoRA routing is then not an identity: architecture.md).
int TenantTokens(const TrainBenchOptions& o, int s) {
  if (o.tokens_spread <= 0 || s % 3 == 0) return o.tokens_per_tenant;
  const int sign = s % 3 == 1 ? 1 : -1;
  int tokens = o.tokens_per_tenant + sign * static_cast<int>(int64_t{o.tokens_per_tenant} * o.tokens_spread / 100);
  if (o.datum_tokens > 0)  // the nearest whole number of datums, at least one
    tokens = std::max(o.datum_tokens, (tokens + o.datum_tokens / 2) / o.datum_tokens * o.datum_tokens);
  return std::max(2, tokens);
}

// A tenant's step: `tokens` random tokens as datums of `datum_tokens` each
// (0: one datum), the last one shorter where they do not divide.
std::vector<Datum> TenantData(int tokens, int datum_tokens, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> tok(0, vocab - 1);
  const int per = datum_tokens > 0 ? datum_tokens : tokens;
  std::vector<Datum> data;
  for (int begin = 0; begin < tokens; begin += per) {
    Datum d;
    std::vector<int64_t> targets;
    for (int i = begin; i < std::min(tokens, begin + per); ++i) {
      d.tokens.push_back(static_cast<int32_t>(tok(rng)));
      targets.push_back(tok(rng));
    }
    d.loss_fn_inputs["target_tokens"] = engine::Array::Ints(targets);
    data.push_back(std::move(d));
  }
  return data;
}

struct StepTimes {
  double forward_backward = 0;  // seconds per step
  double optim_step = 0;
  int64_t peak_bytes = 0;  // the device allocator's peak over the timed steps
  double total() const { return forward_backward + optim_step; }
};

// Mean times of `steps` steps over the given slots (after `warmup` untimed ones).
Result<StepTimes> TimeSteps(engine::Engine& e, const std::vector<int>& slots,
                         const std::vector<std::vector<Datum>>& data, int warmup, int steps, double lr,
                         const std::string& trace_path) {
  std::vector<engine::ForwardBackwardCall> calls;
  std::vector<engine::OptimStepCall> optim;
  for (int s : slots) {
    engine::ForwardBackwardCall c;
    c.slot = s;
    c.data = data[s];
    calls.push_back(c);
    engine::AdamParams adam;
    adam.learning_rate = lr;
    optim.push_back({s, adam});
  }
  StepTimes t;
  for (int i = 1 - warmup; i <= steps; ++i) {
    if (i == 1) e.ResetPeakMemory();
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& r : e.ForwardBackward(calls))
      if (!r.ok()) return r.status();
    const auto t1 = std::chrono::steady_clock::now();
    for (auto& r : e.OptimStep(optim))
      if (!r.ok()) return r.status();
    const auto t2 = std::chrono::steady_clock::now();
    if (i <= 0) continue;  // warm-up
    if (!trace_path.empty() && i == steps) {
      // One more step, traced, after the timed ones (the trace's overhead stays out of the figures).
      if (Status st = StartTrace(); !st.ok()) return st;
      for (auto& r : e.ForwardBackward(calls))
        if (!r.ok()) return r.status();
      for (auto& r : e.OptimStep(optim))
        if (!r.ok()) return r.status();
      if (Status st = StopTrace(trace_path); !st.ok()) return st;
    }
    t.forward_backward += std::chrono::duration<double>(t1 - t0).count() / steps;
    t.optim_step += std::chrono::duration<double>(t2 - t1).count() / steps;
  }
  t.peak_bytes = e.Memory().peak_allocated;
  return t;
}

int BenchTrain(const TrainBenchOptions& o) {
  std::string model_dir = o.model_dir;
  std::string scratch;
  if (model_dir.empty()) {
    std::string templ = (fs::temp_directory_path() / "loom-bench-XXXXXX").string();
    if (!::mkdtemp(templ.data())) {
      std::fprintf(stderr, "loom bench train: cannot create a temp dir\n");
      return 1;
    }
    scratch = templ;
    model_dir = scratch + "/model";
    testmodel::MakeModelOptions mm;
    mm.arch = "qwen3";
    mm.preset = "tiny";
    mm.seed = 1;
    if (Status s = testmodel::MakeModel(mm, model_dir); !s.ok()) {
      std::fprintf(stderr, "loom bench train: %s\n", s.message().c_str());
      return 1;
    }
  }
  auto cleanup = [&] {
    std::error_code ec;
    if (!scratch.empty()) fs::remove_all(scratch, ec);
  };
  const int group_size = std::max(o.tp, o.ep);
  engine::EngineOptions eo;
  eo.tp_size = o.tp;
  eo.ep_size = o.ep;
  eo.group_rank = o.group_rank;
  eo.group_store = o.group_store;
  eo.model_dir = model_dir;
  eo.device = o.device;
  eo.max_slots = o.tenants;
  eo.max_rank = o.rank;
  eo.threads = o.threads;
  eo.lora_fp32 = o.lora_fp32;
  eo.lora_ragged = o.lora_order == "ragged";
  eo.recompute_layers = o.recompute_layers;
  eo.context_window = o.context_window;
  eo.graph_max_tokens = o.graph_tokens;
  eo.moments = o.moments;
  if (o.group_rank > 0) {  // one of rank 0's trainer ranks
    const int rc = RunTrainerRank(eo);
    cleanup();
    return rc;
  }
  std::unique_ptr<TrainerGroup> group;
  if (group_size > 1) {
    if (o.model_dir.empty()) {
      std::fprintf(stderr, "loom bench train: --tp/--ep: give --model (every rank reads the same directory)\n");
      cleanup();
      return 2;
    }
    eo.group_store = (fs::temp_directory_path() / ("loom-bench-group-" + std::to_string(::getpid()))).string();
    auto started = TrainerGroup::Start(group_size, o.command_line, eo.group_store);
    if (!started.ok()) {
      std::fprintf(stderr, "loom bench train: %s\n", started.status().message().c_str());
      cleanup();
      return 1;
    }
    group = std::move(*started);
  }
  auto opened = engine::Engine::Open(eo);
  if (!opened.ok()) {
    std::fprintf(stderr, "loom bench train: %s\n", opened.status().message().c_str());
    cleanup();
    return 1;
  }
  engine::Engine& e = **opened;
  const auto& info = e.info();
  std::vector<std::vector<Datum>> data;
  std::vector<int> all;
  int64_t packed_tokens = 0;
  for (int s = 0; s < o.tenants; ++s) {
    engine::LoraConfig c;
    c.rank = o.rank;
    c.alpha = o.rank;
    c.seed = static_cast<uint64_t>(s + 1);
    if (Status st = e.BindSlot(s, c); !st.ok()) {
      std::fprintf(stderr, "loom bench train: %s\n", st.message().c_str());
      cleanup();
      return 1;
    }
    const int tokens = TenantTokens(o, s);
    data.push_back(TenantData(tokens, o.datum_tokens, info.vocab_size, static_cast<uint32_t>(s + 7)));
    packed_tokens += tokens;
    all.push_back(s);
  }
  std::printf("model %s (%s, %lld layers, hidden %lld, vocab %lld) on %s/%s, LoRA rank %d, %d steps\n",
              model_dir.c_str(), info.model_type.c_str(), static_cast<long long>(info.num_layers),
              static_cast<long long>(info.hidden_size), static_cast<long long>(info.vocab_size), info.device.c_str(),
              info.dtype.c_str(), o.rank, o.steps);
  if (group_size > 1)
    std::printf("trainer group: %d processes (tp %d, ep %d); MFU is per device, peak memory rank 0's\n", group_size,
                o.tp, o.ep);
  std::printf("slots: %d at rank %d, %.1f MiB each on the %s", info.max_slots, info.max_rank,
              static_cast<double>(info.slot_bytes) / (1 << 20), info.device.c_str());
  if (info.moments_on_host)
    std::printf(" + %.1f MiB of AdamW moments on the host\n", static_cast<double>(info.slot_host_bytes) / (1 << 20));
  else
    std::printf(" (AdamW moments included)\n");
  if (const std::string plan = e.MemoryPlanReport(); !plan.empty())
    std::printf("memory plan: %s; at most %lld tokens per pass\n", plan.c_str(),
                static_cast<long long>(e.MaxPassTokens()));
  const auto trace = [&](const char* row) { return o.profile.empty() ? o.profile : o.profile + "." + row + ".json"; };
  auto one = TimeSteps(e, {0}, data, o.warmup, o.steps, o.lr, trace("one"));
  // One tenant: its packed pass is the alone one (a long sequence's step is minutes; not run twice).
  const bool alone_only = o.tenants == 1;
  auto packed = one.ok() && !alone_only ? TimeSteps(e, all, data, o.warmup, o.steps, o.lr, trace("packed")) : one;
  if (packed.ok() && !o.save_adapter.empty()) {
    // A trained (non-zero B) adapter for tools/reference/check_snapshot.py.
    if (Status st = e.SaveForSampler(0, o.save_adapter, model_dir); !st.ok()) {
      std::fprintf(stderr, "loom bench train: --save-adapter: %s\n", st.message().c_str());
      cleanup();
      return 1;
    }
    std::printf("saved tenant 0's adapter to %s\n", o.save_adapter.c_str());
  }
  cleanup();
  if (!packed.ok()) {
    std::fprintf(stderr, "loom bench train: %s\n", packed.status().message().c_str());
    return 1;
  }
  const double tps_one = o.tokens_per_tenant / one->total();
  const double tps_packed = static_cast<double>(packed_tokens) / packed->total();
  const bool gpu = info.device == "cuda";
  constexpr double kPeakFlops = 989e12;
  std::printf("%-20s %14s %14s %12s %12s%s\n", "per step", "fwd_bwd ms", "optim ms", "total ms", "tokens/s",
              gpu ? "      MFU   peak GiB" : "");
  const auto row = [&](const std::string& name, const StepTimes& t, double tps) {
    std::printf("%-20s %14.1f %14.1f %12.1f %12.0f", name.c_str(), t.forward_backward * 1e3, t.optim_step * 1e3,
                t.total() * 1e3, tps);
    if (gpu)
      std::printf(" %7.1f%% %10.2f",
                  100.0 * 4.0 * static_cast<double>(info.active_parameters) * tps / (kPeakFlops * group_size),
                  static_cast<double>(t.peak_bytes) / (1 << 30));
    std::printf("\n");
  };
  row("1 tenant", *one, tps_one);
  if (alone_only) {
    std::printf("(one tenant: no packed row; %d tokens per step)\n", o.tokens_per_tenant);
  } else {
    row(std::to_string(o.tenants) + " tenants packed", *packed, tps_packed);
    std::printf("packed / alone throughput ratio: %.2fx (%d tokens per tenant per step", tps_packed / tps_one,
                o.tokens_per_tenant);
    if (o.tokens_spread > 0)
      std::printf("; spread %d%%: %lld tokens packed, tenants of %d, %d and %d tokens", o.tokens_spread,
                  static_cast<long long>(packed_tokens), TenantTokens(o, 0), TenantTokens(o, 1), TenantTokens(o, 2));
    std::printf(")\n");
  }
  if (const auto g = e.TrainGraphStats(); g.passes > 0)
    std::printf("training graphs: %lld passes in the uniform layout, %lld replayed, %lld shapes captured, pool %.2f GiB\n",
                static_cast<long long>(g.passes), static_cast<long long>(g.replays),
                static_cast<long long>(g.captures), static_cast<double>(g.pool_bytes) / (1 << 30));
  return 0;
}

}  // namespace

int Bench(int argc, char** argv) {
  // `loom bench sample ...` has its own flags (cli/bench_sample.cpp), argv[0] = "sample".
  if (argc >= 2 && std::string(argv[1]) == "sample") return BenchSample(argc - 1, argv + 1);
  if (argc >= 2 && std::string(argv[1]) == "multi-tenant") return BenchMultiTenant(argc - 1, argv + 1);
  if (argc >= 2 && std::string(argv[1]) == "rl") return BenchRl(argc - 1, argv + 1);
  CLI::App app{"Benchmarks on the engine's own code paths", "loom bench"};
  app.require_subcommand(1);
  TrainBenchOptions t;
  CLI::App* train = app.add_subcommand("train", "tokens/s of one tenant alone vs N tenants packed in one call");
  train->add_option("--model", t.model_dir, "HF model dir (default: a tiny qwen3 generated into a temp dir)");
  train->add_option("--tenants", t.tenants, "tenants packed together")->default_val(t.tenants)->check(CLI::Range(1, 4096));
  train->add_option("--tokens-per-tenant", t.tokens_per_tenant, "tokens per tenant per step")
      ->default_val(t.tokens_per_tenant)
      ->check(CLI::Range(2, 1 << 20));
  train->add_option("--datum-tokens", t.datum_tokens,
                    "split each tenant's tokens into datums (sequences) of this many, as an RL group's "
                    "completions are; 0 = one datum")
      ->default_val(t.datum_tokens)->check(CLI::Range(0, 1 << 20));
  train->add_option("--tokens-spread", t.tokens_spread,
                    "percent: every third tenant from the second gets this many more tokens, from the third this "
                    "many fewer (whole datums with --datum-tokens), so the packed slots' rows differ; 0 = equal")
      ->default_val(t.tokens_spread)->check(CLI::Range(0, 99));
  train->add_option("--steps", t.steps, "timed steps, after the warm-up")->default_val(t.steps)->check(CLI::Range(1, 100000));
  train->add_option("--warmup", t.warmup,
                    "untimed steps of each row first (the default: a shape's first passes take the varlen flash "
                    "kernel, the next builds cuDNN's plan for it, as a loop of one shape does)")
      ->default_val(t.warmup)->check(CLI::Range(0, 1000));
  train->add_option("--rank", t.rank, "LoRA rank of every tenant")->default_val(t.rank)->check(CLI::Range(1, 1024));
  train->add_option("--threads", t.threads, "CPU threads (0 = all cores)")->default_val(t.threads);
  train->add_option("--device", t.device, "auto | cpu | cuda")->default_val(t.device);
  train->add_option("--lr", t.lr, "AdamW learning rate")->default_val(t.lr);
  train->add_flag("--lora-fp32", t.lora_fp32, "LoRA arithmetic in fp32 (as PEFT does) instead of the model dtype");
  train->add_option("--lora-order", t.lora_order,
                    "ragged | padded: on a GPU, tenants of unequal tokens run LoRA over their rows as they are, or "
                    "gathered into a padded order (for comparison)")
      ->default_val(t.lora_order)
      ->check(CLI::IsMember({"ragged", "padded"}));
  train->add_option("--recompute-layers", t.recompute_layers,
                    "decoder layers whose activations are recomputed in the backward (0 = keep all; -1 = the "
                    "fewest that fit, per pass, on a GPU)")
      ->default_val(t.recompute_layers)->check(CLI::Range(-1, 100000));
  train->add_option("--context-window", t.context_window,
                    "the longest sequence a datum may hold, as loom serve's flag (0 = the model config's "
                    "max_position_embeddings)")
      ->default_val(t.context_window)->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  train->add_option("--graph-tokens", t.graph_tokens,
                    "on a GPU, passes of at most this many tokens (padded: power-of-two lengths of at least 64 "
                    "and counts) run as CUDA graphs; 0 = never")
      ->default_val(t.graph_tokens)->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  train->add_option("--moments", t.moments,
                    "where the AdamW moments live: device, host (pinned, staged per optim_step) or auto (the host "
                    "only when the slots do not fit on the device otherwise)")
      ->default_val(t.moments)->check(CLI::IsMember({"auto", "device", "host"}));
  train->add_option("--profile", t.profile,
                    "after timing, trace one more step of each row (Kineto, libtorch 2.x) to PATH.one.json and "
                    "PATH.packed.json (bench/trace_summary.py reads them)");
  train->add_option("--save-adapter", t.save_adapter, "write tenant 0's trained adapter (PEFT) to this new directory");
  train->add_option("--tp", t.tp, "tensor parallel: the trainer split over this many processes, one per device")
      ->default_val(t.tp)->check(CLI::Range(1, 64));
  train->add_option("--ep", t.ep, "expert parallel: each MoE layer's experts split over this many processes")
      ->default_val(t.ep)->check(CLI::Range(1, 64));
  train->add_option("--group-rank", t.group_rank, "(internal) rank N >= 1 of the trainer group")->group("");
  train->add_option("--group-store", t.group_store, "(internal) the trainer group's rendezvous file")->group("");
  t.command_line.assign(argv, argv + argc);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (train->parsed()) return BenchTrain(t);
  std::fprintf(stderr, "loom bench: use 'train', 'multi-tenant', 'sample' or 'rl'\n");
  return 2;
}

}  // namespace loom::cli
