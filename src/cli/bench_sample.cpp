// `loom bench sample`: decode tokens/s of the sampler at batch 1 and batch
// 64 (by default), for the base model, for 1 adapter and for 8 distinct
// adapters, on the same Sampler the service runs. Each configuration runs
// once to warm up, then is timed; prompts are random, sampling is at
// temperature 1 with fixed seeds, and EOS is ignored by using a model whose
// EOS the sampler is not told about (--ignore-eos is implied: tokens/s
// counts what was generated). With --contention it runs bench_contention.h's
// two phases instead; with --multi-turn, bench_multiturn.h's conversation.
#include "cli/bench_sample.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <future>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cli/bench_contention.h"
#include "cli/bench_multiturn.h"
#include "cli/decode_flags.h"
#include "cli/step_flags.h"
#include "cli/trace_profile.h"
#include "engine/io/peft.h"
#include "engine/lora/slot_bank.h"
#include "engine/model/transformer.h"
#include "engine/sample/op_count.h"
#include "engine/sample_api.h"
#include "replica/remote_sampler.h"
#include "testmodel/make_model.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;
using engine::SampleCall;
using engine::SampleOutput;

struct Options {
  std::string model_dir;
  std::string preset = "tiny";  // generated when model_dir is empty
  std::string device = "auto";
  std::string dtype = "auto";
  std::vector<int> batches = {1, 64};
  std::vector<int> adapter_counts = {0, 1, 8};  // distinct adapters per run; 0 = the base model
  int prompt_len = 32;
  int new_tokens = 64;
  int rank = 16;
  int threads = 0;
  engine::DecodeOptions decode;
  engine::SamplerOptions steps;  // defaults with the step flags' limits applied (StepFlags); Run starts from it
  bool contention = false;  // --contention: bench_contention.h instead of the decode table
  ContentionOptions contended;
  bool multi_turn = false;  // --multi-turn: bench_multiturn.h instead of the decode table
  MultiTurnOptions turns;
  std::optional<double> logprob_tolerance;  // --multi-turn: unset = by dtype
  bool count_ops = false;  // --count-ops: the ATen ops of the prefill and decode steps (engine/sample/op_count.h)
  std::string profile;  // --profile PATH: Kineto traces, PATH.<row>.json (the modes' own names)
  // --replicas: the decode table on these sampler replicas (`loom serve --role
  // sampler` on the same model, each on its own device) through the
  // gateway's RemoteSampler, instead of a sampler in this process.
  std::vector<std::string> replicas;
};

// Writes n PEFT snapshots (rank r, random non-zero A and B) under dir.
Status MakeAdapters(const engine::Transformer& model, int n, int rank, const std::string& dir,
                    std::vector<std::string>* out) {
  engine::SlotBank bank(1, rank, at::kCPU, model.LoraTargets());
  for (int i = 0; i < n; ++i) {
    engine::LoraConfig c;
    c.rank = rank;
    c.alpha = 2.0 * rank;
    c.seed = 100 + i;
    if (Status s = bank.Bind(0, c); !s.ok()) return s;
    at::manual_seed(100 + i);
    {
      c10::NoGradGuard no_grad;
      for (auto& t : bank.targets())
        t.B.select(0, 0).narrow(-1, 0, rank).copy_(0.01 * at::randn(t.FactorShape(false, rank)));
    }
    const std::string d = dir + "/adapter" + std::to_string(i);
    if (Status s = engine::SavePeft(bank, 0, d, "bench"); !s.ok()) return s;
    out->push_back(d);
  }
  return Status::Ok();
}

struct Timing {
  double seconds = 0;
  int64_t tokens = 0;
  int64_t steps = 0;
  double prefill_seconds = 0, decode_seconds = 0;  // of the sampler's steps (SamplerStats)
  int64_t prefills = 0, fast_prefills = 0;
};

Result<Timing> RunBatch(engine::Sampler& s, int batch, const std::vector<std::string>& adapters, const Options& o,
                        uint32_t seed, int max_tokens) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(s.info().vocab_size) - 2);
  std::vector<std::future<Result<SampleOutput>>> futures;
  const engine::SamplerStats before = s.stats();
  const auto t0 = std::chrono::steady_clock::now();
  for (int b = 0; b < batch; ++b) {
    SampleCall c;
    for (int i = 0; i < o.prompt_len; ++i) c.prompt.push_back(tok(rng));
    c.adapter_dir = adapters.empty() ? "" : adapters[b % adapters.size()];
    c.params.max_tokens = max_tokens;
    c.params.temperature = 1.0;
    c.params.seed = seed + b;
    auto p = std::make_shared<std::promise<Result<SampleOutput>>>();
    futures.push_back(p->get_future());
    s.Submit(std::move(c), [p](Result<SampleOutput> r) { p->set_value(std::move(r)); });
  }
  Timing t;
  for (auto& f : futures) {
    Result<SampleOutput> r = f.get();
    if (!r.ok()) return r.status();
    for (const auto& seq : r->sequences) t.tokens += static_cast<int64_t>(seq.tokens.size());
  }
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Replicas report their counters with their health answers (every 500 ms).
  if (!o.replicas.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  const engine::SamplerStats after = s.stats();
  t.steps = after.decode_steps - before.decode_steps;
  t.prefill_seconds = after.prefill_seconds - before.prefill_seconds;
  t.decode_seconds = after.decode_seconds - before.decode_seconds;
  t.prefills = after.prefill_steps - before.prefill_steps;
  t.fast_prefills = after.fast_prefill_steps - before.fast_prefill_steps;
  return t;
}

// The bytes of base weights a batch-1 decode step reads: each tensor once
// (a tied lm_head is the embedding), one row of an untied embedding, and
// top-k of E of each expert tensor ([E, ...] with 3 dimensions); the floor
// issue 20 names ("the active weights' bytes").
double DecodeStepBytes(const engine::Transformer& model) {
  const std::vector<at::Tensor> weights = model.BaseWeights();  // the embedding, the final norm, the lm_head, ...
  const int64_t E = model.config().num_experts, k = model.config().num_experts_per_tok;
  std::set<const void*> seen;
  double bytes = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    if (!seen.insert(w.data_ptr()).second) continue;
    const double all = static_cast<double>(w.numel()) * static_cast<double>(w.element_size());
    const bool untied_embedding = i == 0 && weights.size() > 2 && weights[2].data_ptr() != w.data_ptr();
    if (untied_embedding)
      bytes += all / static_cast<double>(std::max<int64_t>(1, w.size(0)));
    else if (E > 0 && k > 0 && w.dim() == 3 && w.size(0) == E)
      bytes += all * static_cast<double>(k) / static_cast<double>(E);
    else
      bytes += all;
  }
  return bytes;
}

int Run(const Options& o) {
  if (o.threads > 0) at::set_num_threads(o.threads);
  std::string scratch;
  {
    std::string templ = (fs::temp_directory_path() / "loom-bench-sample-XXXXXX").string();
    if (!::mkdtemp(templ.data())) return std::fprintf(stderr, "loom bench sample: no temp dir\n"), 1;
    scratch = templ;
  }
  std::string model_dir = o.model_dir;
  if (model_dir.empty()) {
    model_dir = scratch + "/model";
    testmodel::MakeModelOptions m;
    m.preset = o.preset;
    if (Status s = testmodel::MakeModel(m, model_dir); !s.ok())
      return std::fprintf(stderr, "loom bench sample: %s\n", s.message().c_str()), 1;
  }
  // With replicas the model here gives the bench adapters their shapes only.
  const bool cuda = o.replicas.empty() && (o.device == "cuda" || (o.device == "auto" && at::hasCUDA()));
  const at::Device device = cuda ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  const bool bf16 = o.dtype == "bf16" || (o.dtype == "auto" && cuda);
  auto loaded = engine::Transformer::Load(model_dir, device, bf16 ? at::kBFloat16 : at::kFloat);
  if (!loaded.ok()) return std::fprintf(stderr, "loom bench sample: %s\n", loaded.status().message().c_str()), 1;
  std::shared_ptr<const engine::Transformer> model(std::move(loaded.value()));
  // Eight adapters (the contention and multi-turn modes' tenants), or as many as the widest run names.
  int adapter_total = 8;
  for (int n : o.adapter_counts) adapter_total = std::max(adapter_total, n);
  std::vector<std::string> adapters;
  if (Status s = MakeAdapters(*model, adapter_total, o.rank, scratch, &adapters); !s.ok())
    return std::fprintf(stderr, "loom bench sample: %s\n", s.message().c_str()), 1;

  int64_t weight_bytes = 0;
  for (const at::Tensor& w : model->BaseWeights()) weight_bytes += w.numel() * w.element_size();
  const double step_bytes = DecodeStepBytes(*model);
  int max_batch = 1;
  for (int b : o.batches) max_batch = std::max(max_batch, b);
  engine::SamplerOptions so = o.steps;  // the step flags' limits; the rest set here
  so.sampler_adapters = adapter_total;
  so.max_rank = o.rank;
  so.max_batch_rows = max_batch;
  so.kv_budget_tokens = static_cast<int64_t>(max_batch) * (o.prompt_len + o.new_tokens + 32);
  so.context_window = o.prompt_len + o.new_tokens + 16;
  if (o.contention) {  // `loom serve`'s sampler defaults, with room for the flood's prompts
    const ContentionOptions& c = o.contended;
    so.max_batch_rows = engine::SamplerOptions{}.max_batch_rows;
    so.kv_budget_tokens = 0;
    so.context_window = std::max(c.flood_prompt + c.flood_tokens, c.light_prompt + c.light_tokens) + 16;
  }
  so.threads = o.threads;
  so.admission_window = std::chrono::milliseconds(2);  // as `loom serve`: a batch's requests share one prefill
  so.decode = o.decode;
  if (o.multi_turn) {  // room for one conversation in each of the two samplers
    so.max_batch_rows = 1;
    so.context_window = MultiTurnContext(o.turns) + 16;
    so.kv_budget_tokens = so.context_window + 64;
  }
  Result<std::unique_ptr<engine::Sampler>> sampler = Status::Internal("no sampler");
  if (o.replicas.empty()) {
    sampler = engine::Sampler::Open(model, so);  // model_dir unset: no EOS from generation_config
  } else {
    if (o.contention || o.multi_turn)
      return std::fprintf(stderr, "loom bench sample: --replicas runs the decode table only\n"), 2;
    replica::RemoteOptions ro;
    ro.replicas = o.replicas;
    auto remote = replica::RemoteSampler::Open(ro);
    if (remote.ok()) {
      sampler = std::unique_ptr<engine::Sampler>(std::move(*remote));
      std::printf("sampling on %zu replicas: %s\n", o.replicas.size(), [&] {
        std::string all;
        for (const auto& r : o.replicas) all += (all.empty() ? "" : ",") + r;
        return all;
      }().c_str());
    } else {
      sampler = remote.status();
    }
  }
  if (!sampler.ok()) return std::fprintf(stderr, "loom bench sample: %s\n", sampler.status().message().c_str()), 1;
  engine::Sampler& s = **sampler;
  if (o.contention || o.multi_turn) {
    std::printf("model %s  device %s  dtype %s\n", o.model_dir.empty() ? (o.preset + " (generated)").c_str() : o.model_dir.c_str(),
                cuda ? "cuda" : "cpu", bf16 ? "bf16" : "fp32");
    int rc;
    if (o.multi_turn) {
      so.prefix_cache = false;
      auto uncached = engine::Sampler::Open(model, so);
      if (!uncached.ok())
        return std::fprintf(stderr, "loom bench sample: %s\n", uncached.status().message().c_str()), 1;
      MultiTurnOptions turns = o.turns;
      turns.logprob_tolerance = o.logprob_tolerance.value_or(bf16 ? 0.1 : 1e-3);
      turns.profile = o.profile;
      turns.count_ops = o.count_ops;
      rc = RunMultiTurn(s, **uncached, o.adapter_counts.back() > 0 ? adapters[0] : "", turns);
    } else {
      ContentionOptions contended = o.contended;
      contended.profile = o.profile;
      rc = RunContention(s, contended);
    }
    sampler->reset();
    std::error_code ec;
    fs::remove_all(scratch, ec);
    return rc;
  }

  std::printf("model %s  device %s  dtype %s  weights %.1f MB  prompt %d  new tokens %d  rank %d\n",
              o.model_dir.empty() ? (o.preset + " (generated)").c_str() : o.model_dir.c_str(), cuda ? "cuda" : "cpu",
              bf16 ? "bf16" : "fp32", weight_bytes / 1e6, o.prompt_len, o.new_tokens, o.rank);
  if (cuda)
    std::printf("memory floor per decode step at 4.3 TB/s: %.3f ms for all weights; %.3f ms for what a batch-1 step "
                "reads (%.1f MB: each tensor once, one row of the embedding, top-k of the experts)\n",
                weight_bytes / 4.3e12 * 1e3, step_bytes / 4.3e12 * 1e3, step_bytes / 1e6);
  // tokens/s and ms/step: wall time over decode steps, the prompts'
  // prefill included; decode ms: one decode step alone (sampling included);
  // decode tok/s: the tokens of decode steps (each sequence's first token
  // comes from its prefill) over their time; prefill ms: the run's prefill
  // steps together (prefills: how many; on graphs: how many of them ran on
  // the decode graphs, --fast-prefill). vs base: tokens/s, decode tok/s,
  // then prefill time, against the base model's at the same batch.
  std::printf("%-10s %6s %12s %10s %10s %13s %11s %9s %9s %9s %9s %9s\n", "adapters", "batch", "tokens/s", "ms/step",
              "decode ms", "decode tok/s", "prefill ms", "prefills", "on graphs", "vs base", "decode", "prefill");
  for (int batch : o.batches) {
    double base_tps = 0, base_decode = 0, base_prefill = 0;
    for (int n : o.adapter_counts) {
      std::vector<std::string> use(adapters.begin(), adapters.begin() + n);
      if (auto warm = RunBatch(s, batch, use, o, 7, o.new_tokens); !warm.ok())
        return std::fprintf(stderr, "loom bench sample: %s\n", warm.status().message().c_str()), 1;
      auto t = RunBatch(s, batch, use, o, 1000, o.new_tokens);
      if (!t.ok()) return std::fprintf(stderr, "loom bench sample: %s\n", t.status().message().c_str()), 1;
      const double tps = t->tokens / t->seconds;
      const int64_t decode_tokens = std::max<int64_t>(0, t->tokens - batch);
      const double decode_tps = t->decode_seconds > 0 ? decode_tokens / t->decode_seconds : 0.0;
      if (n == 0) base_tps = tps, base_decode = decode_tps, base_prefill = t->prefill_seconds;
      std::printf("%-10s %6d %12.1f %10.3f %10.3f %13.1f %11.1f %9lld %9lld %8.2fx %8.2fx %8.2fx\n",
                  n == 0 ? "base" : std::to_string(n).c_str(), batch, tps,
                  t->steps > 0 ? t->seconds * 1e3 / t->steps : 0.0,
                  t->steps > 0 ? t->decode_seconds * 1e3 / t->steps : 0.0, decode_tps, t->prefill_seconds * 1e3,
                  static_cast<long long>(t->prefills), static_cast<long long>(t->fast_prefills),
                  base_tps > 0 ? tps / base_tps : 0.0, base_decode > 0 ? decode_tps / base_decode : 0.0,
                  base_prefill > 0 ? t->prefill_seconds / base_prefill : 0.0);
      std::fflush(stdout);
      // The extra runs below take prompts of their own (another seed): the
      // timed run's would be prefix-cache hits, a different prefill.
      if (!o.profile.empty()) {  // one more run, traced (the trace's overhead stays out of the row)
        const std::string path = o.profile + "." + (n == 0 ? "base" : "a" + std::to_string(n)) + ".b" +
                                 std::to_string(batch) + ".json";
        Status st = StartTrace();
        if (st.ok()) st = RunBatch(s, batch, use, o, 2000, o.new_tokens).status();
        if (st.ok()) st = StopTrace(path);
        if (!st.ok()) return std::fprintf(stderr, "loom bench sample: %s\n", st.message().c_str()), 1;
        std::printf("%-10s traced to %s\n", "", path.c_str());
      }
      if (o.count_ops) {  // more runs, counted (the counting's overhead stays out of the row)
        const std::pair<const char*, const char*> scopes[] = {{engine::sample::kPrefillScope, "prefill"},
                                                              {engine::sample::kDecodeScope, "decode"}};
        for (const auto& [scope, what] : scopes) {  // one run per scope: one OpCount at a time
          engine::sample::OpCount counter(scope);
          if (auto c = RunBatch(s, batch, use, o, 3000, o.new_tokens); !c.ok())
            return std::fprintf(stderr, "loom bench sample: %s\n", c.status().message().c_str()), 1;
          const engine::sample::OpCounts ops = counter.Take();
          std::printf("%-10s ops of the %s: %lld calls (%lld with nested) in %lld steps\n%-10s %s\n", "", what,
                      static_cast<long long>(ops.calls), static_cast<long long>(ops.ops),
                      static_cast<long long>(ops.scopes), "", ops.Top(12).c_str());
        }
      }
    }
  }
  std::error_code ec;
  fs::remove_all(scratch, ec);
  return 0;
}

}  // namespace

int BenchSample(int argc, char** argv) {
  CLI::App app{"Decode tokens/s of the sampler: base, 1 adapter, 8 distinct adapters", "loom bench sample"};
  Options o;
  app.add_option("--model", o.model_dir, "model directory (default: a generated tiny model)");
  app.add_option("--preset", o.preset, "make-model preset generated when --model is absent")->default_val(o.preset);
  app.add_option("--device", o.device, "auto | cpu | cuda")->default_val(o.device);
  app.add_option("--dtype", o.dtype, "auto | bf16 | fp32")->default_val(o.dtype);
  app.add_option("--batch", o.batches, "decode batch sizes (default: 1 64)");
  app.add_option("--adapters", o.adapter_counts, "distinct adapters per run, 0 = base (default: 0 1 8)")
      ->check(CLI::Range(0, 64));
  app.add_option("--prompt-len", o.prompt_len, "prompt tokens per row")->default_val(o.prompt_len);
  app.add_option("--new-tokens", o.new_tokens, "tokens generated per row")->default_val(o.new_tokens);
  app.add_option("--rank", o.rank, "LoRA rank of the bench adapters")->default_val(o.rank);
  app.add_option("--threads", o.threads, "CPU threads (0 = libtorch default)")->default_val(o.threads);
  app.add_option("--replicas", o.replicas, "HOST:PORT of sampler replicas (`loom serve --role sampler` on the same --model): the decode table runs on them through the gateway's router, tokens/s summed over them")->delimiter(',');
  const StepFlags step_flags(app);
  app.add_flag("--contention", o.contention,
               "instead: a light tenant's latency on an idle sampler and beside another tenant's flood");
  ContentionOptions& c = o.contended;
  app.add_option("--light-requests", c.light_requests, "--contention: light requests timed per phase")
      ->default_val(c.light_requests)->check(CLI::Range(1, 100000));
  app.add_option("--light-prompt", c.light_prompt, "--contention: light prompt tokens")->default_val(c.light_prompt)->check(CLI::Range(1, 1 << 20));
  app.add_option("--light-tokens", c.light_tokens, "--contention: light new tokens")->default_val(c.light_tokens)->check(CLI::Range(1, 1 << 20));
  app.add_option("--flood-depth", c.flood_depth, "--contention: flood requests kept queued")->default_val(c.flood_depth)->check(CLI::Range(1, 100000));
  app.add_option("--flood-prompt", c.flood_prompt, "--contention: flood prompt tokens")->default_val(c.flood_prompt)->check(CLI::Range(1, 1 << 20));
  app.add_option("--flood-tokens", c.flood_tokens, "--contention: flood new tokens")->default_val(c.flood_tokens)->check(CLI::Range(1, 1 << 20));
  app.add_flag("--arrival-order", c.arrival_order,
               "--contention: both tenants in one flow (arrival order, the yardstick for fair share)");
  app.add_flag("--multi-turn", o.multi_turn,
               "instead: a conversation's prefill time per turn with the prefix cache on and off (the last "
               "--adapters count > 0: with an adapter)");
  MultiTurnOptions& t = o.turns;
  app.add_option("--turns", t.turns, "--multi-turn: turns")->default_val(t.turns)->check(CLI::Range(1, 1000));
  app.add_option("--history-tokens", t.history_tokens, "--multi-turn: tokens of earlier conversation before turn 0")
      ->default_val(t.history_tokens)
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--logprob-tolerance", o.logprob_tolerance,
                 "--multi-turn: largest |logprob| difference of a turn's first token, cache on vs off (default: "
                 "0.1 in bf16, 1e-3 in fp32)");
  app.add_option("--user-tokens", t.user_tokens, "--multi-turn: new user tokens per turn")->default_val(t.user_tokens)->check(CLI::Range(1, 1 << 20));
  app.add_option("--reply-tokens", t.reply_tokens, "--multi-turn: reply tokens per turn")->default_val(t.reply_tokens)->check(CLI::Range(1, 1 << 20));
  app.add_flag("--count-ops", o.count_ops,
               "count the ATen ops of the steps (any build): two more runs of each decode row (its prefill steps, "
               "then its decode steps), or each --multi-turn turn's prefill (then with the counting's overhead in "
               "its figures)");
  app.add_option("--profile", o.profile,
                 "Kineto traces (libtorch 2.x) for bench/trace_summary.py: the decode table traces one more run "
                 "of each row to PATH.<base|aN>.b<batch>.json; --multi-turn traces every turn, "
                 "PATH.turn<k>.on.json / .off.json (those turns' figures include the tracing); --contention "
                 "traces the phase beside the flood, PATH.contended.json");
  const DecodeFlags decode_flags(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  o.decode = decode_flags.options();
  step_flags.Apply(&o.steps);
  return Run(o);
}

}  // namespace loom::cli
