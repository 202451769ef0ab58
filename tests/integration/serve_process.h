// ServeProcess: the real `loom serve` binary (LOOM_BINARY) as a child process
// on an ephemeral loopback port, for end-to-end tests. The constructor waits
// for the "listening on http://127.0.0.1:PORT" banner (port() is 0 if it never
// came); the destructor kills a server that is still running. Metric() reads
// one series of its /metrics text.
#pragma once
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <string>
#include <vector>

namespace loom::test {

class ServeProcess {
 public:
  // Runs `loom serve --host 127.0.0.1 --port 0 --data-dir DIR --poll-hold 2
  // --device cpu EXTRA...`.
  ServeProcess(const std::string& data_dir, const std::vector<std::string>& extra) {
    int out[2];
    if (pipe(out) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      close(out[1]);
      std::vector<std::string> args = {LOOM_BINARY, "serve",       "--host",   "127.0.0.1", "--port", "0",
                                       "--data-dir", data_dir,     "--poll-hold", "2",      "--device", "cpu"};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(LOOM_BINARY, argv.data());
      _exit(127);
    }
    close(out[1]);
    // First stdout line: "loom serve: listening on http://127.0.0.1:PORT ..."
    std::string line;
    pollfd pfd{out[0], POLLIN, 0};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (line.find('\n') == std::string::npos && std::chrono::steady_clock::now() < deadline) {
      if (poll(&pfd, 1, 500) > 0) {
        char buf[512];
        const ssize_t n = read(out[0], buf, sizeof buf);
        if (n <= 0) break;
        line.append(buf, static_cast<size_t>(n));
      }
    }
    close(out[0]);
    const std::string marker = "http://127.0.0.1:";
    const auto pos = line.find(marker);
    if (pos != std::string::npos) port_ = static_cast<uint16_t>(std::stoi(line.substr(pos + marker.size())));
    banner_ = line;
  }
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;
  ~ServeProcess() {
    if (pid_ > 0 && !stopped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  uint16_t port() const { return port_; }
  const std::string& banner() const { return banner_; }

  // Sends sig without waiting (Terminate() then collects the exit).
  void Signal(int sig) { kill(pid_, sig); }

  // SIGTERM, then waits; returns the exit status (or -1 if it did not exit).
  int Terminate() {
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    stopped_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_ = -1;
  uint16_t port_ = 0;
  bool stopped_ = false;
  std::string banner_;
};

// The value of one series (name with its labels, as written) in /metrics
// text; -1 when it is absent.
inline double Metric(const std::string& text, const std::string& series) {
  std::smatch m;
  const std::regex re("\n" + std::regex_replace(series, std::regex(R"([{}"\\])"), R"(\$&)") + " ([0-9.eE+-]+)\n");
  return std::regex_search(text, m, re) ? std::stod(m[1]) : -1;
}

}  // namespace loom::test
