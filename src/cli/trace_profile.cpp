#include "cli/trace_profile.h"

#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/autograd/profiler_kineto.h>
#define LOOM_HAS_TRACE 1
#else
#define LOOM_HAS_TRACE 0
#endif

namespace loom::cli {

#if LOOM_HAS_TRACE
namespace {
namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

const std::set<ActivityType>& Activities() {
  static const std::set<ActivityType> a{ActivityType::CPU, ActivityType::CUDA};
  return a;
}
}  // namespace

Status StartTrace() {
  ProfilerConfig config(ProfilerState::KINETO);
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 7
  // The sampler's work runs on its decode thread, not on the caller's.
  config.experimental_config.profile_all_threads = true;
#endif
  prof::prepareProfiler(config, Activities());
  prof::enableProfiler(config, Activities());
  return Status::Ok();
}

Status StopTrace(const std::string& path) {
  std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
  if (!result) return Status::Internal("the profiler returned no result");
  result->save(path);
  return Status::Ok();
}
#else
Status StartTrace() { return Status::Precondition("--profile needs libtorch 2.x (the GPU build)"); }
Status StopTrace(const std::string&) { return Status::Precondition("no trace was started"); }
#endif

}  // namespace loom::cli
