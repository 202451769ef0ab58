// `loom serve --tp 2` end to end on the embedded tiny qwen3 (CPU, Gloo):
// rank 0 serves the API and starts rank 1 itself; sampling runs on a
// replica. A tenant's training on it gives the same logprobs as on a
// one-process server (same model, same seeds); its sampler snapshot (the
// whole adapter, gathered from both ranks) samples on the replica with the
// trainer's logprobs. Killing rank 1 shuts rank 0 down (exit 3): a group
// missing a rank cannot train.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "serve_process.h"
#include "tenant_client.h"

namespace loom {
namespace {

using namespace std::chrono_literals;

// Rank 1's pid: the child of rank 0 running `serve ... --group-rank 1`.
pid_t RankOne() {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    std::ifstream in(entry.path() / "cmdline");
    std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmd.find(std::string("--group-rank") + '\0' + "1") != std::string::npos && cmd.find("loom_tp_serve_") != std::string::npos)
      return static_cast<pid_t>(std::stoi(entry.path().filename().string()));
  }
  return -1;
}

TEST(TensorParallelServe, Tp2TrainsAsOneProcessAndSamplesOnAReplica) {
  const auto base = std::filesystem::temp_directory_path() / ("loom_tp_serve_" + std::to_string(::getpid()));
  std::filesystem::remove_all(base);
  const std::string one_dir = (base / "one").string(), tp_dir = (base / "tp").string();
  test::ServeProcess one(one_dir, {"--max-adapters", "2"});
  ASSERT_NE(one.port(), 0) << one.banner();
  const std::string model = one_dir + "/default-model";
  test::ServeProcess replica(tp_dir, {"--role", "sampler", "--model", model});
  ASSERT_NE(replica.port(), 0) << replica.banner();
  test::ServeProcess tp(tp_dir, {"--model", model, "--model-name", "loom/tiny-qwen3", "--max-adapters", "2", "--tp", "2",
                                 "--sampler-replicas", "127.0.0.1:" + std::to_string(replica.port())});
  ASSERT_NE(tp.port(), 0) << tp.banner();
  EXPECT_NE(tp.banner().find("tp=2"), std::string::npos) << tp.banner();

  test::TenantClient a(one.port(), "tml-tenant-a"), b(tp.port(), "tml-tenant-a");
  a.Start("loom/tiny-qwen3", 11);
  b.Start("loom/tiny-qwen3", 11);
  const std::vector<int32_t> tokens = {5, 17, 42, 9, 100, 3, 77};
  const std::vector<int64_t> targets = {17, 42, 9, 100, 3, 77, 8};
  for (int step = 0; step < 3; ++step) {
    a.TrainStep(step);
    b.TrainStep(step);
  }
  const std::vector<float> la = a.Forward(tokens, targets, true), lb = b.Forward(tokens, targets, true);
  ASSERT_EQ(la.size(), lb.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(lb[i], la[i], 1e-4) << i;

  const std::string sampling = b.SaveForSampling();
  const std::vector<int32_t> prompt = {5, 17, 42, 9};
  b.ExpectConsistent(prompt, b.Sample(sampling, prompt, 6, 2, 1234), "tp2 snapshot on the replica");

  const pid_t rank1 = RankOne();
  ASSERT_GT(rank1, 0) << "no process of rank 1";
  ::kill(rank1, SIGKILL);
  EXPECT_EQ(tp.Terminate(), 3);  // it had shut down already; SIGTERM again is harmless
  std::filesystem::remove_all(base);
}

}  // namespace
}  // namespace loom
