// The split deployment end to end on real processes: three `loom serve --role
// sampler` replicas and a gateway (`loom serve --sampler-replicas`) on the
// embedded tiny qwen3, CPU. Tenants train and save snapshots on the
// gateway; the replicas load them from the gateway's data dir. Every sampled
// token's logprob equals the trainer's; each snapshot is loaded by one
// replica only (calls go where it is warm). Then the replica holding eight
// calls (in its admission window) is SIGKILLed: every call is still
// answered, by another replica, with the tokens the same seed gave before.
// Then the replica that took them over hangs (SIGSTOP): the same again. With
// one replica left, training, saving and sampling go on.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "../http/test_client.h"
#include "serve_process.h"
#include "tenant_client.h"
#include "wire/sample.h"

namespace loom {
namespace {

using Json = nlohmann::json;
using namespace std::chrono_literals;

// A replica's /replica/v1/health.
Json Health(uint16_t port) {
  auto reply = testing::HttpClient("127.0.0.1", port).Call("GET", "/replica/v1/health");
  return reply.status == 200 ? Json::parse(reply.body) : Json();
}

int64_t Stat(uint16_t port, const char* name) {
  const Json h = Health(port);
  return h.is_object() ? h["stats"].value(name, int64_t{-1}) : -1;
}

TEST(SamplerReplicas, AGatewayLosesNoSampleWhenAReplicaIsKilled) {
  const std::string data_dir =
      (std::filesystem::temp_directory_path() / ("loom_replicas_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(data_dir);
  // The first replica writes the embedded default model; the others read it.
  // A one-second admission window holds each replica's calls a while (so the
  // kill below finds them in flight).
  const std::vector<std::string> replica_flags = {"--role", "sampler", "--batch-window-ms", "400"};
  test::ServeProcess r0(data_dir, replica_flags);
  ASSERT_NE(r0.port(), 0) << "no banner: " << r0.banner();
  EXPECT_NE(r0.banner().find("role=sampler"), std::string::npos) << r0.banner();
  const std::string model = data_dir + "/default-model";
  auto with_model = replica_flags;
  with_model.insert(with_model.end(), {"--model", model});
  test::ServeProcess r1(data_dir, with_model), r2(data_dir, with_model);
  ASSERT_NE(r1.port(), 0) << "no banner: " << r1.banner();
  ASSERT_NE(r2.port(), 0) << "no banner: " << r2.banner();
  std::vector<test::ServeProcess*> all = {&r0, &r1, &r2};
  std::string replicas;
  for (auto* r : all) replicas += (replicas.empty() ? "" : ",") + ("127.0.0.1:" + std::to_string(r->port()));
  test::ServeProcess gateway(data_dir, {"--model", model, "--model-name", "loom/tiny-qwen3", "--sampler-replicas",
                                        replicas, "--max-adapters", "3", "--batch-window-ms", "0"});
  ASSERT_NE(gateway.port(), 0) << "no banner: " << gateway.banner();
  EXPECT_NE(gateway.banner().find("role=gateway"), std::string::npos) << gateway.banner();

  test::TenantClient a(gateway.port(), "tml-tenant-a"), b(gateway.port(), "tml-tenant-b");
  a.Start();
  b.Start();
  for (int step = 0; step < 2; ++step) {
    a.TrainStep(step);
    b.TrainStep(step + 10);
  }
  const std::string sa = a.SaveForSampling(), sb = b.SaveForSampling();
  const std::vector<int32_t> prompt = {5, 17, 42, 9};
  // The sampled logprobs are the trainer's: the replicas read the right snapshots.
  const wire::SampleResult ra = a.Sample(sa, prompt, 6, 2, 1234);
  const wire::SampleResult rb = b.Sample(sb, prompt, 6, 2, 1234);
  a.ExpectConsistent(prompt, ra, "tenant a");
  b.ExpectConsistent(prompt, rb, "tenant b");
  // Again on each: the version is warm where it was loaded, so each
  // snapshot was read from disk once, by one replica.
  a.Sample(sa, prompt, 6, 2, 99);
  b.Sample(sb, prompt, 6, 2, 99);
  EXPECT_EQ(Stat(r0.port(), "adapter_loads") + Stat(r1.port(), "adapter_loads") + Stat(r2.port(), "adapter_loads"), 2);

  // Eight calls on A's snapshot, references first (same seeds, answered
  // before the kill).
  constexpr int kCalls = 8;
  std::vector<wire::SampleResult> expected(kCalls);
  for (int i = 0; i < kCalls; ++i) expected[i] = a.Sample(sa, prompt, 8, 2, 500 + i);
  // Sends the calls; once one replica holds some, `fault` is done to it;
  // every call must still be answered with its reference tokens, and some
  // other replica must have answered more than before.
  const auto survive = [&](int fault, const std::string& what) {
    std::vector<Json> bodies;  // distinct seq_ids on A's sampling session
    for (int i = 0; i < kCalls; ++i) bodies.push_back(a.SampleBody(sa, prompt, 8, 2, 500 + i));
    std::map<uint16_t, int64_t> done_before;
    for (auto* r : all) done_before[r->port()] = Stat(r->port(), "requests_done");
    std::vector<wire::SampleResult> got(kCalls);
    std::vector<std::thread> clients;
    for (int i = 0; i < kCalls; ++i) {
      clients.emplace_back([&, i] {
        test::TenantClient client(gateway.port(), "tml-tenant-a");
        const Json sub = client.PostOk("asample", bodies[i]);
        auto out = wire::DecodeSampleResponse(client.Retrieve(sub.value("request_id", ""), true).body);
        if (out.ok()) got[i] = *out;
      });
    }
    // The calls wait in the admission window of the replica that has A's
    // snapshot warm.
    test::ServeProcess* victim = nullptr;
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (victim == nullptr && std::chrono::steady_clock::now() < deadline) {
      for (auto* r : all) {
        const Json h = Health(r->port());
        if (h.is_object() && h.value("in_flight", 0) >= 1) victim = r;
      }
      if (victim == nullptr) std::this_thread::sleep_for(2ms);
    }
    ASSERT_NE(victim, nullptr) << what << ": no replica ever held a call";
    victim->Signal(fault);
    for (auto& t : clients) t.join();
    for (int i = 0; i < kCalls; ++i) {
      ASSERT_EQ(got[i].sequences.size(), 2u) << what << ": call " << i;
      for (size_t s = 0; s < 2; ++s) {
        EXPECT_EQ(got[i].sequences[s].tokens, expected[i].sequences[s].tokens) << what << ": call " << i;
      }
    }
    all.erase(std::find(all.begin(), all.end(), victim));
    int64_t answered_elsewhere = 0;
    for (auto* r : all) answered_elsewhere += Stat(r->port(), "requests_done") - done_before[r->port()];
    EXPECT_GT(answered_elsewhere, 0) << what;
  };
  survive(SIGKILL, "a killed replica");
  // A hung replica (stopped, its port still accepting) misses its health
  // checks (2 s): it is marked down and its calls go elsewhere.
  survive(SIGSTOP, "a hung replica");
  // The gateway's /metrics say so: one replica of three live, every held call resubmitted.
  const std::string metrics = testing::HttpClient("127.0.0.1", gateway.port()).Call("GET", "/metrics").body;
  EXPECT_EQ(test::Metric(metrics, "loom_sampler_replicas"), 3) << metrics;
  EXPECT_EQ(test::Metric(metrics, "loom_sampler_replicas_live"), 1) << metrics;
  EXPECT_GE(test::Metric(metrics, "loom_sampler_resubmitted_total"), 2) << metrics;

  // Training, a new snapshot and its samples go on with one replica.
  a.TrainStep(7);
  const std::string sa2 = a.SaveForSampling();
  a.ExpectConsistent(prompt, a.Sample(sa2, prompt, 6, 2, 5), "tenant a after the kill");
  EXPECT_EQ(gateway.Terminate(), 0);
  for (auto* r : {&r0, &r1, &r2}) r->Signal(SIGCONT);  // the stopped one, so that it can be killed
  std::filesystem::remove_all(data_dir);
}

}  // namespace
}  // namespace loom
