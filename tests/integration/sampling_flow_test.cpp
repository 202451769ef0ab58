// End to end sampling on the real `loom serve` (embedded tiny qwen3, CPU,
// fp32): two tenants train a few cross_entropy steps, save unnamed sampler
// snapshots (save_weights_and_get_sampling_client) and sample from them while
// a third tenant keeps training. Each sampled token's logprob must equal the
// trainer's forward_only logprob of the same tokens on the same adapter
// (1e-4). With --sampler-adapters 1 the two snapshots evict each other, and a
// re-sample with the same seed after eviction gives the same tokens. The
// context window W (--context-window) gives 400s for long data and prompts.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "../http/test_client.h"
#include "serve_process.h"
#include "tenant_client.h"
#include "wire/forward_backward.h"
#include "wire/sample.h"

namespace loom {
namespace {

using Json = nlohmann::json;
using namespace std::chrono_literals;

constexpr int kWindow = 40;  // --context-window

// `loom serve` with a one-adapter sampler cache (so tenants evict each other)
// and a small context window.
class SamplingServer : public test::ServeProcess {
 public:
  explicit SamplingServer(const std::string& data_dir)
      : ServeProcess(data_dir, {"--max-adapters", "3", "--max-rank", "8", "--sampler-adapters", "1",
                                "--kv-budget-tokens", "4096", "--context-window", std::to_string(kWindow)}) {}
};

TEST(SamplingFlow, TwoTenantsSampleTheirSnapshotsWhileAThirdTrains) {
  const std::string data_dir =
      (std::filesystem::temp_directory_path() / ("loom_sampling_flow_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(data_dir);
  SamplingServer server(data_dir);
  ASSERT_NE(server.port(), 0) << "no listening banner: " << server.banner();

  test::TenantClient a(server.port(), "tml-tenant-a"), b(server.port(), "tml-tenant-b"), c(server.port(), "tml-tenant-c");
  a.Start();
  b.Start();
  c.Start();
  for (int step = 0; step < 3; ++step) {
    a.TrainStep(step);
    b.TrainStep(step + 10);
  }
  const std::string sa = a.SaveForSampling(), sb = b.SaveForSampling();
  ASSERT_EQ(sa, a.session() + ":sample:0");
  ASSERT_EQ(sb, b.session() + ":sample:0");

  // The third tenant trains until the samplers are done.
  std::atomic<bool> done{false};
  std::atomic<int> c_steps{0};
  std::thread trainer([&] {
    while (!done.load()) {
      c.TrainStep(c_steps.load() + 20);
      c_steps.fetch_add(1);
    }
  });

  const std::vector<int32_t> prompt = {5, 17, 42, 9};
  wire::SampleResult ra, rb;
  std::thread ta([&] { ra = a.Sample(sa, prompt, 6, 2, 1234); });
  std::thread tb([&] { rb = b.Sample(sb, prompt, 6, 2, 1234); });
  ta.join();
  tb.join();
  ASSERT_EQ(ra.sequences.size(), 2u);
  ASSERT_EQ(rb.sequences.size(), 2u);
  // Same seed and prompt, different adapters: different distributions.
  bool differ = false;
  for (size_t i = 0; i < 2; ++i) {
    differ |= ra.sequences[i].tokens != rb.sequences[i].tokens || ra.sequences[i].logprobs != rb.sequences[i].logprobs;
  }
  EXPECT_TRUE(differ);

  // B's snapshot evicted A's (one cache slot): A re-samples the same tokens.
  wire::SampleResult ra2 = a.Sample(sa, prompt, 6, 2, 1234);
  ASSERT_EQ(ra2.sequences.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(ra2.sequences[i].tokens, ra.sequences[i].tokens) << "sample " << i;
    for (size_t j = 0; j < ra.sequences[i].logprobs.size() && j < ra2.sequences[i].logprobs.size(); ++j) {
      EXPECT_NEAR(ra2.sequences[i].logprobs[j], ra.sequences[i].logprobs[j], 1e-5);
    }
  }
  done = true;
  trainer.join();
  EXPECT_GE(c_steps.load(), 1);

  // The trainer agrees with the sampler on every sampled token (A and B stopped training at their snapshots).
  a.ExpectConsistent(prompt, ra, "tenant a");
  b.ExpectConsistent(prompt, rb, "tenant b");

  // compute_logprobs: prompt logprobs equal the trainer's on the same adapter.
  Json sub = a.PostOk("asample", [&] {
    Json body = a.SampleBody(sa, prompt, 1, 1, 1);
    body["prompt_logprobs"] = true;
    return body;
  }());
  auto cl = wire::DecodeSampleResponse(a.Retrieve(sub["request_id"], true).body);
  ASSERT_TRUE(cl.ok());
  ASSERT_TRUE(cl->prompt_logprobs.has_value());
  ASSERT_EQ(cl->prompt_logprobs->size(), prompt.size());
  EXPECT_TRUE(std::isnan((*cl->prompt_logprobs)[0]));
  std::vector<float> lp = a.Forward({prompt.begin(), prompt.end() - 1}, {prompt.begin() + 1, prompt.end()}, true);
  ASSERT_EQ(lp.size(), prompt.size() - 1);
  for (size_t t = 1; t < prompt.size(); ++t) EXPECT_NEAR((*cl->prompt_logprobs)[t], lp[t - 1], 1e-4) << t;

  // Tenant isolation: B cannot sample on A's sampling session or open A's snapshot.
  EXPECT_EQ(b.Post("asample", b.SampleBody(sa, prompt, 2, 1, 1)).status, 404);
  auto get = testing::HttpClient("127.0.0.1", server.port())
                 .Call("GET", "/api/v1/samplers/" + sa, "", {{"X-API-Key", "tml-tenant-a"}});
  ASSERT_EQ(get.status, 200) << get.body;
  const std::string path = Json::parse(get.body).value("model_path", "");
  EXPECT_NE(path.find(a.model() + "/sampler_weights/"), std::string::npos) << get.body;
  auto foreign = b.Post("create_sampling_session", {{"session_id", b.session()}, {"sampling_session_seq_id", 5},
                                                    {"model_path", path}});
  EXPECT_EQ(foreign.status, 404) << foreign.body;

  // The context window W: prompt + max_tokens > W and a training datum > W are 400s that say so.
  auto long_prompt = a.Post("asample", a.SampleBody(sa, prompt, kWindow, 1, 1));
  EXPECT_EQ(long_prompt.status, 400) << long_prompt.body;
  EXPECT_NE(long_prompt.body.find("max_tokens"), std::string::npos) << long_prompt.body;
  EXPECT_NE(long_prompt.body.find(std::to_string(kWindow)), std::string::npos) << long_prompt.body;
  std::vector<int32_t> long_tokens(kWindow + 1, 3);
  auto long_datum = a.SubmitForward(long_tokens, std::vector<int64_t>(kWindow + 1, 4), false);
  EXPECT_EQ(long_datum.status, 400) << long_datum.body;
  EXPECT_NE(long_datum.body.find("context window of " + std::to_string(kWindow)), std::string::npos)
      << long_datum.body;
  EXPECT_NE(long_datum.body.find("data[0]"), std::string::npos) << long_datum.body;
  std::filesystem::remove_all(data_dir);
}

}  // namespace
}  // namespace loom
