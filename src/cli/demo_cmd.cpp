// `loom demo`: the README's main job. Starts the service in-process on the
// embedded tiny model and runs N tenants at once, each fine-tuning its own
// LoRA adapter on its own task through the scheduler:
//   tenants 0..N-2  memorise a different token sequence (cross_entropy)
//   tenant N-1      RL-flavoured: importance_sampling on its own sequence with
//                   advantage +1 and on-policy sampling logprobs (forward first)
// A live table shows each tenant's step, loss per token, mean p(target),
// tokens/s and mean queue wait (from /metrics' counters). At the end each
// adapter is compared with the base model on its own sequence: the greedy
// continuation (asample, temperature 0) of its first 4 tokens from the
// adapter and from the base, and the mean next-token probability.
#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <unistd.h>

#include "cli/commands.h"
#include "cli/service_driver.h"
#include "common/log.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Progress {
  int step = 0;
  double loss_per_token = NAN;
  double p_target = NAN;  // mean probability of the target tokens in the last step
  double tokens_per_s = 0;
  std::string error;
  bool done = false;
};

std::vector<int32_t> TaskSequence(int tenant, int length, int64_t vocab) {
  std::mt19937 rng(7919u * static_cast<uint32_t>(tenant + 1));
  std::uniform_int_distribution<int64_t> tok(0, vocab - 1);
  std::vector<int32_t> seq;
  for (int i = 0; i < length; ++i) seq.push_back(static_cast<int32_t>(tok(rng)));
  return seq;
}

// Next-token datum over seq: input seq[0..n-2], targets seq[1..n-1].
engine::Datum NextTokenDatum(const std::vector<int32_t>& seq) {
  engine::Datum d;
  d.tokens.assign(seq.begin(), seq.end() - 1);
  std::vector<int64_t> targets(seq.begin() + 1, seq.end());
  d.loss_fn_inputs["target_tokens"] = engine::Array::Ints(targets);
  return d;
}

// Target-token logprobs of seq under the tenant's adapter (forward only).
Result<std::vector<float>> TargetLogprobs(ServiceDriver& d, Tenant& t, const std::vector<int32_t>& seq) {
  engine::ForwardBackwardCall call;
  call.forward_only = true;
  call.data.push_back(NextTokenDatum(seq));
  auto id = d.SubmitForwardBackward(t, std::move(call));
  if (!id.ok()) return id.status();
  auto view = d.Await(t, *id);
  if (!view.ok()) return view.status();
  return view->result->forward_backward->outputs.at(0).at("logprobs").f32;
}

Status TrainTenant(ServiceDriver& d, Tenant& t, const std::vector<int32_t>& seq, bool rl, int steps, double lr,
                   Progress& progress, std::mutex& mu) {
  engine::AdamParams adam;
  adam.learning_rate = lr;
  const int64_t tokens = static_cast<int64_t>(seq.size()) - 1;
  for (int s = 1; s <= steps; ++s) {
    const auto t0 = Clock::now();
    engine::ForwardBackwardCall call;
    engine::Datum datum = NextTokenDatum(seq);
    if (rl) {
      auto lp = TargetLogprobs(d, t, seq);  // the "policy" that produced these tokens: on-policy ratio 1
      if (!lp.ok()) return lp.status();
      datum.loss_fn_inputs["logprobs"] = engine::Array::Floats(*lp);
      datum.loss_fn_inputs["advantages"] = engine::Array::Floats(std::vector<float>(tokens, 1.0f));
      call.loss_fn = "importance_sampling";
    }
    call.data.push_back(std::move(datum));
    auto fb = d.SubmitForwardBackward(t, std::move(call));
    if (!fb.ok()) return fb.status();
    auto op = d.SubmitOptimStep(t, adam);
    if (!op.ok()) return op.status();
    auto fb_view = d.Await(t, *fb);
    if (!fb_view.ok()) return fb_view.status();
    if (auto r = d.Await(t, *op); !r.ok()) return r.status();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    std::lock_guard<std::mutex> lock(mu);
    progress.step = s;
    progress.loss_per_token = fb_view->result->forward_backward->metrics.at("loss:sum") / static_cast<double>(tokens);
    progress.tokens_per_s = static_cast<double>(tokens * (rl ? 2 : 1)) / seconds;
    double p = 0;
    const auto& lp = fb_view->result->forward_backward->outputs.at(0).at("logprobs").f32;
    for (float v : lp) p += std::exp(v) / static_cast<double>(lp.size());
    progress.p_target = p;
  }
  return Status::Ok();
}

// Mean queue wait (ms) per model from the /metrics exposition.
std::map<std::string, double> MeanWaitMs(const std::string& text) {
  std::map<std::string, double> sum, count, out;
  static const std::regex re(R"re(loom_queue_wait_seconds_(sum|count)\{model_id="([^"]+)"\} ([0-9.eE+-]+))re");
  for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) {
    ((*it)[1] == "sum" ? sum : count)[(*it)[2]] = std::stod((*it)[3]);
  }
  for (auto& [m, n] : count) out[m] = n > 0 ? 1000.0 * sum[m] / n : 0.0;
  return out;
}

}  // namespace

int Demo(int argc, char** argv) {
  CLI::App app{"N tenants fine-tune their own adapters at once on the embedded tiny model", "loom demo"};
  int tenants = 4, steps = 60, length = 17, threads = 0;
  double lr = 1e-2;
  std::string model_dir;
  app.add_option("--tenants", tenants, "concurrent tenants (the last one uses importance_sampling)")->default_val(tenants)->check(CLI::Range(1, 64));
  app.add_option("--steps", steps, "training steps per tenant")->default_val(steps)->check(CLI::Range(1, 100000));
  app.add_option("--length", length, "tokens in each tenant's sequence")->default_val(length)->check(CLI::Range(3, 4096));
  app.add_option("--lr", lr, "AdamW learning rate")->default_val(lr);
  app.add_option("--threads", threads, "CPU threads (0 = all cores)")->default_val(threads);
  app.add_option("--model", model_dir, "HF model dir (default: the embedded tiny qwen3)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const auto start = Clock::now();
  log::SetLevel(log::Level::kWarn);  // the table is the output; pass logs would drown it
  const std::string data_dir = (fs::temp_directory_path() / ("loom-demo-" + std::to_string(::getpid()))).string();
  DriverOptions opt;
  opt.model_dir = model_dir;
  opt.data_dir = data_dir;
  opt.max_slots = tenants + 1;  // + the base-model reference (an untrained adapter: B = 0)
  opt.max_rank = 16;
  opt.threads = threads;
  opt.with_sampler = true;
  auto driver = ServiceDriver::Open(opt);
  if (!driver.ok()) {
    std::fprintf(stderr, "loom demo: %s\n", driver.status().message().c_str());
    return 2;
  }
  ServiceDriver& d = **driver;
  const auto& info = d.info();
  std::printf("loom demo: service in-process on %s (%s, %s, %lld layers), %d tenants x %d steps, %d-token tasks\n",
              info.model_type.c_str(), info.device.c_str(), info.dtype.c_str(),
              static_cast<long long>(info.num_layers), tenants, steps, length);

  std::vector<Tenant> ts;
  std::vector<std::vector<int32_t>> seqs;
  for (int i = 0; i < tenants; ++i) {
    auto t = d.NewTenant("tenant-" + std::to_string(i), 16, 100 + i);
    if (!t.ok()) {
      std::fprintf(stderr, "loom demo: create_model: %s\n", t.status().message().c_str());
      return 2;
    }
    ts.push_back(*t);
    seqs.push_back(TaskSequence(i, length, info.vocab_size));
  }
  auto base = d.NewTenant("base-reference", 16, 1);
  if (!base.ok()) {
    std::fprintf(stderr, "loom demo: create_model: %s\n", base.status().message().c_str());
    return 2;
  }

  std::vector<Progress> progress(tenants);
  std::mutex mu;
  std::vector<std::thread> workers;
  for (int i = 0; i < tenants; ++i) {
    workers.emplace_back([&, i] {
      const bool rl = tenants > 1 && i == tenants - 1;
      Status st = TrainTenant(d, ts[i], seqs[i], rl, steps, lr, progress[i], mu);
      std::lock_guard<std::mutex> lock(mu);
      if (!st.ok()) progress[i].error = st.message();
      progress[i].done = true;
    });
  }
  auto print_table = [&] {
    auto waits = MeanWaitMs(d.service().MetricsText());
    std::lock_guard<std::mutex> lock(mu);
    std::printf("  %-9s %-20s %6s %11s %10s %10s %11s\n", "tenant", "task", "step", "loss/token", "p(target)",
                "tokens/s", "queue wait");
    for (int i = 0; i < tenants; ++i) {
      const Progress& p = progress[i];
      const bool rl = tenants > 1 && i == tenants - 1;
      std::printf("  %-9s %-20s %6d %11.4f %10.4f %10.1f %9.1fms%s\n", ts[i].name.c_str(),
                  rl ? "importance_sampling" : "memorise (CE)", p.step, p.loss_per_token, p.p_target, p.tokens_per_s,
                  waits.count(ts[i].model_id) ? waits[ts[i].model_id] : 0.0,
                  p.error.empty() ? "" : ("  ERROR " + p.error).c_str());
    }
    std::fflush(stdout);
  };
  while (true) {
    bool all_done = true;
    for (int k = 0; k < 10; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::lock_guard<std::mutex> lock(mu);
      all_done = true;
      for (const Progress& p : progress) all_done = all_done && p.done;
      if (all_done) break;
    }
    std::printf("[%5.1fs]\n", std::chrono::duration<double>(Clock::now() - start).count());
    print_table();
    if (all_done) break;
  }
  for (auto& w : workers) w.join();

  std::printf("\nGreedy continuation (asample, temperature 0) of each task's first 4 tokens, own adapter vs base:\n");
  auto ids = [](const std::vector<int32_t>& v, size_t from) {
    std::string out;
    for (size_t i = from; i < v.size(); ++i) out += (out.empty() ? "" : " ") + std::to_string(v[i]);
    return out;
  };
  auto matches = [](const std::vector<int32_t>& got, const std::vector<int32_t>& seq, size_t from) {
    size_t n = 0;
    for (size_t i = 0; i < got.size() && from + i < seq.size(); ++i) n += got[i] == seq[from + i];
    return n;
  };
  int failures = 0;
  const size_t prompt_len = 4;
  for (int i = 0; i < tenants; ++i) {
    if (!progress[i].error.empty()) ++failures;
    const std::vector<int32_t> prompt(seqs[i].begin(), seqs[i].begin() + prompt_len);
    const int want = static_cast<int>(seqs[i].size() - prompt_len);
    auto own = d.Greedy(ts[i], prompt, want, "demo-final");
    auto ref = d.Greedy(*base, prompt, want, "");
    auto own_lp = TargetLogprobs(d, ts[i], seqs[i]);
    auto ref_lp = TargetLogprobs(d, *base, seqs[i]);
    if (!own.ok() || !ref.ok() || !own_lp.ok() || !ref_lp.ok()) {
      Status st = !own.ok() ? own.status() : !ref.ok() ? ref.status() : !own_lp.ok() ? own_lp.status() : ref_lp.status();
      std::printf("  %s: %s\n", ts[i].name.c_str(), st.message().c_str());
      ++failures;
      continue;
    }
    auto mean_p = [](const std::vector<float>& lp) {
      double p = 0;
      for (float v : lp) p += std::exp(v) / static_cast<double>(lp.size());
      return p;
    };
    std::printf("  %s (%s)\n", ts[i].name.c_str(), tenants > 1 && i == tenants - 1 ? "importance_sampling" : "cross_entropy");
    std::printf("    prompt     %s\n", ids(prompt, 0).c_str());
    std::printf("    task       %s\n", ids(seqs[i], prompt_len).c_str());
    std::printf("    adapter    %s   (%zu/%d tokens right, mean p(target) %.3f)\n", ids(*own, 0).c_str(),
                matches(*own, seqs[i], prompt_len), want, mean_p(*own_lp));
    std::printf("    base       %s   (%zu/%d tokens right, mean p(target) %.4f)\n", ids(*ref, 0).c_str(),
                matches(*ref, seqs[i], prompt_len), want, mean_p(*ref_lp));
  }
  const std::string metrics = d.service().MetricsText();
  std::printf("\nscheduler (/metrics):");
  for (const char* series : {"loom_passes_total", "loom_batch_fill_ratio_mean", "loom_training_tokens_total"}) {
    std::regex re(std::string("\n(") + series + R"re((\{[^}]*\})? [0-9.eE+-]+))re");
    for (std::sregex_iterator it(metrics.begin(), metrics.end(), re), e; it != e; ++it) {
      std::printf(" %s", (*it)[1].str().c_str());
    }
  }
  std::printf("\n");
  driver->reset();
  std::error_code ec;
  fs::remove_all(data_dir, ec);
  std::printf("loom demo: done in %.1f s\n", std::chrono::duration<double>(Clock::now() - start).count());
  return failures == 0 ? 0 : 1;
}

}  // namespace loom::cli
