// The client-driven RL loop through the real `loom serve` (CPU, fp32; the
// embedded tiny qwen3, and make-model's tiny qwen3_moe, gpt_oss, deepseek_v2 and deepseek_v3 with LoRA on their
// experts): 3 tenants, concurrently, 3 steps each of
//   save_weights_and_get_sampling_client -> asample a group -> importance
//   sampling forward_backward on it -> optim_step.
// Every group is drawn from the version saved just before it: each sampled
// token's logprob equals the trainer's forward logprob of it on the adapter
// of that moment (1e-4). And training moves the adapter: the trainer's
// logprobs of a fixed probe differ from one step's version to the next.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "serve_process.h"
#include "tenant_client.h"

namespace loom {
namespace {

// The reward of a completion: the share of its tokens with an even id.
double Reward(const std::vector<int32_t>& tokens) {
  if (tokens.empty()) return 0;
  return static_cast<double>(std::count_if(tokens.begin(), tokens.end(), [](int32_t t) { return t % 2 == 0; })) /
         static_cast<double>(tokens.size());
}

class RlLoop : public ::testing::TestWithParam<std::string> {};

TEST_P(RlLoop, ThreeTenantsSampleTrainAndPublishEachStep) {
  const std::string arch = GetParam();
  const std::string data_dir = (std::filesystem::temp_directory_path() /
                                ("loom_rl_loop_" + arch + "_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(data_dir);
  std::vector<std::string> flags = {"--max-adapters", "3", "--max-rank", "8", "--sampler-adapters", "3"};
  std::string base_model = "loom/tiny-qwen3";
  if (arch != "qwen3") {
    const std::string model_dir = data_dir + "/model-" + arch;
    const std::string make = std::string(LOOM_BINARY) + " make-model --arch " + arch +
                             " --preset tiny --seed 3 --out " + model_dir + " > /dev/null";
    ASSERT_EQ(std::system(make.c_str()), 0) << make;
    base_model = "loom/tiny-" + arch;
    flags.insert(flags.end(), {"--model", model_dir, "--model-name", base_model});
  }
  test::ServeProcess server(data_dir, flags);
  ASSERT_NE(server.port(), 0) << "no listening banner: " << server.banner();

  constexpr int kTenants = 3, kSteps = 3, kGroup = 4, kNewTokens = 6;
  std::vector<std::thread> threads;
  for (int t = 0; t < kTenants; ++t) {
    threads.emplace_back([&, t] {
      test::TenantClient client(server.port(), "tml-rl-" + std::to_string(t));
      client.Start(base_model);
      const std::vector<int32_t> prompt = {5 + t, 17, 29, 41, 53, 65};
      const std::vector<int32_t> probe = {7, 11, 13, 19, 23, 31, 37, 43};
      const std::vector<int64_t> probe_targets(probe.begin() + 1, probe.end());
      const std::vector<int32_t> probe_in(probe.begin(), probe.end() - 1);
      std::vector<float> previous;
      for (int step = 0; step < kSteps; ++step) {
        const std::string who = "tenant " + std::to_string(t) + " step " + std::to_string(step);
        const std::string sampling = client.SaveForSampling();
        ASSERT_FALSE(sampling.empty()) << who;
        const wire::SampleResult group = client.Sample(sampling, prompt, kNewTokens, kGroup, 100 * t + step);
        ASSERT_EQ(group.sequences.size(), static_cast<size_t>(kGroup)) << who;
        client.ExpectConsistent(prompt, group, who);  // drawn from the version just saved
        const std::vector<float> now = client.Forward(probe_in, probe_targets, /*forward_only=*/true);
        ASSERT_EQ(now.size(), probe_in.size()) << who;
        if (!previous.empty()) {
          float moved = 0;
          for (size_t i = 0; i < now.size(); ++i) moved = std::max(moved, std::abs(now[i] - previous[i]));
          EXPECT_GT(moved, 1e-4f) << who << ": training did not move the adapter";
        }
        previous = now;
        std::vector<double> rewards;
        for (const auto& s : group.sequences) rewards.push_back(Reward(s.tokens));
        if (std::all_of(rewards.begin(), rewards.end(), [&](double r) { return r == rewards[0]; }))
          rewards[0] += 1.0;  // a group with equal rewards has no advantage; keep the step a real update
        client.TrainImportanceSampling(prompt, group, rewards);
      }
    });
  }
  for (auto& th : threads) th.join();
  std::filesystem::remove_all(data_dir);
}

INSTANTIATE_TEST_SUITE_P(Arch, RlLoop, ::testing::Values("qwen3", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe", "mimo_v2_flash",
                                           "glm_moe_dsa", "qwen3_5_moe_text"));

}  // namespace
}  // namespace loom
