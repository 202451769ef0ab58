// `loom serve --tp N --ep M`: the trainer as a group of max(N, M) processes,
// one per device (engine/model/parallel.h). This process is rank 0: it
// serves the API and makes the engine calls; ranks 1.. are copies of its
// own command line with --group-rank r and --group-store PATH added, which
// open their part of the model and replay rank 0's calls
// (Engine::RunGroupWorker). A worker dies with rank 0 (PR_SET_PDEATHSIG);
// a worker that dies while rank 0 serves makes rank 0 shut down (a group
// missing a rank cannot train), with exit code 3.
#pragma once
#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "engine/api.h"

namespace loom::cli {

class TrainerGroup {
 public:
  // Starts ranks 1..size-1 from `args` (this process's `serve ...` argv).
  static Result<std::unique_ptr<TrainerGroup>> Start(int size, const std::vector<std::string>& args,
                                                     const std::string& store);
  // After rank 0's engine is gone (it told the workers to stop): waits for
  // them a while, then kills the rest.
  ~TrainerGroup();
  // Whether a worker died while serving (then SIGTERM was raised here).
  bool broken() const { return broken_.load(); }

 private:
  TrainerGroup() = default;
  std::vector<pid_t> pids_;
  std::atomic<bool> stopping_{false}, broken_{false};
  std::thread watcher_;
};

// A worker's whole life (--group-rank r >= 1): the exit code.
int RunTrainerRank(const engine::EngineOptions& options);

}  // namespace loom::cli
