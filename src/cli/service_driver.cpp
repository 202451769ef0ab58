// The in-process Tinker client of service_driver.h.
#include "cli/service_driver.h"

#include <condition_variable>
#include <filesystem>
#include <mutex>

#include "common/log.h"
#include "service/pass_room.h"
#include "testmodel/make_model.h"
#include "store/registry.h"

namespace loom::cli {

namespace fs = std::filesystem;

Result<std::string> EmbeddedModel(const std::string& data_dir) {
  const std::string dir = data_dir + "/default-model";
  if (fs::exists(dir + "/config.json")) return dir;
  testmodel::MakeModelOptions opt;
  opt.arch = "qwen3";
  opt.preset = "tiny";
  opt.seed = 1;
  const std::string tmp = dir + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (Status st = testmodel::MakeModel(opt, tmp); !st.ok()) return st;
  fs::rename(tmp, dir, ec);
  if (ec) return Status::Internal("cannot move the default model into " + dir + ": " + ec.message());
  return dir;
}

Result<std::unique_ptr<ServiceDriver>> ServiceDriver::Open(const DriverOptions& options) {
  std::error_code ec;
  fs::create_directories(options.data_dir, ec);
  if (ec) return Status::Invalid("data dir '" + options.data_dir + "': " + ec.message());
  std::string model_dir = options.model_dir;
  if (model_dir.empty()) {
    auto dir = EmbeddedModel(options.data_dir);
    if (!dir.ok()) return dir.status();
    model_dir = *dir;
  }
  engine::EngineOptions eopt;
  eopt.model_dir = model_dir;
  eopt.max_slots = options.max_slots;
  eopt.max_rank = options.max_rank;
  eopt.threads = options.threads;
  eopt.lora_ragged = options.lora_ragged;
  eopt.share_prefixes = options.share_prefixes;
  auto engine = engine::Engine::Open(eopt);
  if (!engine.ok()) return engine.status();
  auto registry = store::Registry::Open(options.data_dir);
  if (!registry.ok()) return registry.status();
  service::ServiceOptions sopt;
  sopt.base_model_name = "loom/tiny-qwen3";
  sopt.publish_threads = options.publish_threads;
  sopt.publish_staging_ahead = options.publish_staging_ahead;
  std::unique_ptr<engine::Sampler> sampler;
  if (options.with_sampler) {
    auto shared = (*engine)->SharedModel();
    if (!shared) return Status::Unavailable("this engine does not share its base model with a sampler");
    engine::SamplerOptions samp;
    samp.model_dir = model_dir;
    samp.max_rank = options.max_rank;
    samp.trainer_slots = options.max_slots;  // sampler_adapters auto: one per slot, memory permitting
    samp.kv_budget_tokens = options.kv_budget_tokens;
    samp.admission_window = sopt.batch_window;  // as loom serve (--batch-window-ms)
    if (options.sampler_steps) options.sampler_steps->Apply(&samp);
    if (options.sampler_decode) samp.decode = options.sampler_decode->options();
    auto opened = engine::Sampler::Open(shared, samp);
    if (!opened.ok()) return opened.status();
    sampler = std::move(*opened);
    (*engine)->ShareDevice(sampler->device_reserve());
  }
  // As loom serve: a server whose slots and sampler leave no room to train is refused here.
  if (Status room = service::CheckPassRoom(**engine, 1, model_dir.empty() ? "embedded tiny qwen3" : model_dir); !room.ok())
    return room;
  if (const int64_t limit = (*engine)->MaxPassTokens(); limit > 0)
    log::Info("trainer: at most {} tokens a pass, {} with every layer kept ({})", limit, (*engine)->KeptPassTokens(),
              (*engine)->MemoryPlanReport());
  sopt.token_budget = service::TokenBudget(**engine, 1, options.token_budget);
  sopt.pass_sizing = options.pass_sizing;
  sopt.small_ops_first = options.small_ops_first;
  std::unique_ptr<ServiceDriver> d(new ServiceDriver());
  d->service_ = std::make_unique<service::Service>(sopt, std::move(*engine), std::move(*registry));
  if (sampler) d->service_->AttachSampler(std::move(sampler));
  d->service_->Start();
  return d;
}

ServiceDriver::~ServiceDriver() {
  if (service_) service_->Stop();
}

Result<Tenant> ServiceDriver::NewTenant(const std::string& name, int rank, uint64_t seed) {
  auto session = service_->CreateSession({name, ""}, {});
  if (!session.ok()) return session.status();
  tinker::CreateModelRequest req;
  req.session_id = *session;
  req.base_model = service_->options().base_model_name;
  req.lora.rank = rank;
  req.lora.seed = seed;
  req.seed_given = true;
  auto sub = service_->CreateModel({name, ""}, req);
  if (!sub.ok()) return sub.status();
  Tenant t{name, sub->model_id, *session, 1, 0};
  auto done = Await(t, sub->request_id);
  if (!done.ok()) return done.status();
  return t;
}

Status ServiceDriver::Unload(const Tenant& t) {
  auto sub = service_->UnloadModel({t.name, ""}, t.model_id);
  if (!sub.ok()) return sub.status();
  auto done = Await(t, sub->request_id);
  return done.ok() ? Status::Ok() : done.status();
}

Result<std::string> ServiceDriver::SubmitForwardBackward(Tenant& t, engine::ForwardBackwardCall call) {
  tinker::ForwardBackwardRequest req;
  req.model_id = t.model_id;
  req.seq_id = static_cast<int32_t>(t.next_seq++);
  req.call = std::move(call);
  auto sub = service_->ForwardBackward({t.name, ""}, std::move(req));
  if (!sub.ok()) return sub.status();
  return sub->request_id;
}

Result<std::string> ServiceDriver::SubmitOptimStep(Tenant& t, const engine::AdamParams& adam) {
  tinker::OptimStepRequest req;
  req.model_id = t.model_id;
  req.seq_id = t.next_seq++;
  req.adam_params = adam;
  auto sub = service_->OptimStep({t.name, ""}, req);
  if (!sub.ok()) return sub.status();
  return sub->request_id;
}

Result<service::FutureView> ServiceDriver::Await(const Tenant& t, const std::string& request_id) {
  auto& futures = service_->futures();
  struct Signal {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto signal = std::make_shared<Signal>();
  while (true) {
    auto view = futures.Get(t.name, request_id);
    if (!view.ok()) return view.status();
    if (view->state == service::FutureState::kFailed) return view->error;
    if (view->state == service::FutureState::kDone) return *view;
    const uint64_t watch = futures.Watch(request_id, [signal] {
      std::lock_guard<std::mutex> lock(signal->mu);
      signal->done = true;
      signal->cv.notify_all();
    });
    if (watch == 0) continue;  // finished in between: look again
    std::unique_lock<std::mutex> lock(signal->mu);
    signal->cv.wait(lock, [&] { return signal->done; });
    signal->done = false;
  }
}

Result<std::string> ServiceDriver::SaveForSampler(Tenant& t, const std::string& name) {
  tinker::SaveWeightsForSamplerRequest save;
  save.model_id = t.model_id;
  save.seq_id = t.next_seq++;
  save.name = name;
  auto sub = service_->SaveWeightsForSampler({t.name, ""}, save);
  if (!sub.ok()) return sub.status();
  auto saved = Await(t, sub->request_id);
  if (!saved.ok()) return saved.status();
  const auto* result = std::get_if<tinker::SaveWeightsForSamplerResult>(saved->result.get());
  if (!result || !result->path) return Status::Internal("save_weights_for_sampler answered without a path");
  return result->path->ToString();
}

Result<std::string> ServiceDriver::SaveAndGetSampler(Tenant& t) {
  tinker::SaveWeightsForSamplerRequest save;
  save.model_id = t.model_id;
  save.seq_id = t.next_seq++;
  save.sampling_session_seq_id = t.next_sampling_seq++;
  auto sub = service_->SaveWeightsForSampler({t.name, ""}, save);
  if (!sub.ok()) return sub.status();
  auto saved = Await(t, sub->request_id);
  if (!saved.ok()) return saved.status();
  const auto* result = std::get_if<tinker::SaveWeightsForSamplerResult>(saved->result.get());
  if (!result || !result->sampling_session_id)
    return Status::Internal("save_weights_for_sampler answered without a sampling session");
  return *result->sampling_session_id;
}

Result<std::string> ServiceDriver::NewSamplingSession(Tenant& t, const std::string& model_path) {
  tinker::CreateSamplingSessionRequest session;
  session.session_id = t.session_id;
  session.sampling_session_seq_id = t.next_sampling_seq++;
  if (model_path.empty()) session.base_model = service_->options().base_model_name;
  else session.model_path = model_path;
  return service_->CreateSamplingSession({t.name, ""}, session);
}

Result<tinker::SampleOutput> ServiceDriver::Sample(const Tenant& t, const std::string& sampling_session_id,
                                                   const std::vector<int32_t>& prompt, int num_samples,
                                                   const tinker::SamplingParams& params, int64_t seq_id) {
  tinker::SampleRequest req;
  req.sampling_session_id = sampling_session_id;
  req.seq_id = seq_id;
  req.num_samples = num_samples;
  req.prompt = prompt;
  req.sampling_params = params;
  auto sub = service_->Sample({t.name, ""}, req);
  if (!sub.ok()) return sub.status();
  auto done = Await(t, sub->request_id);
  if (!done.ok()) return done.status();
  const auto* sample = std::get_if<tinker::SampleOutput>(done->result.get());
  if (!sample || static_cast<int>(sample->sequences.size()) != num_samples)
    return Status::Internal("asample answered without its sequences");
  return *sample;
}

Result<std::vector<int32_t>> ServiceDriver::Greedy(Tenant& t, const std::vector<int32_t>& prompt, int max_tokens,
                                                   const std::string& snapshot) {
  std::string path;
  if (!snapshot.empty()) {
    auto saved = SaveForSampler(t, snapshot);
    if (!saved.ok()) return saved.status();
    path = *saved;
  }
  auto sampling_id = NewSamplingSession(t, path);
  if (!sampling_id.ok()) return sampling_id.status();
  tinker::SamplingParams params;
  params.max_tokens = max_tokens;
  params.temperature = 0.0;
  auto sample = Sample(t, *sampling_id, prompt, 1, params);
  if (!sample.ok()) return sample.status();
  return sample->sequences[0].tokens;
}

}  // namespace loom::cli
