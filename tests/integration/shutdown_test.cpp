// SIGTERM on the real `loom serve` (issue 15, defect 14): a request whose
// header was read before the signal, and one sent on a kept-alive connection
// after it, are answered (their real answer or 503 "shutting down"), never
// dropped by a silent close; the server then exits 0.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "../common/temp_dir.h"
#include "../http/raw_connection.h"
#include "../store/store_test_util.h"
#include "serve_process.h"

namespace loom {
namespace {

using namespace std::chrono_literals;
using testing::RawConnection;

bool AnsweredOrShuttingDown(const std::string& response) {
  const int status = RawConnection::StatusOf(response);
  return status == 200 || (status == 503 && response.find("shutting down") != std::string::npos);
}

TEST(Shutdown, SigtermAnswersRequestsAlreadyReadAndThoseOnKeptAliveConnections) {
  const std::string data_dir =
      (std::filesystem::temp_directory_path() / ("loom_shutdown_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(data_dir);
  test::ServeProcess server(data_dir, {});
  ASSERT_NE(server.port(), 0) << "loom serve did not start: " << server.banner();
  EXPECT_NE(server.banner().find("max_connections="), std::string::npos) << server.banner();

  const std::string health = "GET /api/v1/healthz HTTP/1.1\r\nHost: t\r\n\r\n";
  RawConnection kept(server.port());
  ASSERT_TRUE(kept.Send(health));
  ASSERT_EQ(RawConnection::StatusOf(kept.ReadResponse()), 200);

  const std::string body = R"({"tags":[],"user_metadata":{},"sdk_version":"0.26.2","type":"create_session"})";
  RawConnection partial(server.port());
  ASSERT_TRUE(partial.Send("POST /api/v1/create_session HTTP/1.1\r\nHost: t\r\nX-API-Key: tml-shutdown\r\n"
                           "Content-Type: application/json\r\nContent-Length: " +
                           std::to_string(body.size()) + "\r\n\r\n" + body.substr(0, 10)));
  std::this_thread::sleep_for(300ms);  // the server has read the header
  server.Signal(SIGTERM);
  std::this_thread::sleep_for(1500ms);  // longer than any fixed grace before closing
  ASSERT_TRUE(partial.Send(body.substr(10)));
  const std::string answer = partial.ReadResponse(10s);
  EXPECT_TRUE(AnsweredOrShuttingDown(answer)) << "in-flight request: '" << answer << "'";
  ASSERT_TRUE(kept.Send(health));
  const std::string late = kept.ReadResponse(10s);
  EXPECT_TRUE(AnsweredOrShuttingDown(late)) << "kept-alive request after SIGTERM: '" << late << "'";
  EXPECT_EQ(server.Terminate(), 0);
  std::filesystem::remove_all(data_dir);
}

// A fault (here a SIGSEGV sent from outside, as a crash would raise it)
// leaves the signal and the stack on stderr, and the process still ends by
// that signal (a core or a supervisor sees what it would have seen).
TEST(Shutdown, FatalSignalWritesTheStackAndEndsByTheSignal) {
  using store::testing::ReadFile;
  const test::TempDir dir("loom_fatal");
  const std::string data_dir = dir / "data", log = dir / "serve.log";
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    execl(LOOM_BINARY, LOOM_BINARY, "serve", "--host", "127.0.0.1", "--port", "0", "--data-dir", data_dir.c_str(),
          "--device", "cpu", static_cast<char*>(nullptr));
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (ReadFile(log).find("listening on") == std::string::npos && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(100ms);
  ASSERT_NE(ReadFile(log).find("listening on"), std::string::npos) << ReadFile(log);
  kill(pid, SIGSEGV);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV) << "status " << status;
  const std::string text = ReadFile(log);
  const auto at = text.find("loom: fatal signal 11; stack:\n");
  ASSERT_NE(at, std::string::npos) << text;
  EXPECT_NE(text.find("loom(", at), std::string::npos) << "frames of the binary follow: " << text.substr(at);
}

}  // namespace
}  // namespace loom
