#include "cli/trainer_group.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "common/log.h"

namespace loom::cli {

Result<std::unique_ptr<TrainerGroup>> TrainerGroup::Start(int size, const std::vector<std::string>& args,
                                                          const std::string& store) {
  std::unique_ptr<TrainerGroup> g(new TrainerGroup());
  std::error_code ec;
  std::filesystem::remove(store, ec);  // a FileStore file of an earlier group would mix the rendezvous
  const pid_t parent = ::getpid();
  for (int r = 1; r < size; ++r) {
    std::vector<std::string> argv = {"loom"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--group-rank", std::to_string(r), "--group-store", store});
    const pid_t pid = ::fork();
    if (pid < 0) return Status::Internal("--tp/--ep: cannot start rank " + std::to_string(r));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);  // rank 0 died before the line above
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);  // rank 0 blocked SIGTERM for its own sigwait
      ::dup2(STDERR_FILENO, STDOUT_FILENO);        // rank 0's stdout carries only its banner
      std::vector<char*> cargv;
      for (auto& a : argv) cargv.push_back(a.data());
      cargv.push_back(nullptr);
      ::execv("/proc/self/exe", cargv.data());
      ::_exit(127);
    }
    g->pids_.push_back(pid);
  }
  TrainerGroup* self = g.get();
  g->watcher_ = std::thread([self] {
    for (size_t left = self->pids_.size(); left > 0; --left) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, 0);
      if (pid < 0) return;
      if (self->stopping_.load()) continue;
      log::Error("trainer_rank_died pid={} status={}: the group cannot train without it; shutting down", pid, status);
      self->broken_ = true;
      ::kill(::getpid(), SIGTERM);
    }
  });
  return g;
}

TrainerGroup::~TrainerGroup() {
  stopping_ = true;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (pid_t pid : pids_) {
    while (::kill(pid, 0) == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ::kill(pid, SIGKILL);  // no-op for one that exited
  }
  if (watcher_.joinable()) watcher_.join();
}

int RunTrainerRank(const engine::EngineOptions& options) {
  const Status st = engine::Engine::RunGroupWorker(options);
  if (!st.ok()) {
    std::fprintf(stderr, "loom serve: trainer rank %d: %s\n", options.group_rank, st.message().c_str());
    return 2;
  }
  return 0;
}

}  // namespace loom::cli
