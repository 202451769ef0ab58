// The gateway under a hostile or careless client (issue 15): heavy bodies
// must not stall health and polls, the accept loop must not spin at the fd
// limit, connections are capped, ambiguous requests are refused, a wrong
// method is 405, Stop answers what it read, and /metrics shows a tenant only
// its own models.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/time.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>

#include "gateway_fixture.h"
#include "raw_connection.h"
#include "service/metrics.h"

namespace loom::http {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using testing::kAlice;
using testing::kBob;
using testing::RawConnection;
using testing::Reply;
using Clock = std::chrono::steady_clock;

constexpr const char* kCarol = "tml-carol-key";

// Validation of forward_backward waits at a gate until the test opens it
// (or 5 s pass): a decode that takes as long as the test wants.
class GatedEngine : public testing::FakeEngine {
 public:
  Status ValidateForwardBackward(const engine::ForwardBackwardCall& call) const override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++entered_;
      cv_.notify_all();
      cv_.wait_for(lock, 5s, [&] { return open_; });
    }
    return FakeEngine::ValidateForwardBackward(call);
  }
  // True once n validations are waiting at the gate.
  bool WaitEntered(int n) const {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, 5s, [&] { return entered_ >= n; });
  }
  int entered() const {
    std::lock_guard<std::mutex> lock(mu_);
    return entered_;
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable int entered_ = 0;
  bool open_ = false;
};

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

class AbuseTest : public testing::GatewayFixture {
 protected:
  // A gateway whose forward_backward validation waits at gate_.
  void StartGated() {
    make_engine_ = [this] {
      auto e = std::make_unique<GatedEngine>();
      gate_ = e.get();
      return std::unique_ptr<testing::FakeEngine>(std::move(e));
    };
    StartGateway("loom_http_abuse_", /*with_sampler=*/false);
  }
  void TearDown() override {
    if (gate_) gate_->Open();
    GatewayFixture::TearDown();
  }
  // create_model's request id once it is done (a finished future to poll).
  std::pair<std::string, std::string> ModelAndDoneFuture(const char* key = kAlice) {
    Json sub = PostOk("create_model", {{"session_id", Session(key)}, {"model_seq_id", 0},
                                       {"base_model", "test/base"}, {"lora_config", {{"rank", 4}}},
                                       {"type", "create_model"}}, key);
    Json done = Json::parse(Retrieve(sub["request_id"], key).body);
    return {done.value("model_id", ""), sub["request_id"]};
  }
  // A zstd forward_backward on its own connection, in a thread.
  std::thread SendFb(const std::string& model, int seq, const char* key, Reply* out) {
    return std::thread([this, model, seq, key, out] {
      testing::HttpClient client("127.0.0.1", server_->port());
      *out = client.Call("POST", "/api/v1/forward_backward", wire::ZstdCompress(FbBody(model, seq)),
                         {{"X-API-Key", key}, {"Content-Type", "application/x-protobuf"},
                          {"Content-Encoding", "zstd"}});
    });
  }
  std::string Raw(const std::string& request) {
    RawConnection c(server_->port());
    EXPECT_TRUE(c.ok());
    c.Send(request);
    return c.ReadResponse();
  }

  GatedEngine* gate_ = nullptr;
};

// Defect 5: decoding (zstd, protobuf, validation) held both I/O threads.
TEST_F(AbuseTest, HealthAndPollsAnswerWhileAsManyBodiesAsIoThreadsDecode) {
  server_opt_.io_threads = 2;
  StartGated();
  auto [model, done] = ModelAndDoneFuture();
  Reply fb1, fb2;
  std::thread t1 = SendFb(model, 1, kAlice, &fb1);
  std::thread t2 = SendFb(model, 2, kAlice, &fb2);
  ASSERT_TRUE(gate_->WaitEntered(2));  // two decodes in progress, as many as I/O threads

  auto t0 = Clock::now();
  Reply health = client_->Call("GET", "/api/v1/healthz");
  const auto health_time = Clock::now() - t0;
  t0 = Clock::now();
  Reply poll = client_->Call("POST", "/api/v1/retrieve_future", Json{{"request_id", done}}.dump(),
                             {{"X-API-Key", kAlice}});
  const auto poll_time = Clock::now() - t0;
  EXPECT_EQ(health.status, 200);
  EXPECT_LT(health_time, 1s) << "healthz waited for the decodes";
  EXPECT_EQ(poll.status, 200) << poll.body;
  EXPECT_EQ(Json::parse(poll.body, nullptr, false).value("type", ""), "create_model") << poll.body;
  EXPECT_LT(poll_time, 1s) << "retrieve_future waited for the decodes";

  gate_->Open();
  t1.join();
  t2.join();
  EXPECT_EQ(fb1.status, 200) << fb1.body;
  EXPECT_EQ(fb2.status, 200) << fb2.body;
}

TEST_F(AbuseTest, AFullDecodeQueueAnswersRetryably503AndOneTenantGetsHalfOfIt) {
  server_opt_.decode_threads = 1;
  server_opt_.decode_queue = 2;  // one tenant: 1
  StartGated();
  auto [alice_model, a_done] = ModelAndDoneFuture(kAlice);
  auto [bob_model, b_done] = ModelAndDoneFuture(kBob);
  Reply a1, b1;
  std::thread ta = SendFb(alice_model, 1, kAlice, &a1);
  ASSERT_TRUE(gate_->WaitEntered(1));
  // Alice's second heavy request: over her share, 429 at once.
  Reply a2 = PostFb(FbBody(alice_model, 2), kAlice, /*zstd=*/true);
  ExpectJsonError(a2, 429, "--decode-queue");
  EXPECT_EQ(a2.headers["Retry-After"], "1");
  // Bob still gets in (queued behind Alice's), then the queue is full.
  std::thread tb = SendFb(bob_model, 1, kBob, &b1);
  const auto deadline = Clock::now() + 5s;
  Reply c1;
  do {  // until Bob's request holds the second place
    std::this_thread::sleep_for(20ms);
    c1 = PostFb(FbBody("x", 1), kCarol, /*zstd=*/true);
  } while (c1.status != 503 && Clock::now() < deadline);
  ExpectJsonError(c1, 503, "--decode-queue");
  EXPECT_EQ(c1.headers["Retry-After"], "1");
  EXPECT_EQ(Json::parse(c1.body)["category"], "server");
  EXPECT_EQ(client_->Call("GET", "/api/v1/healthz").status, 200);

  gate_->Open();
  ta.join();
  tb.join();
  EXPECT_EQ(a1.status, 200) << a1.body;
  EXPECT_EQ(b1.status, 200) << b1.body;
  EXPECT_EQ(gate_->entered(), 2);  // the refused ones were never decoded
}

// Requests hop onto the decode pool and back onto their connection's strand
// thousands of times, from several tenants at once (this once crashed).
TEST_F(AbuseTest, ConcurrentHeavyRequestsOfSeveralTenantsAreAllAnswered) {
  StartGateway("loom_http_abuse_", /*with_sampler=*/false);
  std::vector<std::thread> tenants;
  std::atomic<int> answered{0};
  for (int t = 0; t < 4; ++t) {  // the FakeEngine's 4 slots
    tenants.emplace_back([&, t] {
      const std::string key = "tml-tenant-" + std::to_string(t);
      const std::string model = ModelAndDoneFuture(key.c_str()).first;
      testing::HttpClient client("127.0.0.1", server_->port());
      for (int seq = 1; seq <= 100; ++seq) {
        Reply sub = client.Call("POST", "/api/v1/forward_backward", wire::ZstdCompress(FbBody(model, seq)),
                                {{"X-API-Key", key}, {"Content-Type", "application/x-protobuf"},
                                 {"Content-Encoding", "zstd"}});
        ASSERT_EQ(sub.status, 200) << sub.body;
        Reply done = testing::RetrieveFuture(client, key, Json::parse(sub.body)["request_id"], /*proto=*/true, 50);
        ASSERT_EQ(done.status, 200);
        ++answered;
      }
    });
  }
  for (auto& t : tenants) t.join();
  EXPECT_EQ(answered, 400);
}

// Defect 9: at EMFILE, accept failed at once and was retried at once.
TEST_F(AbuseTest, AtTheFdLimitTheAcceptLoopPausesAndServesAgainWhenFdsFree) {
  StartGateway("loom_http_abuse_", /*with_sampler=*/false);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  size_t open_now = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++open_now;
  rlimit low = old;
  low.rlim_cur = open_now + 64;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  struct Restore {
    rlimit r;
    ~Restore() { setrlimit(RLIMIT_NOFILE, &r); }
  } restore{old};

  // Connections until this process (client and server side) is out of fds;
  // the last ones wait in the listen backlog, their requests sent.
  std::vector<std::unique_ptr<RawConnection>> conns;
  for (int i = 0; i < 200; ++i) {
    auto c = std::make_unique<RawConnection>(server_->port());
    if (!c->ok()) {
      ASSERT_EQ(c->error(), EMFILE);
      break;
    }
    c->Send("GET /api/v1/healthz HTTP/1.1\r\nHost: t\r\n\r\n");
    conns.push_back(std::move(c));
  }
  ASSERT_GT(conns.size(), 5u);
  std::this_thread::sleep_for(200ms);  // the server's accept is now failing with EMFILE
  const double cpu0 = ProcessCpuSeconds();
  std::this_thread::sleep_for(1s);
  const double cpu = ProcessCpuSeconds() - cpu0;
  EXPECT_LT(cpu, 0.25) << "CPU seconds used in 1 s at the fd limit: the accept loop spins";

  // Free fds: every waiting connection gets its answer.
  const size_t keep = 5;
  conns.erase(conns.begin(), conns.end() - keep);
  for (auto& c : conns) {
    EXPECT_EQ(RawConnection::StatusOf(c->ReadResponse(5s)), 200);
  }
  conns.clear();
  EXPECT_EQ(client_->Call("GET", "/api/v1/healthz").status, 200);
}

TEST_F(AbuseTest, ConnectionsOverTheCapAre503AndServedAgainWhenOneCloses) {
  server_opt_.max_connections = 3;
  StartGateway("loom_http_abuse_", /*with_sampler=*/false);
  EXPECT_EQ(server_->max_connections(), 3);
  std::vector<std::unique_ptr<RawConnection>> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::make_unique<RawConnection>(server_->port()));
    held.back()->Send("GET /api/v1/healthz HTTP/1.1\r\nHost: t\r\n\r\n");
    ASSERT_EQ(RawConnection::StatusOf(held.back()->ReadResponse()), 200);  // and stays open
  }
  Reply over = client_->Call("GET", "/api/v1/healthz");
  ExpectJsonError(over, 503, "--max-connections");
  EXPECT_EQ(over.headers["Retry-After"], "1");
  held.pop_back();
  Reply again;
  for (int i = 0; i < 100 && again.status != 200; ++i) {
    std::this_thread::sleep_for(10ms);
    again = client_->Call("GET", "/api/v1/healthz");
  }
  EXPECT_EQ(again.status, 200);
}

TEST_F(AbuseTest, TheConnectionCapLeavesDescriptorsForTheStore) {
  StartGateway("loom_http_abuse_", /*with_sampler=*/false);
  rlimit now{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &now), 0);
  if (now.rlim_cur != RLIM_INFINITY) {
    EXPECT_LE(static_cast<rlim_t>(server_->max_connections()) + kReservedFds, now.rlim_cur);
  }
  EXPECT_EQ(ConnectionCapWithin(1024, 100000), 1024);
  EXPECT_EQ(ConnectionCapWithin(1024, 1024), 1024 - kReservedFds);
  EXPECT_EQ(ConnectionCapWithin(1024, 200), 100);  // a tiny limit: half of it
  EXPECT_GE(ConnectionCapWithin(1024, 1), 1);
}

// Defect 14: the last X-API-Key won.
TEST_F(AbuseTest, TwoApiKeyHeadersAreRefusedNamingTheHeader) {
  StartGateway("loom_http_abuse_", /*with_sampler=*/false);
  const std::string body = Json{{"tags", Json::array()}, {"user_metadata", Json::object()}}.dump();
  const std::string res = Raw("POST /api/v1/create_session HTTP/1.1\r\nHost: t\r\nX-API-Key: " + std::string(kAlice) +
                              "\r\nX-API-Key: " + kBob + "\r\nContent-Type: application/json\r\nContent-Length: " +
                              std::to_string(body.size()) + "\r\n\r\n" + body);
  EXPECT_EQ(RawConnection::StatusOf(res), 400) << res;
  EXPECT_NE(RawConnection::BodyOf(res).find("X-API-Key"), std::string::npos) << res;
  EXPECT_TRUE(Json::parse(RawConnection::BodyOf(res), nullptr, false).contains("error")) << res;
}

// Defect 14: Content-Length then chunked closed the connection unanswered.
TEST_F(AbuseTest, ContentLengthWithChunkedIs400EitherOrder) {
  StartGateway("loom_http_abuse_", /*with_sampler=*/false);
  const std::string head = "POST /api/v1/create_session HTTP/1.1\r\nHost: t\r\nX-API-Key: " + std::string(kAlice) +
                           "\r\nContent-Type: application/json\r\n";
  const std::string chunked_body = "2\r\n{}\r\n0\r\n\r\n";
  for (const std::string& framing : {std::string("Content-Length: 12\r\nTransfer-Encoding: chunked\r\n"),
                                     std::string("Transfer-Encoding: chunked\r\nContent-Length: 12\r\n")}) {
    const std::string res = Raw(head + framing + "\r\n" + chunked_body);
    EXPECT_EQ(RawConnection::StatusOf(res), 400) << framing << res;
    EXPECT_NE(res.find("Transfer-Encoding"), std::string::npos) << res;
  }
  EXPECT_EQ(client_->Call("GET", "/api/v1/healthz").status, 200);
}

// Defect 14: a wrong method on a route that exists was 404.
TEST_F(AbuseTest, AWrongMethodIs405WithAllow) {
  StartGateway("loom_http_abuse_", /*with_sampler=*/false);
  struct Case {
    const char* method;
    std::string target;
    const char* allow;
  };
  const std::string ckpt = "/api/v1/training_runs/r/checkpoints/weights/a";
  const std::vector<Case> cases = {
      {"GET", "/api/v1/create_session", "POST"},
      {"GET", "/api/v1/forward_backward", "POST"},
      {"PUT", "/api/v1/retrieve_future", "POST"},
      {"POST", "/api/v1/get_server_capabilities", "GET"},
      {"DELETE", "/api/v1/samplers/s:sample:0", "GET"},
      {"POST", "/api/v1/training_runs", "GET"},
      {"DELETE", "/api/v1/training_runs/r", "GET"},
      {"POST", "/api/v1/training_runs/r/checkpoints", "GET"},
      {"GET", ckpt, "DELETE"},
      {"POST", ckpt + "/archive", "GET"},
      {"PUT", ckpt + "/publish", "POST, DELETE"},
      {"GET", ckpt + "/ttl", "PUT"},
      {"DELETE", "/api/v1/checkpoints", "GET"},
      {"POST", "/api/v1/sessions", "GET"},
      {"GET", "/api/v1/sessions/s/project", "PUT"},
      {"POST", "/api/v1/archives/token", "GET"},
      {"POST", "/metrics", "GET"},
  };
  for (const Case& c : cases) {
    Reply r = client_->Call(c.method, c.target, "", {{"X-API-Key", kAlice}});
    ExpectJsonError(r, 405, c.method);
    EXPECT_EQ(r.headers["Allow"], c.allow) << c.method << " " << c.target;
  }
  // The allowed methods reach their handlers (unknown ids: 404, not "no such route").
  for (const Case& c : cases) {
    const std::string allow = c.allow;
    const std::string method = allow.substr(0, allow.find(','));
    Reply r = client_->Call(method, c.target, method == "GET" || method == "DELETE" ? "" : "{}",
                            {{"X-API-Key", kAlice}});
    EXPECT_NE(r.status, 405) << method << " " << c.target << ": " << r.body;
    EXPECT_EQ(r.body.find("no such route"), std::string::npos) << method << " " << c.target << ": " << r.body;
  }
  ExpectJsonError(client_->Call("GET", "/api/v1/no_such_thing", "", {{"X-API-Key", kAlice}}), 404, "no such route");
  // A bare checkpoint id names the missing kind prefix (issue 22, item 6).
  ExpectJsonError(client_->Call("DELETE", "/api/v1/training_runs/r/checkpoints/ckpt-1", "", {{"X-API-Key", kAlice}}),
                  400, "'weights/ckpt-1' or 'sampler_weights/ckpt-1'");
}

// Defect 14: Stop dropped a request it had begun reading.
TEST_F(AbuseTest, StopAnswersARequestWhoseBodyWasStillArriving) {
  StartGateway("loom_http_abuse_", /*with_sampler=*/false);
  const std::string body = Json{{"tags", Json::array()}, {"user_metadata", Json::object()}}.dump();
  RawConnection c(server_->port());
  ASSERT_TRUE(c.ok());
  c.Send("POST /api/v1/create_session HTTP/1.1\r\nHost: t\r\nX-API-Key: " + std::string(kAlice) +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" +
         body.substr(0, 5));
  std::this_thread::sleep_for(100ms);  // the server has read the header
  std::thread stopper([&] { server_->Stop(100ms); });
  std::this_thread::sleep_for(700ms);  // past the grace
  c.Send(body.substr(5));
  const std::string res = c.ReadResponse(5s);
  stopper.join();
  ASSERT_FALSE(res.empty()) << "the connection closed without an answer";
  const int status = RawConnection::StatusOf(res);
  EXPECT_TRUE(status == 200 || (status == 503 && res.find("shutting down") != std::string::npos)) << res;
}

// Defect 10: /metrics listed every tenant's model ids to anyone. (With
// --admin-key it is the admin's alone: usage_http_test.cpp.)
TEST_F(AbuseTest, MetricsShowATenantOnlyItsOwnModels) {
  StartGateway("loom_http_abuse_", /*with_sampler=*/false);
  const std::string a = ModelAndDoneFuture(kAlice).first;
  const std::string b = ModelAndDoneFuture(kBob).first;
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  auto scrape = [&](const char* key) {
    std::vector<std::pair<std::string, std::string>> h;
    if (key) h.emplace_back("X-API-Key", key);
    return client_->Call("GET", "/metrics", "", h);
  };
  Reply anon = scrape(nullptr);
  ASSERT_EQ(anon.status, 200);
  EXPECT_NE(anon.body.find("\nloom_slots_in_use 2\n"), std::string::npos) << anon.body;  // aggregates stay public
  EXPECT_EQ(anon.body.find("model_id="), std::string::npos) << anon.body;
  EXPECT_EQ(anon.body.find(a), std::string::npos);

  Reply alice = scrape(kAlice);
  ASSERT_EQ(alice.status, 200);
  EXPECT_NE(alice.body.find("model_id=\"" + a + "\""), std::string::npos) << alice.body;
  EXPECT_EQ(alice.body.find(b), std::string::npos) << alice.body;
  Reply bob = scrape(kBob);
  EXPECT_NE(bob.body.find("model_id=\"" + b + "\""), std::string::npos) << bob.body;
  EXPECT_EQ(bob.body.find(a), std::string::npos) << bob.body;
  EXPECT_EQ(scrape("not-a-tml-key").status, 401);
}

TEST(MetricsVisibility, KeepModelSeriesDropsOnlyTheRefusedModelsLines) {
  const std::string text =
      "# HELP loom_queue_depth Requests.\n# TYPE loom_queue_depth gauge\n"
      "loom_queue_depth{model_id=\"a:train:0\"} 1\n"
      "loom_queue_depth{model_id=\"b\\\"x:train:0\"} 2\n"
      "loom_queue_wait_seconds_sum{model_id=\"b\\\"x:train:0\"} 0.5\n"
      "loom_slots_in_use 2\n";
  std::vector<std::string> asked;
  const std::string kept = service::Metrics::KeepModelSeries(text, [&](const std::string& m) {
    asked.push_back(m);
    return m == "a:train:0";
  });
  EXPECT_EQ(kept,
            "# HELP loom_queue_depth Requests.\n# TYPE loom_queue_depth gauge\n"
            "loom_queue_depth{model_id=\"a:train:0\"} 1\nloom_slots_in_use 2\n");
  EXPECT_EQ(asked, (std::vector<std::string>{"a:train:0", "b\"x:train:0"}));  // once per model, unescaped
}

}  // namespace
}  // namespace loom::http
