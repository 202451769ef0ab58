// The in-process Tinker client of service_driver.h.
#include "cli/service_driver.h"

#include <condition_variable>
#include <filesystem>
#include <mutex>

#include "engine/model/make_model.h"
#include "store/registry.h"

namespace loom::cli {

namespace fs = std::filesystem;

Result<std::string> EmbeddedModel(const std::string& data_dir) {
  const std::string dir = data_dir + "/default-model";
  if (fs::exists(dir + "/config.json")) return dir;
  engine::MakeModelOptions opt;
  opt.arch = "qwen3";
  opt.preset = "tiny";
  opt.seed = 1;
  const std::string tmp = dir + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (Status st = engine::MakeModel(opt, tmp); !st.ok()) return st;
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
  auto engine = engine::Engine::Open(eopt);
  if (!engine.ok()) return engine.status();
  auto registry = store::Registry::Open(options.data_dir);
  if (!registry.ok()) return registry.status();
  service::ServiceOptions sopt;
  sopt.base_model_name = "loom/tiny-qwen3";
  sopt.token_budget = options.token_budget;
  std::unique_ptr<ServiceDriver> d(new ServiceDriver());
  d->service_ = std::make_unique<service::Service>(sopt, std::move(*engine), std::move(*registry));
  d->service_->Start();
  return d;
}

ServiceDriver::~ServiceDriver() {
  if (service_) service_->Stop();
}

Result<Tenant> ServiceDriver::NewTenant(const std::string& name, int rank, uint64_t seed) {
  auto session = service_->CreateSession({name, ""}, {});
  if (!session.ok()) return session.status();
  wire::CreateModelRequest req;
  req.session_id = *session;
  req.base_model = service_->options().base_model_name;
  req.lora.rank = rank;
  req.lora.seed = seed;
  req.seed_given = true;
  auto sub = service_->CreateModel({name, ""}, req);
  if (!sub.ok()) return sub.status();
  Tenant t{name, sub->model_id, 1};
  auto done = Await(t, sub->request_id);
  if (!done.ok()) return done.status();
  return t;
}

Result<std::string> ServiceDriver::SubmitForwardBackward(Tenant& t, engine::ForwardBackwardCall call) {
  wire::ForwardBackwardRequest req;
  req.model_id = t.model_id;
  req.seq_id = static_cast<int32_t>(t.next_seq++);
  req.call = std::move(call);
  auto sub = service_->ForwardBackward({t.name, ""}, std::move(req));
  if (!sub.ok()) return sub.status();
  return sub->request_id;
}

Result<std::string> ServiceDriver::SubmitOptimStep(Tenant& t, const engine::AdamParams& adam) {
  wire::OptimStepRequest req;
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

}  // namespace loom::cli
