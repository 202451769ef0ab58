// Publishing a version through the real `loom serve` (embedded tiny qwen3,
// CPU, fp32): save_weights_for_sampler takes the slot's snapshot on the
// engine thread, a writer thread writes the PEFT directory, and the sampler
// gets the snapshot from memory.
//  - A sample right after the save is of the saved version (its prompt
//    logprobs are the trainer's at the save, 1e-4) and read no file
//    (/metrics: 0 disk loads, 1 in-memory install), although the same
//    model trained twice more right after the save, without waiting for it.
//  - After a restart on the same --data-dir the path still samples the same
//    version, now loaded from its files (1 disk load), which are complete
//    and in place (nothing left in staging/).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "serve_process.h"
#include "tenant_client.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

const std::vector<int32_t> kProbe = {7, 11, 13, 19, 23, 31, 37, 43};

double Scrape(test::TenantClient& c, const std::string& series) {
  auto r = c.Get("/metrics");
  EXPECT_EQ(r.status, 200) << r.body;
  return test::Metric(r.body, series);
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-4) << what << " position " << i;
}

TEST(Publish, SampleAfterSaveIsFromMemoryUnchangedByLaterTrainingAndSurvivesARestart) {
  const std::string data_dir = (fs::temp_directory_path() / ("loom_publish_" + std::to_string(::getpid()))).string();
  fs::remove_all(data_dir);
  const std::vector<std::string> flags = {"--max-adapters", "2", "--max-rank", "8"};
  const std::vector<int32_t> probe_in(kProbe.begin(), kProbe.end() - 1);
  const std::vector<int64_t> probe_targets(kProbe.begin() + 1, kProbe.end());
  std::string path;
  std::vector<float> saved;  // the trainer's logprobs of the probe at the save
  {
    test::ServeProcess server(data_dir, flags);
    ASSERT_NE(server.port(), 0) << "no listening banner: " << server.banner();
    test::TenantClient c(server.port(), "tml-publisher");
    c.Start();
    c.TrainStep(1);
    saved = c.Forward(probe_in, probe_targets, /*forward_only=*/true);
    const auto submitted = c.SubmitSave("v1");
    c.TrainStep(2);  // seq_ids after the save's, sent before its answer
    c.TrainStep(3);
    path = c.Result(submitted).value("path", "");
    ASSERT_NE(path.find("/sampler_weights/v1"), std::string::npos) << path;
    const std::vector<float> trained = c.Forward(probe_in, probe_targets, /*forward_only=*/true);

    const std::vector<float> sampled = c.PromptLogprobs(c.SamplingOn(path), kProbe);
    ExpectNear(sampled, saved, "the sample right after the save");
    float moved = 0;
    for (size_t i = 0; i < trained.size() && i < saved.size(); ++i) moved = std::max(moved, std::abs(trained[i] - saved[i]));
    EXPECT_GT(moved, 1e-3f) << "the later training must have moved the trainer's adapter";
    EXPECT_EQ(Scrape(c, "loom_sampler_adapter_loads_total"), 0);
    EXPECT_EQ(Scrape(c, "loom_sampler_adapter_installs_total"), 1);
    EXPECT_EQ(Scrape(c, "loom_publishes_total{result=\"ok\"}"), 1);
    // The save's engine-thread time is counted, copy and hand-off apart.
    EXPECT_GT(Scrape(c, "loom_snapshot_seconds_total{part=\"copy\"}"), 0);
    EXPECT_GE(Scrape(c, "loom_snapshot_seconds_total{part=\"handoff\"}"), 0);  // -1: no such series
    EXPECT_EQ(server.Terminate(), 0);
  }
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(data_dir + "/runs")) {
    const std::string p = e.path().string();
    if (p.find("/sampler_weights/v1/") == std::string::npos) continue;
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "adapter_config.json" || name == "adapter_model.safetensors") << p;
    EXPECT_GT(fs::file_size(e.path()), 0u) << p;
    ++files;
  }
  EXPECT_EQ(files, 2);
  EXPECT_TRUE(fs::is_empty(data_dir + "/staging"));

  test::ServeProcess again(data_dir, flags);
  ASSERT_NE(again.port(), 0) << "no listening banner after the restart: " << again.banner();
  test::TenantClient c(again.port(), "tml-publisher");  // the same key: the same tenant
  c.Start();
  ExpectNear(c.PromptLogprobs(c.SamplingOn(path), kProbe), saved, "the sample after the restart");
  EXPECT_EQ(Scrape(c, "loom_sampler_adapter_loads_total"), 1);
  EXPECT_EQ(Scrape(c, "loom_sampler_adapter_installs_total"), 0);
  fs::remove_all(data_dir);
}

}  // namespace
}  // namespace loom
