// The split deployment's gateway side in one process: two sampler replicas
// (ReplicaHandler over a FakeSampler, each on its own HttpServer) behind a
// RemoteSampler. Routing prefers the replica that has a snapshot warm, and
// the least loaded one otherwise; a replica whose server goes away has its
// calls resubmitted to the other, so none is lost; Cancel reaches the
// replica's sampler and sticks; with no replica left a call fails Unavailable
// naming the replicas. (tests/integration/replicas_test.cpp kills a real
// `loom serve --role sampler` process.)
#include <gtest/gtest.h>

#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "../service/fake_sampler.h"
#include "http/server.h"
#include "replica/remote_sampler.h"
#include "replica/replica_api.h"
#include "replica/replica_handler.h"
#include "service/future_table.h"

namespace loom {
namespace {

using namespace std::chrono_literals;

// One replica: a held-able fake sampler served on a loopback port.
struct Replica {
  explicit Replica(const std::string& key = "") : handler(sampler, futures, key, "fake-model") {
    http::ServerOptions o;
    o.poll_hold = 300ms;
    server = std::make_unique<http::HttpServer>(handler, futures, o);
    EXPECT_TRUE(server->Start().ok());
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(server->port()); }
  void Kill() { server->Stop(0ms); }

  testing::FakeSampler sampler;
  service::FutureTable futures{"replica-test"};
  replica::ReplicaHandler handler;
  std::unique_ptr<http::HttpServer> server;
};

// Callbacks' results, awaited by count.
struct Results {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Result<engine::SampleOutput>> got;
  engine::SampleCallback Callback() {
    return [this](Result<engine::SampleOutput> r) {
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(std::move(r));
      cv.notify_all();
    };
  }
  bool WaitFor(size_t n, std::chrono::milliseconds limit = 20s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return got.size() >= n; });
  }
};

// A snapshot directory as ValidateSampleCall wants it (adapter_config.json).
std::string SnapshotDir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("loom_replica_test_" + std::to_string(::getpid())) / name;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "adapter_config.json") << "{}";
  return dir.string();
}

engine::SampleCall Call(const std::string& adapter_dir, const std::string& session = "s", int32_t last = 7) {
  engine::SampleCall c;
  c.adapter_dir = adapter_dir;
  c.prompt = {1, 2, last};
  c.num_samples = 2;
  c.params.max_tokens = 3;
  c.tenant = "t";
  c.session = session;
  return c;
}

replica::RemoteOptions Options(const std::vector<const Replica*>& replicas) {
  replica::RemoteOptions o;
  for (const Replica* r : replicas) o.replicas.push_back(r->address());
  o.health_period = 50ms;
  o.health_timeout = 500ms;
  o.poll_timeout = 5s;
  o.no_replica_wait = 300ms;
  o.open_wait = 5s;
  return o;
}

void WaitUntil(const std::function<bool()>& done, std::chrono::milliseconds limit = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
}

TEST(ReplicaApi, CallsInfoAndStatsRoundTrip) {
  engine::SampleCall c = Call("/snap/x", "sess", 9);
  c.params.seed = 0xFFFFFFFFFFFFFFF1ull;
  c.params.stop_strings = {"\n\n"};
  c.params.stop_tokens = {3};
  c.params.top_k = 5;
  c.params.top_p = 0.5;
  c.params.temperature = 0.25;
  c.topk_prompt_logprobs = 4;
  c.prompt_logprobs = true;
  auto back = replica::ParseSampleCall(replica::SampleCallJson(c));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->adapter_dir, c.adapter_dir);
  EXPECT_EQ(back->prompt, c.prompt);
  EXPECT_EQ(back->params.seed, c.params.seed);
  EXPECT_EQ(back->params.max_tokens, c.params.max_tokens);
  EXPECT_EQ(back->params.stop_strings, c.params.stop_strings);
  EXPECT_EQ(back->params.stop_tokens, c.params.stop_tokens);
  EXPECT_EQ(back->params.top_k, 5);
  EXPECT_EQ(back->params.top_p, 0.5);
  EXPECT_EQ(back->params.temperature, 0.25);
  EXPECT_EQ(back->topk_prompt_logprobs, 4);
  EXPECT_TRUE(back->prompt_logprobs);
  EXPECT_EQ(back->session, "sess");
  c.params.max_tokens.reset();
  c.params.seed.reset();
  back = replica::ParseSampleCall(replica::SampleCallJson(c));
  ASSERT_TRUE(back.ok());
  EXPECT_FALSE(back->params.max_tokens.has_value());
  EXPECT_FALSE(back->params.seed.has_value());

  auto bad = replica::ParseSampleCall({{"prompt", "no"}, {"num_samples", 1}, {"params", nlohmann::json::object()}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("replica sample.prompt"), std::string::npos) << bad.status().message();

  testing::FakeSampler fake;
  auto info = replica::ParseSamplerInfo(replica::SamplerInfoJson(fake.info()));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->kv_tokens, fake.info().kv_tokens);
  EXPECT_EQ(info->max_num_samples, fake.info().max_num_samples);

  engine::SamplerStats a, b;
  a.requests_done = 3;
  a.max_rows_in_step = 4;
  a.decode_seconds = 0.5;
  b.requests_done = 2;
  b.max_rows_in_step = 9;
  b.decode_seconds = 0.25;
  const engine::SamplerStats sum = replica::AddStats(a, replica::ParseSamplerStats(replica::SamplerStatsJson(b)));
  EXPECT_EQ(sum.requests_done, 5);
  EXPECT_EQ(sum.max_rows_in_step, 9);  // a maximum stays a maximum
  EXPECT_DOUBLE_EQ(sum.decode_seconds, 0.75);
}

TEST(RemoteSampler, RoutesToTheWarmReplicaElseTheLeastLoaded) {
  Replica r0, r1;
  auto remote = replica::RemoteSampler::Open(Options({&r0, &r1}));
  ASSERT_TRUE(remote.ok()) << remote.status().message();
  const std::string x = SnapshotDir("x"), y = SnapshotDir("y");
  Results results;
  r0.sampler.Hold();
  (*remote)->Submit(Call(x), results.Callback());  // both idle: the first
  WaitUntil([&] { return r0.sampler.calls().size() == 1; });
  (*remote)->Submit(Call(y), results.Callback());  // nobody has y: the least loaded
  WaitUntil([&] { return r1.sampler.calls().size() == 1; });
  (*remote)->Submit(Call(x), results.Callback());  // x is warm on r0, busy but within a batch of the least
  (*remote)->Submit(Call(y), results.Callback());  // y is warm on r1
  ASSERT_TRUE(results.WaitFor(2));
  r0.sampler.Release();
  ASSERT_TRUE(results.WaitFor(4));
  ASSERT_EQ(r0.sampler.calls().size(), 2u);
  ASSERT_EQ(r1.sampler.calls().size(), 2u);
  EXPECT_EQ(r0.sampler.calls()[1].adapter_dir, x);
  EXPECT_EQ(r1.sampler.calls()[1].adapter_dir, y);
  for (auto& r : results.got) {
    ASSERT_TRUE(r.ok()) << r.status().message();
    ASSERT_EQ(r->sequences.size(), 2u);
    EXPECT_EQ(r->sequences[1].tokens, (std::vector<int32_t>{9, 10, 11}));  // the fake's answer, through protobuf
  }
  const replica::RoutingStats routing = (*remote)->routing();
  ASSERT_EQ(routing.replicas.size(), 2u);
  EXPECT_EQ(routing.replicas[0].routed, 2);
  EXPECT_EQ(routing.replicas[0].warm_hits, 1);
  EXPECT_EQ(routing.replicas[1].warm_hits, 1);
  EXPECT_EQ(routing.resubmitted, 0);
  // Checked up front like the in-process sampler, with its words.
  engine::SampleCall wide = Call(x);
  wide.num_samples = 17;
  EXPECT_NE((*remote)->Validate(wide).message().find("num_samples 17 must be in [1, 16]"), std::string::npos);
}

TEST(RemoteSampler, AKilledReplicasCallsAreResubmittedAndNoneIsLost) {
  Replica r0, r1;
  auto remote = replica::RemoteSampler::Open(Options({&r0, &r1}));
  ASSERT_TRUE(remote.ok()) << remote.status().message();
  const std::string x = SnapshotDir("x");
  Results results;
  r0.sampler.Hold();
  for (int32_t i = 0; i < 3; ++i) (*remote)->Submit(Call(x, "s", 20 + i), results.Callback());
  WaitUntil([&] { return r0.handler.in_flight() == 3; });
  ASSERT_EQ(r0.handler.in_flight(), 3);  // all three wait on r0, where x is warm
  EXPECT_EQ(r1.sampler.calls().size(), 0u);
  r0.Kill();
  ASSERT_TRUE(results.WaitFor(3));
  for (auto& r : results.got) {
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->sequences.size(), 2u);
  }
  EXPECT_EQ(r1.sampler.calls().size(), 3u);
  const replica::RoutingStats routing = (*remote)->routing();
  EXPECT_EQ(routing.resubmitted, 3);
  EXPECT_FALSE(routing.replicas[0].up);
  EXPECT_GE(routing.replicas[0].downs, 1);
  EXPECT_EQ(routing.replicas[0].rows_in_flight, 0);
  EXPECT_EQ(routing.replicas[1].rows_in_flight, 0);
  // Later calls go to the live one.
  (*remote)->Submit(Call(x), results.Callback());
  ASSERT_TRUE(results.WaitFor(4));
  EXPECT_TRUE(results.got.back().ok());
  EXPECT_EQ(r1.sampler.calls().size(), 4u);
}

TEST(RemoteSampler, CancelReachesTheReplicaAndSticks) {
  Replica r0;
  auto remote = replica::RemoteSampler::Open(Options({&r0}));
  ASSERT_TRUE(remote.ok()) << remote.status().message();
  Results results;
  r0.sampler.Hold();
  (*remote)->Submit(Call(SnapshotDir("x"), "gone"), results.Callback());
  WaitUntil([&] { return r0.handler.in_flight() == 1; });
  (*remote)->Cancel("gone", Status::Precondition("session 'gone' expired"));
  ASSERT_TRUE(results.WaitFor(1));
  ASSERT_FALSE(results.got[0].ok());
  EXPECT_EQ(results.got[0].status().code(), Code::kFailedPrecondition);
  EXPECT_NE(results.got[0].status().message().find("expired"), std::string::npos);
  (*remote)->Submit(Call(SnapshotDir("x"), "gone"), results.Callback());  // sticky, answered at once
  ASSERT_TRUE(results.WaitFor(2));
  EXPECT_FALSE(results.got[1].ok());
  EXPECT_EQ(r0.sampler.calls().size(), 1u);
}

TEST(RemoteSampler, WithNoReplicaLeftACallFailsUnavailableNamingThem) {
  Replica r0;
  auto remote = replica::RemoteSampler::Open(Options({&r0}));
  ASSERT_TRUE(remote.ok()) << remote.status().message();
  r0.Kill();
  Results results;
  (*remote)->Submit(Call(""), results.Callback());
  ASSERT_TRUE(results.WaitFor(1));
  ASSERT_FALSE(results.got[0].ok());
  EXPECT_EQ(results.got[0].status().code(), Code::kUnavailable);
  EXPECT_NE(results.got[0].status().message().find(r0.address()), std::string::npos)
      << results.got[0].status().message();
}

TEST(RemoteSampler, OpenRefusesUnreachableReplicasAndReplicasNeedTheirKey) {
  replica::RemoteOptions o;
  o.replicas = {"127.0.0.1:1"};
  o.open_wait = 200ms;
  auto none = replica::RemoteSampler::Open(o);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("127.0.0.1:1"), std::string::npos);
  o.replicas = {"nocolon"};
  EXPECT_FALSE(replica::RemoteSampler::Open(o).ok());

  Replica keyed("secret");
  replica::RemoteOptions wrong = Options({&keyed});
  wrong.open_wait = 300ms;
  wrong.key = "other";
  auto refused = replica::RemoteSampler::Open(wrong);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("X-Replica-Key"), std::string::npos) << refused.status().message();
  wrong.key = "secret";
  EXPECT_TRUE(replica::RemoteSampler::Open(wrong).ok());
}

}  // namespace
}  // namespace loom
