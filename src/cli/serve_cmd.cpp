// `loom serve`: the Tinker-compatible service. Opens one engine and sampler
// per base model (--model, repeatable as NAME=DIR), the registry in --data-dir, and serves HTTP until SIGTERM/SIGINT; then it
// stops accepting, lets the batch in flight finish (queued requests fail
// cleanly with "shutting down"), answers every request it has read (503
// "shutting down" for those read after the signal), and exits 0.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <pthread.h>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/decode_flags.h"
#include "cli/serve_replica.h"
#include "cli/trainer_group.h"
#include "cli/slot_plan.h"
#include "cli/step_flags.h"
#include "service/pass_room.h"
#include "common/log.h"
#include "engine/api.h"
#include "engine/sample_api.h"
#include "http/auth.h"
#include "http/router.h"
#include "http/server.h"
#include "replica/remote_sampler.h"
#include "replica/replica_handler.h"
#include "service/service.h"
#include "store/registry.h"
#include "testmodel/make_model.h"
#include "wire/proto_log.h"

namespace loom::cli {

namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "loom serve: %s\n", message.c_str());
  return 2;
}

// The embedded default: a tiny qwen3 written once into the data dir (same
// seed, same bytes on every machine).
Result<std::string> DefaultModel(const std::string& data_dir) {
  const std::string dir = data_dir + "/default-model";
  if (std::filesystem::exists(dir + "/config.json")) return dir;
  testmodel::MakeModelOptions opt;
  opt.arch = "qwen3";
  opt.preset = "tiny";
  opt.seed = 1;
  const std::string tmp = data_dir + "/default-model.tmp";
  std::error_code ec;
  std::filesystem::remove_all(tmp, ec);
  if (Status st = testmodel::MakeModel(opt, tmp); !st.ok()) return st;
  std::filesystem::rename(tmp, dir, ec);
  if (ec) return Status::Internal("cannot move the default model into " + dir + ": " + ec.message());
  return dir;
}

struct ModelDir {
  std::string name;
  std::string dir;
};

// --model values: one DIR, named by --model-name (or its folder's name), or
// NAME=DIR once per base model.
Result<std::vector<ModelDir>> ParseModels(const std::vector<std::string>& values, const std::string& model_name) {
  std::vector<ModelDir> out;
  if (values.size() == 1 && values[0].find('=') == std::string::npos) {
    out.push_back({model_name.empty() ? std::filesystem::path(values[0]).filename().string() : model_name, values[0]});
    return out;
  }
  if (!model_name.empty()) {
    return Status::Invalid("--model-name: names the one --model DIR; with --model NAME=DIR each model is named there");
  }
  for (const std::string& value : values) {
    const size_t eq = value.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == value.size()) {
      return Status::Invalid("--model '" + value + "': with several models each must be NAME=DIR");
    }
    ModelDir m{value.substr(0, eq), value.substr(eq + 1)};
    for (const ModelDir& other : out) {
      if (other.name == m.name) return Status::Invalid("--model: the name '" + m.name + "' is given twice");
    }
    out.push_back(std::move(m));
  }
  return out;
}

// A base model opened for serving: its engine, sampler and tokens per pass.
struct OpenedModel {
  std::string name;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<engine::Sampler> sampler;
  int64_t token_budget = 0;
};

}  // namespace

int Serve(int argc, char** argv) {
  const std::vector<std::string> command_line(argv, argv + argc);  // a trainer group's ranks run it again
  CLI::App app{"Serve the Tinker API (default model: an embedded tiny qwen3)", "loom serve"};
  std::vector<std::string> model_dirs;
  std::string model_name, host = "127.0.0.1", data_dir = "loom-data", device = "auto", api_keys_file;
  int port = 8080, max_adapters = 0, max_rank = 0, io_threads = 2;
  int decode_threads = 2, decode_queue = 16, max_connections = 1024;
  std::string admin_key;
  double lora_alpha = 32.0, session_ttl = 300, seq_gap_timeout = 120, poll_hold = 30, capacity_wait = 600;
  size_t max_body_bytes = size_t{512} << 20;
  int sampler_adapters = 0, sample_queue = 256, publish_threads = service::ServiceOptions{}.publish_threads;
  int64_t kv_budget_tokens = 0, context_window = 0;
  int max_batch_rows = engine::SamplerOptions{}.max_batch_rows;
  app.add_option("--model", model_dirs, "model directory in Hugging Face layout (default: embedded tiny qwen3); or NAME=DIR, once per base model to serve several (each with its own adapter slots, sampler and share of the memory)");
  app.add_option("--model-name", model_name, "the base_model name clients use for the one --model DIR (default: loom/tiny-qwen3 or the dir name)");
  app.add_option("--host", host, "address to bind")->default_val(host);
  app.add_option("--port", port, "port to bind (0 = any free port)")->default_val(port)->check(CLI::Range(0, 65535));
  app.add_option("--data-dir", data_dir, "registry, checkpoints and the default model live here")->default_val(data_dir);
  app.add_option("--device", device, "auto | cpu | cuda | cuda:N (one GPU of several: a sampler replica's; a trainer group's rank r takes cuda:r)")->default_val(device)->check(CLI::IsMember({"auto", "cpu", "cuda"}) | CLI::Validator([](std::string& v) { return v.rfind("cuda:", 0) == 0 && v.size() > 5 && v.find_first_not_of("0123456789", 5) == std::string::npos ? std::string() : std::string("not cuda:N"); }, "cuda:N"));
  app.add_option("--max-adapters", max_adapters, "adapter slots (concurrent training clients); 0 = as many at --max-rank as fit in 40% of the memory (half of what slots may take, 80% of the device memory beside the base weights), at most 32 (logged at start-up)")->default_val(max_adapters)->check(CLI::Range(0, 4096));
  app.add_option("--max-rank", max_rank, "largest LoRA rank a client may ask for; 0 = 128 for dense models, 32 for mixture-of-experts models")->default_val(max_rank)->check(CLI::Range(0, 1024));
  app.add_option("--capacity-wait", capacity_wait, "seconds a create_model may wait for an adapter slot when all are in use (queue_state paused_capacity, first come first served); then it fails naming this flag. 0 = refuse at once (503)")->default_val(capacity_wait)->check(CLI::Range(0.0, 86400.0));
  app.add_option("--lora-alpha", lora_alpha, "LoRA alpha of every adapter (scale = alpha / rank)")->default_val(lora_alpha);
  app.add_option("--api-keys", api_keys_file, "file of 'key tenant' lines; without it any tml- key is its own tenant (loopback only)");
  app.add_option("--session-ttl", session_ttl, "seconds without a heartbeat (the SDK sends one every 10 s) before a session expires: its models' adapter slots are released and its samples cancelled")->default_val(session_ttl);
  app.add_option("--seq-gap-timeout", seq_gap_timeout, "seconds a missing seq_id may hold up later requests")->default_val(seq_gap_timeout);
  app.add_option("--max-body-bytes", max_body_bytes, "largest request body (also after zstd decoding)")->default_val(max_body_bytes);
  app.add_option("--poll-hold", poll_hold, "seconds a retrieve_future long-poll is held (< 45)")->default_val(poll_hold);
  int64_t token_budget = 0;
  int64_t graph_tokens = engine::EngineOptions{}.graph_max_tokens;
  std::string moments = engine::EngineOptions{}.moments;
  int batch_window_ms = 2;
  std::string pass_tokens = "most";
  bool small_ops_first = false;
  std::string shared_prefixes = "on";
  app.add_option("--shared-prefixes", shared_prefixes, "on | off: a forward_backward request's datums that begin with the same rows (an RL group's prompt: the same tokens and loss inputs) train those rows once in the pass, the same gradients to float rounding (models whose every layer is softmax attention over plain keys; off: every datum whole)")->default_val(shared_prefixes)->check(CLI::IsMember({"on", "off"}));
  app.add_flag("--small-ops-first", small_ops_first, "ready optim_steps and saves run before the next packed forward_backward pass, so that tenants whose passes completed early step, publish and sample while the others' still train (off: each op waits its turn by arrival)");
  app.add_option("--token-budget", token_budget, "tokens per packed forward_backward pass; larger requests are split over passes (0 = on a GPU the most that fit beside the weights, slots and KV cache, measured at start-up; 8192 on the CPU)")->default_val(token_budget)->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--pass-tokens", pass_tokens, "most | kept: a pass holds at most the tokens that fit in the memory free now with every layer recomputed (the memory plan then recomputes the fewest layers that fit), or those that fit with every layer's activations kept (at least 4096, with layers recomputed below that): faster for one tenant's large requests, slower for many tenants' at once")->default_val(pass_tokens)->check(CLI::IsMember({"most", "kept"}));
  app.add_option("--moments", moments, "where the adapters' AdamW moments live: device, host (pinned host memory, staged through the GPU at each optim_step: half the slot's device bytes) or auto (the host only when --max-adapters slots do not fit on the device otherwise)")->default_val(moments)->check(CLI::IsMember({"auto", "device", "host"}));
  app.add_option("--graph-tokens", graph_tokens, "on a GPU, forward_backward passes of at most this many tokens (padded to power-of-two lengths of at least 64 and counts) run as CUDA graphs, captured on first use (0 = never)")->default_val(graph_tokens)->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  app.add_option("--batch-window-ms", batch_window_ms, "wait this long after the newest arrival before a training pass, and before an idle sampler's first step, so requests sent together share it (0 = off)")->default_val(batch_window_ms)->check(CLI::Range(0, 1000));
  app.add_option("--io-threads", io_threads, "HTTP I/O threads")->default_val(io_threads)->check(CLI::Range(1, 64));
  app.add_option("--decode-threads", decode_threads, "threads that decode heavy bodies (zstd, protobuf, large JSON) off the I/O threads")->default_val(decode_threads)->check(CLI::Range(1, 64));
  app.add_option("--decode-queue", decode_queue, "heavy requests queued or decoding at once (beyond: 503, retryable); one tenant may hold half")->default_val(decode_queue)->check(CLI::Range(1, 4096));
  app.add_option("--max-connections", max_connections, "open HTTP connections (beyond: 503 and close); kept below the open-files limit minus a reserve for the store")->default_val(max_connections)->check(CLI::Range(1, 1 << 20));
  app.add_option("--admin-key", admin_key, "X-API-Key of the operator: only it may read /metrics (with every tenant's usage series) and every tenant's GET /api/v1/usage (default: none; /metrics is then public for the aggregates, a tenant's key adds its own models' series)");
  app.add_option("--sample-queue", sample_queue, "asample calls the sampler holds at once, queued or running (beyond: 429, the SDK backs off and resubmits); one tenant may hold half")->default_val(sample_queue)->check(CLI::Range(1, 1 << 20));
  app.add_option("--sampler-adapters", sampler_adapters, "sampler's adapter cache slots (LRU; evicted snapshots reload from disk); 0 = one per --max-adapters (at least 4), at most what fits in a tenth of the device's memory")->default_val(sampler_adapters)->check(CLI::Range(0, 4096));
  app.add_option("--publish-threads", publish_threads, "threads that write and commit save_weights_for_sampler snapshots off the engine thread")->default_val(publish_threads)->check(CLI::Range(1, 64));
  std::string publish_staging = "per-write";
  app.add_option("--publish-staging", publish_staging, "per-write | ahead: the pinned host memory a snapshot write stages through, taken by each write from the caching host allocator, or by each writer thread at start-up and kept (not yet measured on a GPU)")->default_val(publish_staging)->check(CLI::IsMember({"per-write", "ahead"}));
  std::string prefix_cache = "on";
  app.add_option("--prefix-cache", prefix_cache, "keep full KV blocks for later samples with the same snapshot and token prefix (prompt_cache_hit_tokens)")->default_val(prefix_cache)->check(CLI::IsMember({"on", "off"}));
  const StepFlags step_flags(app);
  app.add_option("--max-batch-rows", max_batch_rows, "sampler rows (sequences) per decode step")->default_val(max_batch_rows)->check(CLI::Range(1, 1 << 16));
  app.add_option("--kv-budget-tokens", kv_budget_tokens, "sampler KV cache size in tokens (0 = 512 per batch row on a GPU, 65536 on the CPU)")->default_val(kv_budget_tokens)->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  int max_models_per_tenant = -1;  // -1: the default below
  app.add_option("--max-models-per-tenant", max_models_per_tenant, "live training models (adapter slots) one tenant may hold; 0 = no limit (default: max(1, max-adapters/4) with --api-keys, no limit in open mode)")->check(CLI::Range(0, 4096));
  app.add_option("--context-window", context_window, "context window W for training and sampling (0 = the model config's)")->default_val(context_window)->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  const DecodeFlags decode_flags(app);
  std::string role = "all", replica_key;
  std::vector<std::string> sampler_replicas;
  app.add_option("--role", role, "all: the Tinker API, the trainer and a sampler in this process (the default); sampler: a sampler replica that a gateway sends samples to (--sampler-replicas there), serving only its internal API")->default_val(role)->check(CLI::IsMember({"all", "sampler"}));
  app.add_option("--sampler-replicas", sampler_replicas, "HOST:PORT of each sampler replica (`loom serve --role sampler`), comma-separated: this process becomes the gateway and trainer, and every asample goes to a live replica that has its snapshot warm (resubmitted elsewhere if that replica dies); the replicas read snapshots from this --data-dir, so they must see it at the same path")->delimiter(',');
  int tp = 1, ep = 1, group_rank = 0;
  std::string group_store;
  app.add_option("--tp", tp, "tensor parallel: the trainer's attention and dense MLPs split over this many processes, one per device (ranks 1.. start themselves); sampling then runs on --sampler-replicas")->default_val(tp)->check(CLI::Range(1, 64));
  app.add_option("--ep", ep, "expert parallel: each MoE layer's experts split over this many processes (the same ones as --tp when both are > 1, so each is 1 or the other's value)")->default_val(ep)->check(CLI::Range(1, 64));
  app.add_option("--group-rank", group_rank, "this process is rank N >= 1 of the trainer group of --tp/--ep (rank 0 starts its ranks itself, unless --group-store names a tcp:// rendezvous: then start each elsewhere with the same flags and its --group-rank)");
  app.add_option("--group-store", group_store, "the trainer group's rendezvous: tcp://HOST:PORT (served by rank 0 on HOST; ranks on several machines) or a file on a filesystem every rank sees (default: one in --data-dir, ranks started here)");
  app.add_option("--replica-key", replica_key, "shared secret between the gateway and its sampler replicas (X-Replica-Key); required to bind a replica to a non-loopback address");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // Before any thread parses: a client's malformed protobuf bodies cannot
  // flood the log with protobuf's own error lines.
  wire::LimitProtobufLogs();
  if (poll_hold <= 0 || poll_hold >= 45) return Fail("--poll-hold: must be in (0, 45) seconds (the SDK times out at 45 s)");
  if (session_ttl <= 0) return Fail("--session-ttl: must be > 0 seconds");
  if (seq_gap_timeout <= 0) return Fail("--seq-gap-timeout: must be > 0 seconds");

  http::ApiKeys keys;
  if (!api_keys_file.empty()) {
    auto loaded = http::ApiKeys::Load(api_keys_file);
    if (!loaded.ok()) return Fail(loaded.status().message());
    keys = std::move(*loaded);
  }
  if (Status st = keys.AllowedOn(host); !st.ok()) return Fail(st.message());

  std::error_code ec;
  std::filesystem::create_directories(data_dir, ec);
  if (ec) return Fail("--data-dir: cannot create '" + data_dir + "': " + ec.message());
  data_dir = std::filesystem::absolute(data_dir).string();
  if (model_dirs.empty()) {
    auto dir = DefaultModel(data_dir);
    if (!dir.ok()) return Fail("default model: " + dir.status().message());
    model_dirs.push_back(*dir);
    if (model_name.empty()) model_name = "loom/tiny-qwen3";
  }
  auto models = ParseModels(model_dirs, model_name);
  if (!models.ok()) return Fail(models.status().message());
  // The sampler's options from the flags (colocated or a replica).
  const auto sampler_options = [&](const std::string& dir, int trainer_slots, int rank, int64_t window) {
    engine::SamplerOptions samp;
    samp.model_dir = dir;
    samp.sampler_adapters = sampler_adapters;
    samp.trainer_slots = trainer_slots;
    samp.max_rank = rank;
    samp.kv_budget_tokens = kv_budget_tokens;
    samp.max_batch_rows = max_batch_rows;
    step_flags.Apply(&samp);
    samp.prefix_cache = prefix_cache == "on";
    samp.context_window = window;
    samp.admission_window = std::chrono::milliseconds(batch_window_ms);
    samp.decode = decode_flags.options();
    return samp;
  };
  if (role == "sampler") {
    if (models->size() != 1) return Fail("--role sampler: a replica serves one --model");
    if (!sampler_replicas.empty()) return Fail("--sampler-replicas: only the gateway names replicas, not --role sampler");
    if (replica_key.empty() && !http::IsLoopbackHost(host))
      return Fail("--host " + host + ": a sampler replica on a non-loopback address needs --replica-key");
    return ServeSamplerReplica(
        models->front().dir, device,
        sampler_options(models->front().dir, max_adapters, max_rank, context_window),
        SamplerReplicaServing{host, port, io_threads, decode_threads, decode_queue, max_connections, max_body_bytes,
                              std::chrono::milliseconds(static_cast<int64_t>(poll_hold * 1000)), replica_key});
  }
  if (!sampler_replicas.empty() && models->size() != 1)
    return Fail("--sampler-replicas: replicas serve one base model; serve one --model with them");
  const int group_size = std::max(tp, ep);
  if ((tp != 1 && tp != group_size) || (ep != 1 && ep != group_size))
    return Fail(fmt::format("--tp {} --ep {}: both split the same processes, so each is 1 or the other's value", tp, ep));
  if (group_size > 1 && models->size() != 1) return Fail("--tp/--ep: a trainer group serves one --model");
  if (group_rank > 0) {  // a worker of rank 0's trainer group
    if (group_rank >= group_size || group_store.empty()) return Fail("--group-rank: not a rank of this group");
    engine::EngineOptions worker;
    worker.model_dir = models->front().dir;
    worker.device = device;
    worker.context_window = context_window;
    worker.graph_max_tokens = graph_tokens;
    worker.share_prefixes = shared_prefixes == "on";  // every rank packs the passes alike
    worker.moments = moments;
    worker.max_slots = max_adapters;
    worker.max_rank = max_rank;
    worker.group_rank = group_rank;
    worker.tp_size = tp;
    worker.ep_size = ep;
    worker.group_store = group_store;
    return RunTrainerRank(worker);
  }

  // Signals go to the waiting main thread only: block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Each plans and checks its slots against an equal share of the memory
  // admitted for slots (on a GPU, of what the earlier ones left): Engine::Open
  // refuses --max-adapters that do not fit in it, so `loom serve` exits here.
  engine::EngineOptions eopt;
  eopt.device = device;
  eopt.context_window = context_window;
  eopt.graph_max_tokens = graph_tokens;
  eopt.share_prefixes = shared_prefixes == "on";
  eopt.moments = moments;
  eopt.max_slots = max_adapters;  // 0: planned by Engine::Open
  eopt.max_rank = max_rank;
  eopt.memory_share = 1.0 / static_cast<double>(models->size());
  eopt.tp_size = tp;
  eopt.ep_size = ep;
  std::unique_ptr<TrainerGroup> group;  // ranks 1.. of --tp/--ep, started before rank 0 joins them
  if (group_size > 1 && !group_store.empty()) {
    // --group-store tcp://HOST:PORT on rank 0 too: ranks 1.. are started
    // elsewhere (other machines) with the same flags and their --group-rank.
    eopt.group_store = group_store;
    std::fprintf(stderr, "loom serve: waiting for trainer ranks 1..%d at %s\n", group_size - 1, group_store.c_str());
  } else if (group_size > 1) {
    eopt.group_store = data_dir + "/trainer-group.store";
    auto started = TrainerGroup::Start(group_size, command_line, eopt.group_store);
    if (!started.ok()) return Fail(started.status().message());
    group = std::move(*started);
  }
  std::vector<OpenedModel> opened;
  for (const ModelDir& m : *models) {
    const std::string flag = models->size() == 1 ? "--model" : "--model " + m.name;
    const std::string tag = models->size() == 1 ? "" : "model " + m.name + ": ";
    eopt.model_dir = m.dir;
    auto engine = engine::Engine::Open(eopt);
    if (!engine.ok()) return Fail(flag + ": " + engine.status().message());
    std::fprintf(stderr, "loom serve: %s%s\n", tag.c_str(), DescribeSlotPlan((*engine)->info()).c_str());
    const engine::ModelInfo& trainer = (*engine)->info();
    std::unique_ptr<engine::Sampler> sampler;
    if (!sampler_replicas.empty()) {
      // The gateway: samples go to the replicas, which must agree with the
      // trainer on the context window and take its largest rank.
      replica::RemoteOptions ropt;
      ropt.replicas = sampler_replicas;
      ropt.key = replica_key;
      auto remote = replica::RemoteSampler::Open(ropt);
      if (!remote.ok()) return Fail(remote.status().message());
      const engine::SamplerInfo& ri = (*remote)->info();
      if (ri.context_window != trainer.context_window || ri.vocab_size != trainer.vocab_size)
        return Fail(fmt::format("--sampler-replicas: the replicas serve a vocabulary of {} and a context window of {}, "
                                "the trainer {} and {}: start them on the same --model and --context-window",
                                ri.vocab_size, ri.context_window, trainer.vocab_size, trainer.context_window));
      if (ri.max_rank < trainer.max_rank)
        return Fail(fmt::format("--sampler-replicas: the replicas take ranks up to {}, the trainer up to {}: start "
                                "them with --max-rank {}", ri.max_rank, trainer.max_rank, trainer.max_rank));
      std::fprintf(stderr, "loom serve: sampling on %zu replicas (%d adapter slots each at least)\n",
                   sampler_replicas.size(), ri.sampler_adapters);
      sampler = std::move(*remote);
    } else if (group_size > 1) {
      std::fprintf(stderr, "loom serve: the trainer is split over %d processes: sampling is served only on "
                           "--sampler-replicas\n", group_size);
    } else {
      // The sampler shares the trainer's frozen base (held once).
      auto local = engine::Sampler::Open(
          (*engine)->SharedModel(), sampler_options(m.dir, trainer.max_slots, trainer.max_rank, trainer.context_window));
      if (!local.ok()) return Fail(flag + ": sampler: " + local.status().message());
      const engine::SamplerInfo& si = (*local)->info();
      std::fprintf(stderr, "loom serve: %ssampler: %d adapter slots%s\n", tag.c_str(), si.sampler_adapters,
                   si.probe_prefill_tokens > 0
                       ? fmt::format("; {} MiB kept for its steps (measured at start-up: a prefill of {} tokens and a "
                                     "decode step of {} rows)",
                                     si.step_reserve_bytes >> 20, si.probe_prefill_tokens, si.probe_decode_rows)
                             .c_str()
                       : "");
      sampler = std::move(*local);
    }
    opened.push_back({m.name, std::move(*engine), std::move(sampler), 0});
  }
  // Every trainer on the device leaves every sampler's step reserve free.
  for (OpenedModel& m : opened)
    for (const OpenedModel& other : opened)
      if (other.sampler) m.engine->ShareDevice(other.sampler->device_reserve());
  // After every sampler's KV cache is allocated: the pass limit is what is
  // left, and the models' passes may run at once, so each gets an equal share.
  const int64_t n = static_cast<int64_t>(opened.size());
  for (OpenedModel& m : opened) {
    const std::string tag = n == 1 ? "" : "model " + m.name + ": ";
    const int64_t free_limit = m.engine->MaxPassTokens();
    const int64_t pass_limit = free_limit / n;
    m.token_budget = service::TokenBudget(*m.engine, n, token_budget);
    if (free_limit <= 0) continue;  // the CPU: memory sets no limit the engine knows of
    if (Status room = service::CheckPassRoom(*m.engine, n, m.name); !room.ok()) return Fail(tag + room.message());
    std::fprintf(stderr, "loom serve: %stoken budget %lld tokens per pass (%s; at most %lld fit%s)\n", tag.c_str(),
                 static_cast<long long>(m.token_budget), m.engine->MemoryPlanReport().c_str(),
                 static_cast<long long>(pass_limit), n == 1 ? "" : fmt::format(", 1/{} of the room", n).c_str());
    if (m.token_budget > pass_limit)
      std::fprintf(stderr, "loom serve: %s--token-budget %lld is above what fits: passes past %lld tokens are refused\n",
                   tag.c_str(), static_cast<long long>(m.token_budget), static_cast<long long>(pass_limit));
  }
  int fewest_slots = opened.front().engine->info().max_slots;
  for (const OpenedModel& m : opened) fewest_slots = std::min(fewest_slots, m.engine->info().max_slots);
  auto registry = store::Registry::Open(data_dir);
  if (!registry.ok()) return Fail("--data-dir: " + registry.status().message());

  service::ServiceOptions sopt;
  sopt.base_model_name = opened.front().name;
  sopt.lora_alpha = lora_alpha;
  sopt.batch_window = std::chrono::milliseconds(batch_window_ms);
  sopt.session_ttl = std::chrono::milliseconds(static_cast<int64_t>(session_ttl * 1000));
  sopt.seq_gap_timeout = std::chrono::milliseconds(static_cast<int64_t>(seq_gap_timeout * 1000));
  sopt.capacity_wait = std::chrono::milliseconds(static_cast<int64_t>(capacity_wait * 1000));
  sopt.sample_queue = sample_queue;
  sopt.publish_threads = publish_threads;
  sopt.publish_staging_ahead = publish_staging == "ahead";
  // Keyed tenants share the slots (per base model; a quarter of the fewest);
  // in open mode (loopback, one developer) a tenant may take them all unless
  // told otherwise.
  sopt.max_models_per_tenant =
      max_models_per_tenant >= 0 ? max_models_per_tenant : keys.open_mode() ? 0 : std::max(1, fewest_slots / 4);
  sopt.token_budget = opened.front().token_budget;
  sopt.pass_sizing = service::ParsePassSizing(pass_tokens);
  sopt.small_ops_first = small_ops_first;
  const int sampler_slots = opened.front().sampler ? opened.front().sampler->info().sampler_adapters : 0;
  std::vector<service::BaseModelSpec> bases;
  for (OpenedModel& m : opened) bases.push_back({m.name, std::move(m.engine), m.token_budget});
  service::Service service(sopt, std::move(bases), std::move(*registry));
  for (OpenedModel& m : opened) {
    if (!m.sampler) continue;
    if (Status st = service.AttachSampler(std::move(m.sampler), m.name); !st.ok()) return Fail(st.message());
  }
  service.Start();

  http::RouterOptions ropt;
  ropt.max_body_bytes = max_body_bytes;
  ropt.admin_key = admin_key;
  http::Router router(service, keys, ropt);
  http::ServerOptions hopt;
  hopt.host = host;
  hopt.port = static_cast<uint16_t>(port);
  hopt.io_threads = io_threads;
  hopt.decode_threads = decode_threads;
  hopt.decode_queue = decode_queue;
  hopt.max_connections = max_connections;
  hopt.max_body_bytes = max_body_bytes;
  hopt.poll_hold = std::chrono::milliseconds(static_cast<int64_t>(poll_hold * 1000));
  http::HttpServer server(router, service.futures(), hopt);
  if (Status st = server.Start(); !st.ok()) return Fail(st.message());

  const auto& info = service.model_info();
  std::string names;
  for (const auto& base : service.bases()) names += (names.empty() ? "" : ",") + base->name;
  std::printf("loom serve: listening on http://%s:%u model=%s (%s, %s, %s) slots=%d max_rank=%d "
              "slot_mib=%lld moments=%s sampler_adapters=%d models_per_tenant=%s capacity_wait_s=%g session_ttl_s=%g "
              "data_dir=%s%s max_connections=%d role=%s tp=%d ep=%d\n",
              host.c_str(), server.port(), names.c_str(), info.model_type.c_str(), info.device.c_str(),
              info.dtype.c_str(), info.max_slots, info.max_rank,
              static_cast<long long>(info.slot_bytes / (1024 * 1024)), info.moments_on_host ? "host" : "device", sampler_slots,
              sopt.max_models_per_tenant > 0 ? std::to_string(sopt.max_models_per_tenant).c_str() : "unlimited",
              capacity_wait, session_ttl, data_dir.c_str(), keys.open_mode() ? " auth=open(tml-*)" : " auth=api-keys", server.max_connections(),
              sampler_replicas.empty() ? "all" : "gateway", tp, ep);
  std::fflush(stdout);

  int sig = 0;
  sigwait(&signals, &sig);
  log::Info("shutdown signal={}", sig);
  service.Stop();   // the batch in flight finishes; queued requests fail with "shutting down"
  server.Stop();    // parked polls answer, connections close
  log::Info("shutdown complete");
  return group && group->broken() ? 3 : 0;
}

}  // namespace loom::cli
