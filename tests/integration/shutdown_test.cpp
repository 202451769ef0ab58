// SIGTERM on the real `loom serve` (issue 15, defect 14): a request whose
// header was read before the signal, and one sent on a kept-alive connection
// after it, are answered (their real answer or 503 "shutting down"), never
// dropped by a silent close; the server then exits 0.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "../http/raw_connection.h"
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

}  // namespace
}  // namespace loom
